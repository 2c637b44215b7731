"""P13's three steps, as a new user meets them: `datagen run` on the embedded Prefect server, SIGKILLed.

1. A run is SIGKILLed (its whole process group) about a third of the way through generation.
2. The resume command it would print starts at once: it never waits for the dead run's GPU lock, and its
   first request goes out within 30 s of its start.
3. Meanwhile a second run on the same host, with a state folder of its own (another user, container or
   worker), waits for the GPUs, naming the holder, and SIGTERM ends it at once with exit 143, leaving
   nothing running.
Finally the resume answers every request exactly once.

The runs share PREFECT_HOME (the embedded server's database, where the old Prefect-limit lock kept its
slot) and the box's lock folder (DATAGEN_LOCK_DIR), as two runs on one box do; the lock does not depend on
DATAGEN_STATE_DIR.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.fault_server import FaultPlan, FaultServer
from tests.support.prefect_db import seed_prefect_home

REPO = Path(__file__).resolve().parents[2]
PROMPTS = 60
KILL_AFTER_REQUESTS = PROMPTS // 3
RESUME_FIRST_REQUEST_BUDGET_S = 30.0
SIGNAL_EXIT_BUDGET_S = 30.0
STEP_TIMEOUT_S = 180.0


def _config(tmp_path: Path, url: str, model_dir: Path) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"Lock question {index:03d}: why?"}]}) + "\n"
            for index in range(PROMPTS)
        )
    )
    config = {
        "model": {"path": str(model_dir)},
        "fleet": {"engine": "external", "external_urls": [url], "max_inflight_per_server": 2},
        "sampling": {"temperature": 0.7, "max_tokens": 8},
        "datasets": [{"name": "lock", "format": "openai_messages", "path": str(prompts), "shard_size": 20}],
        "output": str(tmp_path / "out"),
        "protected_prefixes": [str(tmp_path / "train")],
        "generation": {"checkpoint_every": 2, "checkpoint_interval_s": 0.2, "backoff_initial_s": 0.05},
        "training": {"kind": "none"},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class _Run:
    """One `datagen run` in its own process group (a shell job), its output collected as it comes."""

    def __init__(self, config: Path, run_id: str, env: dict[str, str]) -> None:
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "flows.cli_entry", "run", "--config", str(config), "--run-id", run_id],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in iter(self.process.stdout.readline, ""):
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for_line(self, needle: str, timeout_s: float = STEP_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if needle in line:
                    return line
            assert self.process.poll() is None, self.text[-4000:]
            time.sleep(0.1)
        raise AssertionError(f"no line with {needle!r} within {timeout_s:.0f}s:\n{self.text[-4000:]}")

    def signal_group(self, signum: signal.Signals) -> None:
        os.killpg(self.process.pid, signum)

    def finish(self, timeout_s: float = STEP_TIMEOUT_S) -> int:
        """Wait for the run to end; past ``timeout_s`` (0: at once) kill its whole process group."""
        try:
            return self.process.wait(timeout_s) if timeout_s > 0 else self.process.returncode
        except subprocess.TimeoutExpired:
            return -1
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            self.reader.join(10)


def _api_server_pids(text: str) -> list[int]:
    """Processes serving the Prefect API on the port the run's output names (its temporary server)."""
    ports = set(re.findall(r"View at http://127\.0\.0\.1:(\d+)/", text))
    pids = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"prefect.server.api.server:create_app" in argv and any(p.encode() in argv for p in ports):
                pids.append(int(proc.name))
    return pids


def _wait_for_requests(
    server: FaultServer, count: int, run: _Run, timeout_s: float = STEP_TIMEOUT_S
) -> float:
    deadline = time.monotonic() + timeout_s
    while len(server.chat_requests()) < count:
        assert run.process.poll() is None, run.text[-4000:]
        assert time.monotonic() < deadline, f"fewer than {count} requests arrived:\n{run.text[-4000:]}"
        time.sleep(0.05)
    return time.monotonic()


def _stored_keys(run_root: Path) -> list[str]:
    return [
        f"{row['prompt_id']}/{row['sample_index']}"
        for kind in ("completions", "failures")
        for file in (run_root / kind).rglob("*.jsonl")
        for row in map(json.loads, file.read_text().splitlines())
    ]


