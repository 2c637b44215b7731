"""Handing the GPUs back to training as soon as the fleet is down, exactly once per halt, crashes included.

The halt is recorded next to the GPU lock (``<lock_dir>/<lock>.training-halted.json``), so it belongs to the
box, not to one flow run or one user (the next holder, whoever runs it, adopts it), and only the lock's
holder writes it:

1. before the stop signal goes out the holder records that it is *halting* (``signalled: false``);
2. right before the signal (or the flow-run cancel) goes out it records the job's pids and when it is
   *signalling*; a run killed from here on may have signalled, so no later run signals again;
3. the moment the signal went out, it records ``signalled: true``;
4. once the job is gone it records the halt as *done*.

Whoever stops the fleet first (the flow's ``finally`` after success, failure or a signal, or the
cancellation/crash hook from the worker process) calls :func:`hand_back_gpus`: it claims the record by
renaming it (atomic, so a restart happens once) and restarts training when ``training.restart_after_run``
is on. A run killed outright (SIGKILL, OOM killer) claims nothing: the next holder of the lock finds the
record and *adopts* the halt (:func:`adopt_halt`): it never signals training a second time, waits for the
job to be gone if it was still stopping, and hands it back at its own end, once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from datagen.config import TrainingJobConfig
from datagen.errors import TrainingEnvironmentChangedError, TrainingHaltError, TrainingStillRunningError
from datagen.host.gpu_lock import SHARED_FILE_MODE
from datagen.host.trainer_env import TrainerEnvironment, environment_changes, read_environment
from datagen.host.training import RestartRecord, restart_training
from datagen.host.training_jobs import JobTarget, job_for, live_pids
from datagen.processes import read_command_line
from datagen.records import Record

logger = logging.getLogger(__name__)

HALT_RECORD_SUFFIX = ".training-halted.json"
CLAIMED_SUFFIX = ".handed-back"
RESTART_LOG_SUFFIX = ".training-restart.log"
# A job signalled by an interrupted run may still be writing its checkpoint when the run hands back: wait
# this long for it to exit before starting it again (a second trainer beside the first is never right).
# Short, so a signalled run still exits within its 30 s budget; a job slower than this is left for the
# next run on the host to adopt.
STOPPING_JOB_WAIT_S = 15.0
POLL_S = 0.2


class HaltedTraining(Record):
    """The host's record of a training halt in progress or done (see the module docstring)."""

    training: TrainingJobConfig
    run_id: str | None = Field(default=None, description="The run that halted (or adopted) training.")
    signalled: bool = Field(default=False, description="The stop signal or cancel went out.")
    done: bool = Field(default=False, description="The halt finished: the job is gone (or was never there).")
    pids: list[int] = Field(
        default_factory=list, description="Every process of the job when it was signalled (main pid first)."
    )
    start_ticks: dict[int, int] = Field(
        default_factory=dict, description="Each of those processes' start time: a reused pid is not the job."
    )
    signalled_at_s: float | None = Field(default=None, description="Epoch time the stop signal went out.")
    signalling_at_s: float | None = Field(
        default=None, description="Epoch time the stop signal was about to go out (it may have, unrecorded)."
    )
    environments: list[TrainerEnvironment] = Field(
        default_factory=list,
        description="Each environment the job's Python processes ran in when it was halted (compared before a "
        "restart); empty when none could be read.",
    )
    recorded_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    @model_validator(mode="before")
    @classmethod
    def _one_environment_of_older_records(cls, data: Any) -> Any:
        """Records written before a job's several environments were kept hold one, as ``environment``."""
        if isinstance(data, dict) and "environment" in data:
            data = dict(data)
            single = data.pop("environment")
            data.setdefault("environments", [single] if single is not None else [])
        return data

    def target(self) -> JobTarget:
        """The job's processes as they were when it was signalled (what must be gone before a restart)."""
        return JobTarget(
            description=f"training halted by run {self.run_id}",
            running=True,
            pids=self.pids,
            stop_pids=self.pids[:1],
            start_ticks=self.start_ticks,
        )

    @property
    def may_have_signalled(self) -> bool:
        """Whether the stop signal may have gone out: recorded as sent, or its sending had begun."""
        return self.signalled or self.signalling_at_s is not None

    @property
    def signal_time_s(self) -> float | None:
        """When the stop signal went out (or was about to): the epoch time the halt waits from."""
        return self.signalled_at_s if self.signalled_at_s is not None else self.signalling_at_s


def halt_record_path(lock_file: Path) -> Path:
    """Where the halt is recorded for the GPU lock at ``lock_file``."""
    return lock_file.with_name(lock_file.stem + HALT_RECORD_SUFFIX)


