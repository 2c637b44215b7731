"""The GPUs go back to training once per halt, crashes included, and only when training was halted."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

import datagen.host.handback
from datagen.config import TrainingJobConfig
from datagen.host.handback import HaltedTraining, adopt_halt, hand_back_gpus, read_halt, record_halt


def _wait_for(path: Path, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not path.exists():
        time.sleep(0.1)
    return path.read_text() if path.exists() else ""


def _training(marker: Path) -> TrainingJobConfig:
    return TrainingJobConfig(
        kind="none", restart_after_run=True, restart_command=["sh", "-c", f"echo up >> {marker}"]
    )


def test_training_restarts_once_after_a_halt_and_never_without_one(tmp_path: Path) -> None:
    marker = tmp_path / "restarted.txt"
    record = tmp_path / "locks" / "gpus.training-halted.json"
    assert hand_back_gpus(record) is None  # nothing halted (e.g. preflight refused): nothing restarted

    record_halt(record, HaltedTraining(training=_training(marker), run_id="r1", done=True))
    first = hand_back_gpus(record)
    second = hand_back_gpus(record)  # the flow's finally and the cancellation hook both try

    assert first is not None and second is None
    assert _wait_for(marker).split() == ["up"]
    assert Path(first.log_path).name == "gpus.training-restart.log"


def test_restart_off_hands_back_nothing(tmp_path: Path) -> None:
    record = tmp_path / "gpus.training-halted.json"
    record_halt(record, HaltedTraining(training=TrainingJobConfig(kind="none"), done=True))
    assert hand_back_gpus(record) is None


def test_a_run_interrupted_before_its_stop_signal_restarts_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "restarted.txt"
    record = tmp_path / "gpus.training-halted.json"
    record_halt(record, HaltedTraining(training=_training(marker), run_id="r1"))
    assert hand_back_gpus(record) is None
    assert not record.exists() and not marker.exists()
    # The next holder likewise finds nothing to adopt.
    record_halt(record, HaltedTraining(training=_training(marker), run_id="r1"))
    assert adopt_halt(record, "r2") is None and not record.exists()


def test_a_halt_left_by_a_killed_run_is_adopted_and_handed_back_once(tmp_path: Path) -> None:
    marker = tmp_path / "restarted.txt"
    record = tmp_path / "gpus.training-halted.json"
    gone = subprocess.Popen(["true"])
    gone.wait()
    record_halt(
        record,
        HaltedTraining(
            training=_training(marker), run_id="killed", signalled=True, pids=[gone.pid], signalled_at_s=1.0
        ),
    )
    adopted = adopt_halt(record, "resume")
    assert adopted is not None and adopted.signalled and adopted.run_id == "resume"
    assert read_halt(record) == adopted
    assert hand_back_gpus(record) is not None
    assert hand_back_gpus(record) is None
    assert _wait_for(marker).split() == ["up"]


# "signalling": the record a run leaves when it dies between the stop signal and the record of it.
@pytest.mark.parametrize("recorded", ["signalled", "signalling"])
def test_a_job_still_stopping_is_neither_started_beside_itself_nor_signalled_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recorded: str
) -> None:
    monkeypatch.setattr(datagen.host.handback, "STOPPING_JOB_WAIT_S", 0.3)
    marker = tmp_path / "restarted.txt"
    record = tmp_path / "gpus.training-halted.json"
    sent: dict[str, Any] = (
        {"signalled": True, "signalled_at_s": 5.0} if recorded == "signalled" else {"signalling_at_s": 5.0}
    )
    stopping = subprocess.Popen(["sleep", "30"])  # the job, still writing its checkpoint
    try:
        halt = HaltedTraining(training=_training(marker), run_id="r1", pids=[stopping.pid], **sent)
        record_halt(record, halt)
        # The run's own hand-back (its `finally`, the crash hook) neither forgets the halt nor restarts the job.
        assert hand_back_gpus(record) is None
        assert read_halt(record) == halt, "the record stays for the next run to adopt"
        adopted = adopt_halt(record, "resume")
        assert adopted is not None and adopted.run_id == "resume" and adopted.may_have_signalled
        assert adopted.signal_time_s == 5.0, "the resume waits from the earlier signal, never sends its own"
    finally:
        stopping.kill()
        stopping.wait()
    assert hand_back_gpus(record) is not None
    assert _wait_for(marker).split() == ["up"]


def test_a_done_halt_whose_job_still_runs_restarts_nothing_and_keeps_its_record(tmp_path: Path) -> None:
    from datagen.errors import TrainingStillRunningError
    from datagen.processes import start_ticks

    marker = tmp_path / "restarted.txt"
    record = tmp_path / "gpus.training-halted.json"
    orphan = subprocess.Popen(["sleep", "30"])  # a worker of the halted job that outlived its launcher
    try:
        ticks = start_ticks(orphan.pid)
        assert ticks is not None
        halt = HaltedTraining(
            training=_training(marker),
            run_id="r1",
            signalled=True,
            done=True,
            pids=[orphan.pid],
            start_ticks={orphan.pid: ticks},
        )
        record_halt(record, halt)
        # The pid is named; its command line too where /proc had it yet (a process just started may show "?").
        with pytest.raises(
            TrainingStillRunningError, match=f"its job still runs \\(pid {orphan.pid} \\("
        ) as raised:
            hand_back_gpus(record)
        assert raised.value.pids == [orphan.pid]
        assert read_halt(record) == halt and not marker.exists()
    finally:
        orphan.kill()
        orphan.wait()
    restarted = hand_back_gpus(record)  # gone now: restarted once, unchecked (no environment was recorded)
    assert restarted is not None and not restarted.environment_checked
    assert "was not checked" in restarted.notes[0]
    assert _wait_for(marker).split() == ["up"]


def test_a_reused_pid_is_not_the_halted_job(tmp_path: Path) -> None:
    marker = tmp_path / "restarted.txt"
    record = tmp_path / "gpus.training-halted.json"
    stranger = subprocess.Popen(["sleep", "30"])  # took the number of a job process that exited
    try:
        halt = HaltedTraining(
            training=_training(marker),
            run_id="r1",
            signalled=True,
            done=True,
            pids=[stranger.pid],
            start_ticks={stranger.pid: 1},
        )
        record_halt(record, halt)
        assert hand_back_gpus(record) is not None
        assert _wait_for(marker).split() == ["up"]
    finally:
        stranger.kill()
        stranger.wait()


def test_a_halt_record_of_one_environment_still_reads(tmp_path: Path) -> None:
    record = tmp_path / "gpus.training-halted.json"
    environment = {"interpreter": "/venv/bin/python", "prefix": "/venv"}
    legacy = {"training": {"kind": "none"}, "done": True, "environment": environment}
    record.write_text(json.dumps(legacy))
    halt = read_halt(record)
    assert halt is not None and [item.interpreter for item in halt.environments] == ["/venv/bin/python"]
