"""The series' next run continues the series' unfinished run before it takes new prompts, every prompt once.

Real `datagen run` processes (the CLI's own Prefect API server) of a series config, without `--run-id`, against
a stand-in server:

1. The first run is SIGKILLed (its whole process group) with a shard half answered and the others unsent, as a
   window's end or a crash leaves a run: its ledger holds prompts it has not published.
2. The series' next run (`datagen run --config` again, no run id) continues that run instead of taking new
   prompts: it says so, sends exactly the requests without a stored answer, each once, and publishes v0001.
3. The run after it takes new prompts only (none of the first run's), and publishes v0002 on top of v0001.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from tests.support.fault_server import FaultPlan, FaultServer
from tests.support.run_configs import external_run_config, write_prompts

REPO = Path(__file__).resolve().parents[2]
PROMPTS_IN_FILE = 30
PROMPTS_PER_RUN = 12
SHARD_SIZE = 4
ANSWERED_BEFORE_KILL = 3
STEP_TIMEOUT_S = 240.0


def _config(tmp_path: Path, url: str, model_dir: Path) -> Path:
    path = external_run_config(
        tmp_path / "nightly.yaml",
        server_url=url,
        model_dir=model_dir,
        prompts=write_prompts(tmp_path / "prompts.jsonl", PROMPTS_IN_FILE, "Series question"),
        dataset="series",
        shard_size=SHARD_SIZE,
        in_flight=2,
        output=str(tmp_path / "out"),
        protected=str(tmp_path / "train"),
        generation={"checkpoint_every": 1, "checkpoint_interval_s": 0.2, "backoff_initial_s": 0.05},
    )
    data = yaml.safe_load(path.read_text())
    data["series"] = "nightly"
    data["datasets"][0]["max_prompts"] = PROMPTS_PER_RUN
    path.write_text(yaml.safe_dump(data))
    return path


def _env(tmp_path: Path, prefect_api: str) -> dict[str, str]:
    env = {
        **os.environ,
        "DATAGEN_STATE_DIR": str(tmp_path / "state"),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
    }
    env["PREFECT_API_URL"] = prefect_api
    return env


def _command(config: Path) -> list[str]:
    return [sys.executable, "-m", "flows.cli_entry", "run", "--config", str(config)]


def _rows(files: list[Path]) -> list[dict[str, Any]]:
    return [json.loads(line) for file in files for line in file.read_text().splitlines() if line.strip()]


def _stored_answers(run_root: Path) -> set[str]:
    """The prompt ids of every answer stored so far (checkpoint parts included)."""
    return {row["prompt_id"] for row in _rows(sorted((run_root / "parts").rglob("completions-*.jsonl")))}


def _prompt_texts(run_root: Path) -> dict[str, str]:
    """Prompt id -> the text of its last message, for every prompt the run took."""
    return {
        row["prompt_id"]: row["messages"][-1]["content"]
        for row in _rows(sorted((run_root / "prompts").rglob("shard-*.jsonl")))
    }


def _sent(server: FaultServer, since: int) -> list[str]:
    return [request.body["messages"][-1]["content"] for request in server.chat_requests()[since:]]


def test_the_series_next_run_finishes_an_unfinished_run_once_then_the_next_takes_new_prompts(
    tmp_path: Path, tiny_model_dir: Path, prefect_api: str
) -> None:
    env = _env(tmp_path, prefect_api)
    runs = tmp_path / "out" / "runs"
    with FaultServer(FaultPlan(base_delay_s=0.2)) as server, contextlib.ExitStack() as cleanup:
        config = _config(tmp_path, server.url, tiny_model_dir)

        # 1. The first run of the series, killed with a shard half answered (its ledger already written).
        first = subprocess.Popen(
            _command(config),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        cleanup.callback(lambda: first.poll() is None and os.killpg(first.pid, signal.SIGKILL))
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while not [root for root in runs.glob("*") if len(_stored_answers(root)) >= ANSWERED_BEFORE_KILL]:
            assert first.poll() is None, "the first run ended before it was killed"
            assert time.monotonic() < deadline, "the first run stored too few answers in time"
            time.sleep(0.05)
        server.answering.clear()  # what is in flight now stays unanswered: never stored
        time.sleep(1.0)  # the last answers' checkpoint parts land
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
        (run_root,) = runs.iterdir()
        run_id = run_root.name
        assert (tmp_path / "out" / "series" / "nightly" / "ledger" / f"{run_id}.jsonl").exists()
        assert not (run_root / "manifest.json").exists()
        taken = _prompt_texts(run_root)
        answered_before = _stored_answers(run_root)
        assert len(taken) == PROMPTS_PER_RUN and ANSWERED_BEFORE_KILL <= len(answered_before) < len(taken)

        # 2. The series' next run continues it: exactly the unanswered requests, each once.
        server.answering.set()
        sent_before = len(server.chat_requests())
        second = subprocess.run(
            _command(config), env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=False
        )
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
        assert f"continuing run {run_id} of series nightly" in second.stderr, second.stderr[-3000:]
        assert [root.name for root in runs.iterdir()] == [run_id], "the continuation is the same run"
        resent = _sent(server, sent_before)
        remaining = sorted(text for prompt_id, text in taken.items() if prompt_id not in answered_before)
        assert sorted(resent) == remaining, "exactly the requests without a stored answer, each once"

        # 3. The run after it takes new prompts only, and builds version 2 on version 1.
        sent_before = len(server.chat_requests())
        third = subprocess.run(
            _command(config), env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=False
        )
        assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
        assert "continuing run" not in third.stderr
        (new_root,) = [root for root in runs.iterdir() if root.name != run_id]
        new_taken = _prompt_texts(new_root)
        assert len(new_taken) == PROMPTS_PER_RUN and not set(new_taken) & set(taken)
        assert sorted(_sent(server, sent_before)) == sorted(new_taken.values())

    completions = _rows(sorted((run_root / "completions").rglob("*.jsonl")))
    assert sorted(row["prompt_id"] for row in completions) == sorted(taken), "every prompt answered once"
    versions = tmp_path / "out" / "datasets"
    (v1,) = versions.rglob("v0001.json")
    (v2,) = versions.rglob("v0002.json")
    assert json.loads(v1.read_text())["rows"] == PROMPTS_PER_RUN
    assert json.loads(v2.read_text())["rows"] == 2 * PROMPTS_PER_RUN
    series_entry = json.loads((new_root / "series.json").read_text())
    assert series_entry["earlier_runs"] == [run_id]
    assert series_entry["base_version"].endswith("v0001.json")