def read_halt(path: Path) -> HaltedTraining | None:
    """The recorded halt, if any (a record that cannot be read is logged and treated as none)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        return HaltedTraining.model_validate_json(text)
    except ValidationError as error:
        logger.warning("unreadable training halt record ignored path=%s error=%s", path, error)
        return None


def record_halt(path: Path, halt: HaltedTraining) -> Path:
    """Write the halt record atomically (a crash mid-write leaves the previous one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(halt.model_dump_json(), encoding="utf-8")
    os.chmod(partial, SHARED_FILE_MODE)  # the next holder may be another user of the box
    os.replace(partial, path)
    return path


def adopt_halt(path: Path, run_id: str | None) -> HaltedTraining | None:
    """A halt left by a run that died holding the GPUs, taken over by ``run_id`` (call with the lock held).

    Returns:
        The adopted record (now naming ``run_id``) when the earlier run may have signalled training (it had
        begun sending the signal: killed between the signal and its record, it still never gets a second
        one); None when there is nothing to adopt (no record, or the earlier run died before it began to
        signal, in which case training was never touched and the record is dropped).
    """
    halt = read_halt(path)
    if halt is None:
        return None
    if not halt.may_have_signalled and not halt.done:
        path.unlink(missing_ok=True)
        logger.info("earlier run %s died before it signalled training: nothing to adopt", halt.run_id)
        return None
    logger.warning(
        "training was halted by run %s, which ended without handing it back: run %s adopts that halt "
        "(training is not signalled again and is restarted once, when this run hands the GPUs back)",
        halt.run_id,
        run_id,
    )
    if not halt.signalled and not halt.done:
        logger.warning(
            "run %s died while it sent the stop signal: training is not signalled again; if the signal never "
            "reached it, it does not stop, and this run waits training.stop_timeout_s before it fails (or "
            "kills it, with training.escalate)",
            halt.run_id,
        )
    adopted = halt.model_copy(update={"run_id": run_id})
    record_halt(path, adopted)
    return adopted


def _wait_gone(target: JobTarget, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while live_pids(target):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def hand_back_gpus(path: Path) -> RestartRecord | None:
    """Restart training if it was halted and ``restart_after_run`` is on; at most once per halt.

    Args:
        path: The halt record (:func:`halt_record_path` of the host's GPU lock).

    Returns:
        The restart record; None when nothing was halted, someone else handed back first, restarting is
        off, or the job is still stopping (then the record stays for the next run to adopt).

    Raises:
        TrainingHaltError: The restart command could not be started.
        TrainingEnvironmentChangedError: The trainer's environment changed since the halt (and
            ``training.allow_env_change`` is off): nothing is restarted and the record is kept, so a later run
            hands the GPUs back once the environment is rolled back.
        TrainingStillRunningError: A process of the halted job, or the job found again, still runs: a
            second trainer never starts beside it; the record is kept for a later run.
    """
    halt = read_halt(path)
    if halt is None:
        return None
    if not halt.may_have_signalled and not halt.done:
        # Interrupted before the stop signal: training was never touched.
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return None
    if not halt.done and not _wait_gone(halt.target(), STOPPING_JOB_WAIT_S):
        logger.warning(
            "training is still stopping pids=%s: not restarted now; the next run on this host adopts the "
            "halt and restarts it at its end (or restart it by hand once it has exited)",
            halt.pids,
        )
        return None
    unchecked: str | None = None
    if halt.training.restart_after_run:
        _refuse_a_live_job(halt)
        unchecked = _refuse_a_changed_environment(halt)
    claimed = path.with_name(path.name + CLAIMED_SUFFIX)
    try:
        path.rename(claimed)
    except FileNotFoundError:
        return None
    restarted = restart_training(
        halt.training, path.with_name(path.name.removesuffix(HALT_RECORD_SUFFIX) + RESTART_LOG_SUFFIX)
    )
    if restarted is None:
        logger.info("training restart is off (training.restart_after_run): the GPUs stay idle")
        return None
    if unchecked is not None:
        restarted = restarted.model_copy(update={"environment_checked": False, "notes": [unchecked]})
        logger.warning("%s", unchecked)
    logger.info("training restarted pid=%d argv=%s", restarted.pid, restarted.argv)
    return restarted


# Job kinds whose processes the hand-back can look for again on this box.
_FINDABLE_KINDS = frozenset({"pidfile", "cmdline", "systemd"})


def _refuse_a_live_job(halt: HaltedTraining) -> None:
    """Raise while any process of the halted job, or the job found again, still runs."""
    live = live_pids(halt.target())
    found = ""
    if halt.training.kind in _FINDABLE_KINDS:
        handle = job_for(halt.training)
        assert handle is not None
        try:
            again = handle.find()
        except TrainingHaltError as error:
            raise TrainingStillRunningError(
                f"training was not restarted: could not check that its job is gone ({error})", pids=live
            ) from error
        if again.running:
            found = again.description
            live += [pid for pid in live_pids(again) if pid not in live]
    if not live and not found:
        return
    described = ", ".join(f"pid {pid} ({(read_command_line(pid) or '?')[:80]})" for pid in live)
    raise TrainingStillRunningError(
        f"training was not restarted: its job still runs ({described or found}), and a second trainer never "
        "starts beside it. Stop it (or let it finish); the next datagen run on this box then restarts "
        "training once",
        pids=live,
    )


def _refuse_a_changed_environment(halt: HaltedTraining) -> str | None:
    """Raise when an environment of the job differs from the one recorded at the halt (unless allowed).

    Returns:
        Why the restart could not be checked (no environment was recorded at the halt); None when it was.
    """
    if not halt.environments:
        return (
            "training's environment was not checked before its restart: no Python process of the job could be "
            f"read at the halt (pids {halt.pids})"
        )
    changes = [
        change
        for before in halt.environments
        for change in environment_changes(before, read_environment(before.interpreter))
    ]
    if not changes:
        logger.info(
            "training's environment is unchanged since the halt interpreters=%s",
            [before.interpreter for before in halt.environments],
        )
        return None
    if halt.training.allow_env_change:
        logger.warning("training restarts in a changed environment (training.allow_env_change): %s", changes)
        return None
    raise TrainingEnvironmentChangedError(
        f"training was not restarted: its environment changed since the halt ({'; '.join(changes)}). Roll it "
        f"back (then the next datagen run on this box restarts training), or set training.allow_env_change: "
        "true to restart it anyway",
        changes=changes,
    )
