"""The GPUs go back to training once per halt, and only when this run halted it."""

from __future__ import annotations

import time
from pathlib import Path

from datagen.config import TrainingJobConfig
from datagen.host.handback import hand_back_gpus, record_halt


def _wait_for(path: Path, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not path.exists():
        time.sleep(0.1)
    return path.read_text() if path.exists() else ""


def test_training_restarts_once_after_a_halt_and_never_without_one(tmp_path: Path) -> None:
    marker = tmp_path / "restarted.txt"
    training = TrainingJobConfig(
        kind="none", restart_after_run=True, restart_command=["sh", "-c", f"echo up >> {marker}"]
    )
    state = tmp_path / "state"
    assert hand_back_gpus(state) is None  # nothing halted (e.g. preflight refused): nothing restarted

    record_halt(state, training)
    first = hand_back_gpus(state)
    second = hand_back_gpus(state)  # the flow's finally and the cancellation hook both try

    assert first is not None and second is None
    assert _wait_for(marker).split() == ["up"]


def test_restart_off_hands_back_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    record_halt(state, TrainingJobConfig(kind="none"))
    assert hand_back_gpus(state) is None
