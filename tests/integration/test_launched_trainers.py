"""A trainer started by a launcher is stopped whole, waited for, and restarted once: real `datagen run`s.

Operators start trainers through launchers: a shell that writes its own pid to the pidfile and runs Python as
its child (``nohup bash train.sh &``, a systemd unit whose main process is a shell), which does not pass a
SIGTERM on, or torchrun and accelerate, which do. datagen cannot know which one it talks to. Each test halts a
stand-in trainer (:mod:`datagen.host.standin_trainer`, in a venv of its own) through the launcher's pidfile,
generates from a fake OpenAI server, and hands the GPUs back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.fault_server import FaultPlan, FaultServer
from tests.support.standin_trainers import (
    REPO,
    alive,
    forwarding_launcher_argv,
    install_torch,
    kill,
    make_trainer_venv,
    shell_launcher_argv,
    trainer_argv,
    trainers,
    wait_pid,
)

CLI_TIMEOUT_S = 300
PROMPTS = 8
EXIT_RUN_FAILED = 1
EXIT_TRAINING_HELD_BACK = 3
# A trainer that ignores the stop is given this long before the halt gives up (escalate: false).
SHORT_STOP_TIMEOUT_S = 3


@dataclass
class Box:
    """One test's training box: the trainer venv, its launcher's pidfile, checkpoints and signal events."""

    root: Path
    venv: Path
    pidfile: Path
    checkpoints: Path
    events: Path
    launcher: list[str] = field(default_factory=list)

    def trainer(self, *, ignore_first: bool = False) -> list[str]:
        """The trainer's own command (it writes its pid to a file of its own, not the launcher's pidfile)."""
        return trainer_argv(
            self.venv / "bin" / "python",
            self.root / "trainer-own.pid",
            self.checkpoints,
            events=self.events,
            ignore_first=ignore_first,
        )

    def started(self) -> list[int]:
        """Every trainer process that ever started (from its events)."""
        lines = self.events.read_text().splitlines() if self.events.exists() else []
        return [int(line.split()[1]) for line in lines if line.startswith("start ")]

    def signals(self, pid: int) -> list[str]:
        """The signals trainer ``pid`` received."""
        lines = self.events.read_text().splitlines() if self.events.exists() else []
        return [line.split()[1] for line in lines if line.startswith("signal ") and line.endswith(f" {pid}")]


@pytest.fixture()
def box(tmp_path: Path) -> Iterator[Box]:
    """A trainer venv (torch cu128) and the files of one trainer; every trainer it started is killed after."""
    found = Box(
        root=tmp_path,
        venv=make_trainer_venv(tmp_path, "cu128"),
        pidfile=tmp_path / "train.pid",
        checkpoints=tmp_path / "checkpoints",
        events=tmp_path / "trainer-events.txt",
    )
    yield found
    for pid in found.started():
        kill(pid)
    if found.pidfile.exists():
        kill(int(found.pidfile.read_text().strip() or 0))


def _launch(box: Box, launcher: list[str]) -> tuple[int, int]:
    """Start ``launcher`` detached (as an operator's shell would); (launcher pid, trainer pid) once both run."""
    box.launcher = launcher
    subprocess.Popen(launcher, start_new_session=True, stdin=subprocess.DEVNULL)
    launcher_pid = wait_pid(box.pidfile)
    # The trainer writes its own pid once its stop handler is installed: a stop before that would kill it
    # without a checkpoint, which no operator's halt meets (their trainer has long been running).
    trainer_pid = wait_pid(box.root / "trainer-own.pid")
    assert trainers(box.checkpoints) == [trainer_pid]
    return launcher_pid, trainer_pid


def _config(box: Box, url: str, *, stop_timeout_s: float = 30) -> Path:
    prompts = box.root / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"question {index:03d}: explain it."}]})
            + "\n"
            for index in range(PROMPTS)
        )
    )
    data: dict[str, Any] = {
        "model": {"path": str(box.root / "tiny-model")},
        "fleet": {"engine": "external", "external_urls": [url], "max_inflight_per_server": 2},
        "sampling": {"max_tokens": 16},
        "datasets": [{"name": "questions", "format": "openai_messages", "path": str(prompts)}],
        "output": str(box.root / "out"),
        "protected_prefixes": [str(box.root / "existing-train-data")],
        "generation": {"checkpoint_every": 4, "request_timeout_s": 30},
        "training": {
            "kind": "pidfile",
            "pidfile": str(box.pidfile),
            "checkpoint_glob": str(box.checkpoints / "checkpoint-*.pt"),
            "stop_timeout_s": stop_timeout_s,
            "escalate": False,
            "restart_after_run": True,
            "restart_command": box.launcher,
        },
    }
    path = box.root / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _run(box: Box, config: Path, run_id: str, prefect_api: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DATAGEN_STATE_DIR": str(box.root / "state"),
        "DATAGEN_LOCK_DIR": str(box.root / "locks"),
        "PREFECT_API_URL": prefect_api,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "flows.cli_entry", "run", "--config", str(config), "--run-id", run_id]
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False
    )


