"""Halting a real (stand-in) training process: graceful, stubborn, escalated, already gone, idempotent."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from datagen.config import TrainingJobConfig
from datagen.errors import TrainingHaltError
from datagen.training import halt_training, validate_training_job

STARTUP_TIMEOUT_S = 30.0
STEP_INTERVAL_S = "0.05"


@dataclass
class Trainer:
    process: subprocess.Popen[bytes]
    pidfile: Path
    checkpoint_dir: Path

    def config(self, **changes: object) -> TrainingJobConfig:
        return TrainingJobConfig.model_validate(
            {
                "kind": "pidfile",
                "pidfile": str(self.pidfile),
                "checkpoint_glob": str(self.checkpoint_dir / "checkpoint-*.pt"),
                "stop_timeout_s": 20,
                **changes,
            }
        )


def _start_trainer(tmp_path: Path, *extra: str) -> Trainer:
    pidfile = tmp_path / "trainer.pid"
    checkpoint_dir = tmp_path / "ckpt"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "datagen.standin_trainer",
            "--pidfile",
            str(pidfile),
            "--checkpoint-dir",
            str(checkpoint_dir),
            "--step-interval-s",
            STEP_INTERVAL_S,
            *extra,
        ],
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not (checkpoint_dir / "step.txt").exists():
        assert process.poll() is None, process.stderr.read() if process.stderr else b""
        assert time.monotonic() < deadline, "stand-in trainer did not start"
        time.sleep(0.05)
    return Trainer(process=process, pidfile=pidfile, checkpoint_dir=checkpoint_dir)


@pytest.fixture()
def trainer(tmp_path: Path) -> Iterator[Trainer]:
    started = _start_trainer(tmp_path)
    yield started
    started.process.kill()
    started.process.wait()


@pytest.fixture()
def stubborn_trainer(tmp_path: Path) -> Iterator[Trainer]:
    started = _start_trainer(tmp_path, "--ignore-first-signal")
    yield started
    started.process.kill()
    started.process.wait()


def test_graceful_halt_waits_for_the_checkpoint_and_the_exit(trainer: Trainer) -> None:
    record = halt_training(trainer.config())

    assert trainer.process.wait(timeout=5) == 0
    assert record.stopped
    assert not record.already_gone
    assert not record.escalated
    assert record.pid == trainer.process.pid
    assert record.signal == "SIGTERM"
    assert record.last_checkpoint is not None
    checkpoint = Path(record.last_checkpoint)
    assert checkpoint.parent == trainer.checkpoint_dir
    assert checkpoint.name.startswith("checkpoint-")
    assert checkpoint.read_bytes()
    assert 0 < record.waited_s < 20


def test_second_halt_finds_the_job_already_gone_and_keeps_the_checkpoint(trainer: Trainer) -> None:
    first = halt_training(trainer.config())
    trainer.process.wait(timeout=5)

    second = halt_training(trainer.config())

    assert second.already_gone
    assert not second.stopped
    assert second.pid == first.pid
    assert second.last_checkpoint == first.last_checkpoint


def test_configured_signal_is_the_one_sent(tmp_path: Path) -> None:
    started = _start_trainer(tmp_path, "--signal", "SIGUSR1")
    try:
        record = halt_training(started.config(signal="USR1"))

        assert record.signal == "SIGUSR1"
        assert started.process.wait(timeout=5) == 0
        assert record.last_checkpoint is not None
    finally:
        started.process.kill()
        started.process.wait()


def test_stubborn_job_without_escalation_raises_and_is_left_running(stubborn_trainer: Trainer) -> None:
    with pytest.raises(TrainingHaltError, match="escalate") as raised:
        halt_training(stubborn_trainer.config(stop_timeout_s=1))

    assert str(stubborn_trainer.process.pid) in str(raised.value)
    assert stubborn_trainer.process.poll() is None


def test_stubborn_job_with_escalation_is_killed(stubborn_trainer: Trainer) -> None:
    record = halt_training(stubborn_trainer.config(stop_timeout_s=1, escalate=True))

    assert stubborn_trainer.process.wait(timeout=5) == -signal.SIGKILL
    assert record.stopped
    assert record.escalated
    assert record.last_checkpoint is None
    assert record.waited_s >= 1


def test_missing_pidfile_means_already_gone(tmp_path: Path) -> None:
    config = TrainingJobConfig(kind="pidfile", pidfile=str(tmp_path / "absent.pid"))

    record = halt_training(config)

    assert record.already_gone
    assert record.pid is None
    assert not record.stopped


def test_kind_none_halts_nothing() -> None:
    record = halt_training(TrainingJobConfig())

    assert record.kind == "none"
    assert not record.stopped and not record.already_gone


def test_pidfile_without_a_pid_is_an_error_naming_the_file(tmp_path: Path) -> None:
    pidfile = tmp_path / "bad.pid"
    pidfile.write_text("not-a-pid\n")

    with pytest.raises(TrainingHaltError, match=r"bad\.pid"):
        halt_training(TrainingJobConfig(kind="pidfile", pidfile=str(pidfile)))
    assert validate_training_job(TrainingJobConfig(kind="pidfile", pidfile=str(pidfile)))


def test_validation_accepts_a_running_job_and_reports_a_missing_pidfile(
    trainer: Trainer, tmp_path: Path
) -> None:
    assert validate_training_job(trainer.config()) == []
    assert validate_training_job(TrainingJobConfig()) == []

    problems = validate_training_job(TrainingJobConfig(kind="pidfile", pidfile=str(tmp_path / "absent.pid")))

    assert len(problems) == 1
    assert "training.pidfile" in problems[0]
    assert trainer.process.poll() is None
