"""datagen.gc_tuning: the collector settings, and `python -m datagen.gc_tuning MODULE` as `python -m MODULE`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from datagen.gc_tuning import MIDDLE_COLLECTION_EVERY, OLD_COLLECTION_EVERY, USAGE, YOUNG_COLLECTION_EVERY

REPO = Path(__file__).resolve().parents[2]
TUNED = [YOUNG_COLLECTION_EVERY, MIDDLE_COLLECTION_EVERY, OLD_COLLECTION_EVERY]


def _python(
    *args: str, cwd: Path | None = None, path: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in (REPO, path) if p is not None))
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=60, check=False, env=env, cwd=cwd
    )


def test_a_module_runs_as_main_with_its_arguments_its_exit_code_and_the_tuned_collector(
    tmp_path: Path,
) -> None:
    (tmp_path / "probe.py").write_text(
        "import gc, json, sys\n"
        "if __name__ == '__main__':\n"
        "    print(json.dumps({'argv': sys.argv, 'threshold': gc.get_threshold()}))\n"
        "    sys.exit(3)\n"
    )

    run = _python("-m", "datagen.gc_tuning", "probe", "serve", "--port", "1", path=tmp_path)

    assert run.returncode == 3, run.stderr
    seen = json.loads(run.stdout)
    assert seen["argv"] == [str(tmp_path / "probe.py"), "serve", "--port", "1"]
    assert seen["threshold"] == TUNED
    # What `python -m probe serve --port 1` gives the module: the same argv.
    plain = _python("-m", "probe", "serve", "--port", "1", path=tmp_path)
    assert json.loads(plain.stdout)["argv"] == seen["argv"]


def test_without_a_module_it_prints_the_usage_and_exits_2() -> None:
    for args in ([], ["--port", "1"]):
        run = _python("-m", "datagen.gc_tuning", *args)
        assert run.returncode == 2
        assert USAGE in run.stderr


def test_the_heap_is_frozen_after_the_other_exit_handlers_and_tuning_twice_registers_once() -> None:
    code = (
        "import atexit, gc\n"
        "atexit.register(lambda: print('frozen at exit', gc.get_freeze_count() > 0))\n"
        "from datagen.gc_tuning import tune_garbage_collector\n"
        "tune_garbage_collector()\n"
        "tune_garbage_collector()\n"
        "atexit.register(lambda: print('frozen before', gc.get_freeze_count() > 0))\n"
        "print('threshold', list(gc.get_threshold()))\n"
    )

    run = _python("-c", code)

    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [f"threshold {TUNED}", "frozen before False", "frozen at exit True"]
    assert atexit_calls_of_freeze(code) == 1


def atexit_calls_of_freeze(code: str) -> int:
    """How many times gc.freeze runs at exit after ``code`` (counted by wrapping it first)."""
    counting = (
        "import gc\n"
        "calls = []\n"
        "real_freeze = gc.freeze\n"
        "gc.freeze = lambda: calls.append(1) or real_freeze()\n"
        "import atexit\n"
        "atexit.register(lambda: print('freeze calls', len(calls)))\n"
    )
    run = _python("-c", counting + code)
    assert run.returncode == 0, run.stderr
    return int(run.stdout.splitlines()[-1].split()[-1])