class _ExitWatch:
    """Notes (monotonic time) when a process is gone, to compare with the fake server's first request."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.gone_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            if not alive(self.pid):
                self.gone_at = time.monotonic()
                return
            time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _attempt_record(box: Box, run_id: str, name: str) -> dict[str, Any]:
    (path,) = (box.root / "out" / "runs" / run_id / "attempts").glob(f"*/{name}")
    return json.loads(path.read_text())


def _one_restarted_trainer(box: Box, old: set[int]) -> int:
    """The one trainer the hand-back started (waits for it); fails if more than one runs."""
    deadline = time.monotonic() + 30
    while not trainers(box.checkpoints):
        assert time.monotonic() < deadline, "training was not restarted"
        time.sleep(0.05)
    time.sleep(1.0)  # a second restart, if any, would have started by now
    running = trainers(box.checkpoints)
    assert len(running) == 1 and not set(running) & old, running
    return running[0]


@pytest.mark.parametrize("launch", ["shell", "forwarding"])
def test_a_launched_trainer_is_stopped_whole_before_generation_and_restarted_once(
    launch: str, box: Box, tiny_model_dir: Path, prefect_api: str
) -> None:
    os.symlink(tiny_model_dir, box.root / "tiny-model")
    argv = shell_launcher_argv if launch == "shell" else forwarding_launcher_argv
    launcher_pid, trainer_pid = _launch(box, argv(box.pidfile, box.trainer()))
    watch = _ExitWatch(trainer_pid)
    with FaultServer(FaultPlan()) as server:
        result = _run(box, _config(box, server.url), f"launched-{launch}", prefect_api)
        first_request = min(request.arrived_at for request in server.chat_requests())
    watch.close()

    assert result.returncode == 0, result.stdout + result.stderr
    # The trainer itself got the stop (through its launcher, or from the halt once the shell was gone), wrote
    # its checkpoint and was gone before the first request.
    assert box.signals(trainer_pid) and box.signals(trainer_pid)[0] == "SIGTERM"
    assert watch.gone_at is not None and watch.gone_at < first_request
    assert not alive(launcher_pid)
    checkpoints = sorted(box.checkpoints.glob("checkpoint-*.pt"))
    assert checkpoints
    halt = _attempt_record(box, f"launched-{launch}", "training.json")
    assert halt["stopped"] and not halt["escalated"]
    assert halt["pid"] == launcher_pid and trainer_pid in halt["pids"]
    assert halt["last_checkpoint"] == str(checkpoints[-1])
    assert halt["waited_s"] > 0
    # Exactly one trainer runs after the hand-back, a new one.
    _one_restarted_trainer(box, {trainer_pid})


def test_a_trainer_that_ignores_the_stop_fails_the_run_before_generation_and_nothing_restarts(
    box: Box, tiny_model_dir: Path, prefect_api: str
) -> None:
    os.symlink(tiny_model_dir, box.root / "tiny-model")
    launcher_pid, trainer_pid = _launch(box, shell_launcher_argv(box.pidfile, box.trainer(ignore_first=True)))
    with FaultServer(FaultPlan()) as server:
        config = _config(box, server.url, stop_timeout_s=SHORT_STOP_TIMEOUT_S)
        result = _run(box, config, "stubborn", prefect_api)
        requests = server.chat_requests()

    assert result.returncode == EXIT_RUN_FAILED, result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "run stubborn failed: training" in last and f"pid {trainer_pid} (" in last, last
    assert "would not stop" in last
    assert box.signals(trainer_pid) == ["SIGTERM"]
    assert not requests  # nothing was generated
    time.sleep(1.0)
    assert box.started() == [trainer_pid]  # nothing restarted
    assert trainers(box.checkpoints) == [trainer_pid]
    assert not alive(launcher_pid)


def test_a_changed_torch_build_under_a_shell_launcher_holds_the_restart_back(
    box: Box, tiny_model_dir: Path, prefect_api: str
) -> None:
    os.symlink(tiny_model_dir, box.root / "tiny-model")
    launcher_pid, trainer_pid = _launch(box, shell_launcher_argv(box.pidfile, box.trainer()))
    # Generation is slow enough that torch changes after the halt and before the hand-back.
    with FaultServer(FaultPlan(base_delay_s=0.5)) as server:
        config = _config(box, server.url)
        command_done: dict[str, subprocess.CompletedProcess[str]] = {}
        runner = threading.Thread(
            target=lambda: command_done.update(run=_run(box, config, "shell-env", prefect_api))
        )
        runner.start()
        deadline = time.monotonic() + CLI_TIMEOUT_S
        while alive(trainer_pid):
            assert runner.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        install_torch(box.venv, "cu130")
        runner.join(CLI_TIMEOUT_S)
    result = command_done["run"]

    assert result.returncode == EXIT_TRAINING_HELD_BACK, result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("datagen: run shell-env is complete and stored, but training was not restarted")
    assert "torch 2.11.0+cu128 -> 2.11.0+cu130" in last
    assert box.started() == [trainer_pid] and not trainers(box.checkpoints)
    assert not alive(launcher_pid)