def test_a_killed_run_never_locks_the_host_and_a_run_waiting_for_the_gpus_obeys_sigterm(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    env: dict[str, Any] = {
        **os.environ,
        "DATAGEN_STATE_DIR": str(tmp_path / "state"),
        "PREFECT_HOME": str(seed_prefect_home(tmp_path / "prefect-home")),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("PREFECT_API_URL", None)  # the CLI's own temporary server, as on a fresh host
    runs: list[_Run] = []

    env["DATAGEN_LOCK_DIR"] = str(tmp_path / "box-locks")

    def start(run_id: str, **extra: str) -> _Run:
        runs.append(_Run(config, run_id, {**env, **extra}))
        return runs[-1]

    with FaultServer(FaultPlan(base_delay_s=0.1)) as server, contextlib.ExitStack() as cleanup:
        # Whatever fails below, no run of this test is left running (each is its own process group).
        cleanup.callback(lambda: [run.finish(0) for run in runs if run.process.poll() is None])
        config = _config(tmp_path, server.url, tiny_model_dir)

        # 1. Killed outright a third of the way through.
        killed = start("lock-1")
        _wait_for_requests(server, KILL_AFTER_REQUESTS, killed)
        killed.signal_group(signal.SIGKILL)
        killed.finish(30)
        sent_before = len(server.chat_requests())

        # 2. The resume takes the GPUs at once and sends its first request within the budget.
        resume = start("lock-1")
        first_request_at = _wait_for_requests(server, sent_before + 1, resume)
        server.answering.clear()  # keep the resume mid-generation (holding the GPUs) while a second run waits
        assert first_request_at - resume.started <= RESUME_FIRST_REQUEST_BUDGET_S, resume.text[-4000:]

        # 3. Another run waits for the GPUs, names the holder, and SIGTERM ends it at once.
        waiting = start("lock-2", DATAGEN_STATE_DIR=str(tmp_path / "another-users-state"))
        line = waiting.wait_for_line("another run holds this host's GPUs")
        assert "held by run lock-1" in line, line
        api_pids = _api_server_pids(waiting.text)
        assert api_pids, waiting.text[-4000:]
        signalled = time.monotonic()
        waiting.signal_group(signal.SIGTERM)
        code = waiting.finish(SIGNAL_EXIT_BUDGET_S + 30)
        exit_s = time.monotonic() - signalled
        assert code == 143, waiting.text[-4000:]
        assert exit_s <= SIGNAL_EXIT_BUDGET_S, f"the waiting run took {exit_s:.1f}s to end"
        assert "interrupted by SIGTERM" in waiting.text.strip().splitlines()[-1]
        time.sleep(1.0)
        assert not [pid for pid in api_pids if Path(f"/proc/{pid}").exists()], "its API server still runs"

        server.answering.set()
        assert resume.finish() == 0, resume.text[-4000:]
    assert "another run holds this host's GPUs" not in resume.text, (
        "the resume waited for the dead run's lock"
    )
    keys = _stored_keys(tmp_path / "out" / "runs" / "lock-1")
    assert len(keys) == len(set(keys)) == PROMPTS, "every request exactly once"


def test_a_slot_left_taken_by_the_old_prefect_limit_lock_is_released_with_a_log_line(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.context import FlowRunContext
    from prefect.logging.handlers import APILogHandler

    from datagen.settings import get_settings
    from tasks.runtime import hold_host_gpus

    name = f"datagen-gpus-stale-{os.getpid()}"
    monkeypatch.setenv("DATAGEN_GPU_LOCK", name)
    monkeypatch.setenv("DATAGEN_LOCK_DIR", str(tmp_path / "box-locks"))
    get_settings.cache_clear()
    with get_client(sync_client=True) as client:
        # What a run of the previous version, killed with its temporary server, left in the database.
        client.create_global_concurrency_limit(
            GlobalConcurrencyLimitCreate(name=name, limit=1, active_slots=1)
        )

    @flow
    def takes_the_gpus() -> tuple[str, str]:
        context = FlowRunContext.get()
        assert context is not None and context.flow_run is not None
        with hold_host_gpus("stale-run") as gpus:
            return str(gpus.lock_file), str(context.flow_run.id)

    try:
        lock_file, flow_run_id = takes_the_gpus()
        APILogHandler().flush()
        with get_client(sync_client=True) as client:
            assert client.read_global_concurrency_limit_by_name(name).active_slots == 0
            # The run's log, as the UI shows it (logs reach the API in batches: poll briefly).
            wanted = f"released 1 slot(s) of the Prefect global concurrency limit {name} left taken"
            deadline = time.monotonic() + 30
            while True:
                logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
                if any(wanted in log.message for log in logs) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
    finally:
        get_settings.cache_clear()
    assert lock_file == str(tmp_path / "box-locks" / f"{name}.lock")
    assert any(wanted in log.message for log in logs), [log.message for log in logs]
