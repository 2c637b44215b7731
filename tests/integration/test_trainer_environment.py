"""Training comes back to the environment it left, and datagen never runs in the trainer's environment.

The stand-in trainer runs from a venv of its own holding a torch distribution (a dist-info and a
``torch/version.py``, as a real CUDA build lays them out; nothing imports it). Real ``datagen run`` processes
halt it through its pidfile and generate from a fake OpenAI server; between the halt and the hand-back the
test "upgrades" torch in the trainer's venv, as installing the serving stack there once did.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from datagen.errors import DatagenError
from datagen.host.trainer_env import environment_changes, read_environment, read_process_environment
from tests.support.fault_server import FaultPlan, FaultServer
from tests.support.standin_trainers import (
    REPO,
    alive,
    install_torch,
    kill,
    make_trainer_venv,
    trainer_argv,
    trainers,
    wait_pid,
)

EXIT_TRAINING_HELD_BACK = 3
CLI_TIMEOUT_S = 300
# Long enough that the test swaps torch while the run still generates (after the halt, before the hand-back).
FAKE_SERVER_DELAY_S = 0.5
PROMPTS = 12


def _trainer_argv(venv: Path, tmp_path: Path) -> list[str]:
    return trainer_argv(venv / "bin" / "python", tmp_path / "trainer.pid", tmp_path / "checkpoints")


@pytest.fixture()
def trainer(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """The stand-in trainer, started from its own venv (torch cu128); (venv, pid)."""
    venv = make_trainer_venv(tmp_path, "cu128")
    process = subprocess.Popen(_trainer_argv(venv, tmp_path), start_new_session=True)
    pid = wait_pid(tmp_path / "trainer.pid")
    yield venv, pid
    process.kill()
    process.wait(10)
    with_restarted = tmp_path / "trainer.pid"
    if with_restarted.exists():
        kill(int(with_restarted.read_text().strip() or 0) or pid)


def _config(tmp_path: Path, venv: Path, url: str, run_output: Path) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            f'{{"messages": [{{"role": "user", "content": "question {index:03d}: explain it."}}]}}\n'
            for index in range(PROMPTS)
        )
    )
    data: dict[str, Any] = {
        "model": {"path": str(tmp_path / "tiny-model")},
        "fleet": {"engine": "external", "external_urls": [url], "max_inflight_per_server": 2},
        "sampling": {"max_tokens": 16},
        "datasets": [{"name": "questions", "format": "openai_messages", "path": str(prompts)}],
        "output": str(run_output),
        "protected_prefixes": [str(tmp_path / "existing-train-data")],
        "generation": {"checkpoint_every": 4, "request_timeout_s": 30},
        "training": {
            "kind": "pidfile",
            "pidfile": str(tmp_path / "trainer.pid"),
            "stop_timeout_s": 30,
            "restart_after_run": True,
            "restart_command": _trainer_argv(venv, tmp_path),
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _run(config: Path, run_id: str, tmp_path: Path, prefect_api: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "DATAGEN_STATE_DIR": str(tmp_path / "state"),
        "DATAGEN_LOCK_DIR": str(tmp_path / "locks"),
        "PREFECT_API_URL": prefect_api,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "flows.cli_entry", "run", "--config", str(config), "--run-id", run_id]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_environment_is_read_through_the_trainers_own_interpreter(trainer: tuple[Path, int]) -> None:
    venv, pid = trainer
    found = read_process_environment(pid)

    assert found is not None
    assert found.interpreter == str(venv / "bin" / "python") and Path(found.prefix) == venv
    assert found.torch_version == "2.11.0+cu128" and found.torch_cuda == "12.8"
    assert environment_changes(found, read_environment(found.interpreter)) == []
    install_torch(venv, "cu130")
    assert environment_changes(found, read_environment(found.interpreter)) == [
        "torch CUDA build 12.8 -> 13.0",
        "torch 2.11.0+cu128 -> 2.11.0+cu130",
    ]


def test_a_changed_environment_holds_the_restart_back_and_the_next_run_restarts_it_once(
    trainer: tuple[Path, int], tmp_path: Path, tiny_model_dir: Path, prefect_api: str
) -> None:
    venv, first_pid = trainer
    os.symlink(tiny_model_dir, tmp_path / "tiny-model")
    pidfile = tmp_path / "trainer.pid"
    with FaultServer(FaultPlan(base_delay_s=FAKE_SERVER_DELAY_S)) as server:
        config = _config(tmp_path, venv, server.url, tmp_path / "out")
        held = _run(config, "env-changed", tmp_path, prefect_api)
        # Halted: torch is "upgraded" in the trainer's venv while the run still generates.
        deadline = time.monotonic() + CLI_TIMEOUT_S
        while alive(first_pid):
            assert held.poll() is None and time.monotonic() < deadline, held.communicate()
            time.sleep(0.05)
        install_torch(venv, "cu130")
        out, err = held.communicate(timeout=CLI_TIMEOUT_S)

        assert held.returncode == EXIT_TRAINING_HELD_BACK, out + err
        last = err.strip().splitlines()[-1]
        assert last.startswith(
            "datagen: run env-changed is complete and stored, but training was not restarted"
        )
        assert "torch 2.11.0+cu128 -> 2.11.0+cu130" in last and "training.allow_env_change: true" in last
        assert int(pidfile.read_text().strip()) == first_pid  # nothing restarted
        assert (tmp_path / "out" / "runs" / "env-changed" / "manifest.json").exists()

        # Rolled back: the next run on the box adopts the kept halt and restarts training, once.
        install_torch(venv, "cu128")
        again = _run(config, "env-restored", tmp_path, prefect_api)
        out, err = again.communicate(timeout=CLI_TIMEOUT_S)
        assert again.returncode == 0, out + err
    restarted = wait_pid(pidfile, not_pid=first_pid)
    try:
        assert read_process_environment(restarted) is not None
        time.sleep(1.0)  # a second restart, if any, would have started by now
        assert trainers(tmp_path / "checkpoints") == [restarted]
        # The halt is handed back (claimed): no later run restarts it again.
        assert list((tmp_path / "locks").glob("*.training-halted.json.handed-back"))
        assert not list((tmp_path / "locks").glob("*.training-halted.json"))
    finally:
        kill(restarted)


def test_preflight_refuses_to_run_from_the_trainers_environment(tmp_path: Path) -> None:
    from datagen.app.preflight import _refuse_the_trainers_environment

    # A trainer running from the interpreter datagen runs from.
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        with pytest.raises(DatagenError, match="datagen runs from the training job's environment"):
            _refuse_the_trainers_environment([process.pid])
    finally:
        process.kill()
        process.wait()
