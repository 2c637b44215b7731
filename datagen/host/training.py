"""Halt the training job that holds the GPUs, and optionally start it again after the run.

:func:`halt_training` drives any :class:`datagen.host.training_jobs.TrainingJob` (pidfile, GPU processes
matched by command line, systemd unit, Prefect flow run): graceful signal, wait for the exit and for an
optional checkpoint marker, escalate only if configured, verify the GPU memory was released, and return a
:class:`HaltRecord` of what was stopped and the last checkpoint. Halting is idempotent: a job that is
no longer running is recorded as *already gone*, so a retried flow never fails here.
:func:`restart_training` starts the configured command detached (off by default).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from datagen.config import TrainingJobConfig
from datagen.errors import TrainingHaltError
from datagen.host.env_report import IDLE_GPU_MEMORY_MIB
from datagen.host.nvidia_smi import (
    parse_compute_apps_csv,
    parse_gpu_query_csv,
    query_compute_apps,
    query_gpu_memory,
)
from datagen.host.training_jobs import (
    FlowRunControl,
    JobTarget,
    TrainingJob,
    job_for,
    joined_target,
    live_pids,
    read_pidfile,
    signal_processes,
    with_new_descendants,
)
from datagen.processes import read_command_line

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
# How long a launcher that is still running gets to pass the stop on to its workers (torchrun, accelerate)
# before the halt signals them itself; a launcher that exited (a shell) left them with nobody to forward it.
LAUNCHER_FORWARD_GRACE_S = 10.0
# How much of a process's command line a message quotes.
COMMAND_QUOTE_CHARS = 120
# A SIGKILLed process is gone within moments; this only bounds the wait.
KILL_WAIT_S = 10.0
# The driver frees a dead process's GPU memory shortly after exit; wait this long before reporting it held.
GPU_RELEASE_WAIT_S = 30.0
GPU_RELEASE_POLL_S = 1.0
# After the job exited, how long a checkpoint marker still written by a helper process may take to appear.
MARKER_AFTER_EXIT_WAIT_S = 5.0
# File system timestamps may trail the wall clock a little: a marker this much older than the signal counts.
MARKER_CLOCK_SLACK_S = 1.0
RESTART_LAUNCH_TIMEOUT_S = 60.0
# Starts the command in a new session and exits at once, so the trainer is re-parented to init: it is not
# a child of the flow process (no zombie, not killed with the flow's process group).
_DETACHED_LAUNCHER = (
    "import subprocess, sys\n"
    "log = open(sys.argv[1], 'ab')\n"
    "p = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,"
    " start_new_session=True, close_fds=True)\n"
    "print(p.pid)\n"
)

JobKind = Literal["none", "pidfile", "cmdline", "systemd", "prefect"]


class HaltRecord(BaseModel):
    """What :func:`halt_training` did (stored as ``training.json`` of the attempt)."""

    model_config = ConfigDict(extra="forbid")

    kind: JobKind
    target: str | None = Field(default=None, description="What was found, e.g. 'pid 42 from /run/t.pid'.")
    pid: int | None = Field(default=None, description="The job's main process, when it has one.")
    pids: list[int] = Field(default_factory=list, description="Every process of the job that was stopped.")
    flow_run_ids: list[str] = Field(default_factory=list, description="Prefect flow runs cancelled.")
    signal: str | None = None
    stopped: bool = False
    already_gone: bool = False
    escalated: bool = False
    waited_s: float = 0.0
    stopped_at: str | None = Field(default=None, description="ISO 8601 UTC time the job was gone.")
    last_checkpoint: str | None = None
    checkpoint_marker: str | None = Field(default=None, description="The marker file found, if configured.")
    gpu_memory_released: bool | None = Field(
        default=None, description="None where nothing can be checked (no nvidia-smi)."
    )
    notes: list[str] = Field(default_factory=list, description="Anything odd, e.g. a missing marker.")
    paused_since_s: float | None = Field(
        default=None,
        description="Epoch time an earlier run (killed since) sent the stop signal this run adopted: training "
        "has been paused since then, so the pause and a window count from there.",
    )


class RestartRecord(BaseModel):
    """The training job started again by :func:`restart_training`."""

    model_config = ConfigDict(extra="forbid")

    argv: list[str]
    pid: int
    log_path: str
    started_at: str
    environment_checked: bool = Field(
        default=True, description="False when no environment of the job was recorded to compare with."
    )
    notes: list[str] = Field(default_factory=list, description="What the restart could not check.")


class GpuQueries:
    """The two nvidia-smi queries the halt uses (outputs as text; None without nvidia-smi).

    Args:
        compute_apps: ``--query-compute-apps`` CSV.
        gpu_memory: ``--query-gpu=index,memory.used`` CSV.

    """

    def __init__(
        self,
        compute_apps: Callable[[], str | None] = query_compute_apps,
        gpu_memory: Callable[[], str | None] = query_gpu_memory,
    ) -> None:
        self.compute_apps = compute_apps
        self.gpu_memory = gpu_memory


def _halt_record(cfg: TrainingJobConfig, target: JobTarget, **outcome: Any) -> HaltRecord:
    """What was found (and done) about the training job: its target, newest checkpoint, and ``outcome``.

    Built once every process of the job is gone, so the newest checkpoint is the one its last process wrote.
    """
    main = target.stop_pids or target.pids
    return HaltRecord(
        kind=cfg.kind,
        target=target.description,
        pid=main[0] if main else None,
        pids=target.pids,
        flow_run_ids=target.ids,
        last_checkpoint=newest_checkpoint(cfg.checkpoint_glob),
        **outcome,
    )


def halt_training(
    cfg: TrainingJobConfig,
    *,
    job: TrainingJob | None = None,
    flow_runs: FlowRunControl | None = None,
    gpu: GpuQueries | None = None,
    signalled_before_s: float | None = None,
    recording_signal: Callable[[JobTarget], AbstractContextManager[object]] | None = None,
    earlier_target: JobTarget | None = None,
) -> HaltRecord:
    """Stop the training job gracefully and report what happened.

    Args:
        cfg: How to find and stop the job.
        job: The handle; built from ``cfg`` (:func:`datagen.host.training_jobs.job_for`) when None.
        flow_runs: Prefect API calls for ``kind: prefect``.
        gpu: nvidia-smi queries for the release check; the real ones when None.
        signalled_before_s: When an earlier run (killed since) already asked the job to stop: the epoch
            time of that signal. The stop signal is never sent again; the halt only waits for the exit
            (and escalates after the timeout, if configured).
        recording_signal: Entered with the target right before the stop signal goes out and left right after
            (to record both: a crash between the two must never lead to a second signal).
        earlier_target: The job as the earlier run (``signalled_before_s``) found it: its processes that
            still run are waited for too (a shell launcher's workers outlive the pid in the pidfile).

    Returns:
        The record. ``already_gone`` when the job no longer runs (a second call after a successful halt
        lands here too).

    Raises:
        TrainingHaltError: The job may not be stopped, or did not exit within ``stop_timeout_s`` and
            ``escalate`` is off; the message says what to do.

    """
    handle = job or job_for(cfg, flow_runs=flow_runs)
    if cfg.kind == "none" or handle is None:
        return HaltRecord(kind="none")
    queries = gpu or GpuQueries()
    target = handle.find()
    if earlier_target is not None:
        target = joined_target(target, earlier_target)
    if not target.running:
        record = _halt_record(
            cfg,
            target,
            already_gone=True,
            checkpoint_marker=find_marker(cfg.checkpoint_marker, since_epoch_s=None),
            # No wait: nothing was stopped now, so there is no release in progress to wait for.
            gpu_memory_released=gpu_memory_released(target, queries),
        )
        logger.info("training already gone kind=%s target=%s", cfg.kind, target.description)
        return record
    signum = signal.Signals[cfg.signal]
    started = time.monotonic()
    signalled_at = time.time()
    if signalled_before_s is not None:
        # The checkpoint marker may have been written before this run started: since the earlier signal.
        signalled_at = signalled_before_s
        logger.info(
            "training was asked to stop by an earlier run; waiting for it to exit kind=%s target=%s "
            "timeout_s=%.0f",
            cfg.kind,
            target.description,
            cfg.stop_timeout_s,
        )
    else:
        with recording_signal(target) if recording_signal is not None else contextlib.nullcontext():
            handle.request_stop(target, signum)
        logger.info(
            "asked training to stop kind=%s target=%s signal=%s timeout_s=%.0f",
            cfg.kind,
            target.description,
            signum.name,
            cfg.stop_timeout_s,
        )
    # An adopted halt never signals again: the earlier run may have reached the workers already.
    exited, marker, target = _wait_stopped(
        handle, target, cfg, signalled_at, signum, signal_descendants=signalled_before_s is None
    )
    escalated = False
    if not exited:
        if not cfg.escalate:
            raise TrainingHaltError(
                f"training ({target.description}) did not exit within {cfg.stop_timeout_s:.0f}s after "
                f"{signum.name}: {_still_running(target)} and holds what it held. Check the trainer's log; stop "
                "it by hand, raise training.stop_timeout_s, or set training.escalate: true to SIGKILL it after "
                "the timeout (its last checkpoint is kept).",
                target=target.description,
                pids=live_pids(target),
            )
        logger.warning(
            "training ignored %s for %.0fs, killing it target=%s still_running=%s",
            signum.name,
            cfg.stop_timeout_s,
            target.description,
            live_pids(target),
        )
        escalated = True
        handle.force_stop(target)
        if not _wait(lambda: not handle.is_running(target), KILL_WAIT_S):
            raise TrainingHaltError(
                f"training ({target.description}) survived SIGKILL for {KILL_WAIT_S:.0f}s (uninterruptible "
                f"I/O?): {_still_running(target)}; check the host before taking its GPUs",
                target=target.description,
                pids=live_pids(target),
            )
    notes: list[str] = []
    if cfg.checkpoint_marker and marker is None:
        notes.append(
            f"no checkpoint marker matching {cfg.checkpoint_marker} was written after the stop signal: "
            "the last checkpoint may be incomplete"
        )
        logger.warning("training exited without its checkpoint marker pattern=%s", cfg.checkpoint_marker)
    record = _halt_record(
        cfg,
        target,
        signal=signum.name,
        stopped=True,
        escalated=escalated,
        waited_s=round(time.monotonic() - started, 3),
        stopped_at=_now(),
        checkpoint_marker=marker,
        gpu_memory_released=wait_gpu_released(target, queries),
        notes=notes,
    )
    if record.gpu_memory_released is False:
        record.notes.append("nvidia-smi still shows the job's GPU memory in use after it stopped")
    logger.info(
        "training stopped kind=%s target=%s waited_s=%.1f escalated=%s last_checkpoint=%s gpu_released=%s",
        cfg.kind,
        target.description,
        record.waited_s,
        escalated,
        record.last_checkpoint,
        record.gpu_memory_released,
    )
    return record


def _wait_stopped(
    handle: TrainingJob,
    target: JobTarget,
    cfg: TrainingJobConfig,
    signalled_at: float,
    signum: signal.Signals,
    *,
    signal_descendants: bool,
) -> tuple[bool, str | None, JobTarget]:
    """Wait until every process of the job is gone (and the marker, when configured), under ``stop_timeout_s``.

    The stop went to the job's main process(es) first. Once they are gone, or after
    :data:`LAUNCHER_FORWARD_GRACE_S`, the descendants still running get the same signal (when
    ``signal_descendants``): a launcher that does not forward it, or is gone, leaves them nobody else.
    Descendants started meanwhile count as part of the job.

    Returns:
        (exited, marker, the job with every process seen).
    """
    started = time.monotonic()
    deadline = started + cfg.stop_timeout_s
    exited_at: float | None = None
    marker: str | None = None
    descendants_signalled = not signal_descendants
    while True:
        target = with_new_descendants(target)
        if not descendants_signalled:
            live = live_pids(target)
            if time.monotonic() - started >= LAUNCHER_FORWARD_GRACE_S or not set(live) & set(
                target.stop_pids
            ):
                descendants_signalled = True
                left = [pid for pid in live if pid not in target.stop_pids]
                if left:
                    logger.info(
                        "signalling the job's processes its launcher left running pids=%s signal=%s",
                        left,
                        signum.name,
                    )
                    signal_processes(left, signum, target.description)
        running = handle.is_running(target)
        if cfg.checkpoint_marker and marker is None:
            marker = find_marker(cfg.checkpoint_marker, since_epoch_s=signalled_at)
        now = time.monotonic()
        if not running:
            exited_at = exited_at if exited_at is not None else now
            if not cfg.checkpoint_marker or marker is not None or now - exited_at >= MARKER_AFTER_EXIT_WAIT_S:
                return True, marker, target
        elif now >= deadline:
            return False, marker, target
        time.sleep(POLL_INTERVAL_S)


def _still_running(target: JobTarget) -> str:
    """The job's processes still running, each with its command line, for a message."""
    live = live_pids(target)
    if not live:
        return "it still runs"
    described = []
    for pid in live:
        command = (read_command_line(pid) or "?")[:COMMAND_QUOTE_CHARS]
        described.append(f"pid {pid} ({command})")
    return f"{', '.join(described)} would not stop"


def _wait(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_INTERVAL_S)
    return True


def gpu_memory_released(target: JobTarget, gpu: GpuQueries) -> bool | None:
    """Whether the job's GPU memory is free now.

    With pids: none of them is listed by ``--query-compute-apps``. Without (a flow run): every GPU shows
    at most :data:`datagen.host.env_report.IDLE_GPU_MEMORY_MIB` in use.

    Returns:
        None without nvidia-smi (nothing to check on a CPU host).

    """
    if target.pids:
        text = gpu.compute_apps()
        if text is None:
            return None
        holding = {process.pid for process in parse_compute_apps_csv(text)}
        return not holding.intersection(target.pids)
    text = gpu.gpu_memory()
    if text is None:
        return None
    gpus, _ = parse_gpu_query_csv(text)
    return all((card.memory_used_mib or 0) <= IDLE_GPU_MEMORY_MIB for card in gpus)


def wait_gpu_released(
    target: JobTarget, gpu: GpuQueries, timeout_s: float = GPU_RELEASE_WAIT_S
) -> bool | None:
    """:func:`gpu_memory_released`, polled until True or ``timeout_s`` (the driver frees memory late)."""
    deadline = time.monotonic() + timeout_s
    while True:
        released = gpu_memory_released(target, gpu)
        if released is None or released or time.monotonic() >= deadline:
            return released
        time.sleep(GPU_RELEASE_POLL_S)


def find_marker(pattern: str | None, *, since_epoch_s: float | None) -> str | None:
    """The newest file matching ``pattern`` (path or glob), written after ``since_epoch_s`` when given."""
    if not pattern:
        return None
    newest: tuple[float, str] | None = None
    for path in glob.glob(os.path.expanduser(pattern), recursive=True):
        try:
            mtime = Path(path).stat().st_mtime
        except OSError:
            continue
        if since_epoch_s is not None and mtime < since_epoch_s - MARKER_CLOCK_SLACK_S:
            continue
        if newest is None or mtime > newest[0]:
            newest = (mtime, path)
    return newest[1] if newest else None


def checkpoint_step(path: str | Path) -> int:
    """The step number of a checkpoint file: the last number in its name (-1 without one).

    ``checkpoint-10.pt`` comes after ``checkpoint-9.pt``, which a text sort of the names gets wrong.
    """
    numbers = re.findall(r"\d+", Path(path).name)
    return int(numbers[-1]) if numbers else -1


def newest_checkpoint(pattern: str | None) -> str | None:
    """The newest file matching ``pattern`` (``**`` allowed): last modified, then highest step; None if none."""
    if not pattern:
        return None
    files = [Path(path) for path in glob.glob(os.path.expanduser(pattern), recursive=True)]
    files = [path for path in files if path.is_file()]
    if not files:
        return None
    return str(max(files, key=lambda path: (path.stat().st_mtime_ns, checkpoint_step(path))))


def restart_argv(cfg: TrainingJobConfig) -> list[str] | None:
    """The command :func:`restart_training` runs: ``restart_command``, else the job kind's default."""
    if cfg.restart_command:
        return list(cfg.restart_command)
    handle = job_for(cfg) if cfg.kind in {"pidfile", "cmdline", "systemd"} else None
    return handle.default_restart_argv() if handle is not None else None


def restart_training(cfg: TrainingJobConfig, log_path: str | Path) -> RestartRecord | None:
    """Start training again, detached from this process (its own session, re-parented to init).

    Call it after the run's data is merged. Nothing happens unless ``training.restart_after_run``.

    Args:
        cfg: The training job config.
        log_path: File receiving the command's output (appended).

    Returns:
        The record of the started process; None when restarting is off.

    Raises:
        TrainingHaltError: No command is configured, or it could not be started.

    """
    if not cfg.restart_after_run:
        return None
    argv = restart_argv(cfg)
    if not argv:
        raise TrainingHaltError(
            "training.restart_after_run is on but there is no command to run: set training.restart_command"
        )
    log = Path(log_path)
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        result = subprocess.run(
            [sys.executable, "-c", _DETACHED_LAUNCHER, str(log), *argv],
            capture_output=True,
            text=True,
            timeout=RESTART_LAUNCH_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise TrainingHaltError(f"could not restart training with {argv}: {error}") from error
    pid_text = result.stdout.strip()
    if result.returncode != 0 or not pid_text.isdigit():
        detail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise TrainingHaltError(
            f"could not restart training with {argv}: {detail}; fix training.restart_command",
        )
    record = RestartRecord(argv=argv, pid=int(pid_text), log_path=str(log), started_at=_now())
    logger.info("training restarted pid=%d argv=%s log=%s", record.pid, argv, log)
    return record


def validate_training_job(cfg: TrainingJobConfig) -> list[str]:
    """Check, without signalling anything, that :func:`halt_training` can do its job.

    Args:
        cfg: The training job config.

    Returns:
        One line per problem with its fix; empty when halting can proceed.

    """
    if cfg.kind == "pidfile":
        return _validate_pidfile(cfg)
    if cfg.kind == "cmdline" and query_compute_apps() is None:
        return [
            "training.kind cmdline needs nvidia-smi to find the processes that hold GPUs, and it is not "
            "available here: use training.kind pidfile or systemd"
        ]
    if cfg.kind == "systemd":
        handle = job_for(cfg)
        assert handle is not None
        try:
            handle.find()
        except TrainingHaltError as error:
            return [str(error)]
    return []


def _validate_pidfile(cfg: TrainingJobConfig) -> list[str]:
    assert cfg.pidfile is not None
    pidfile = Path(cfg.pidfile)
    if not pidfile.exists():
        return [
            f"training pidfile {pidfile} does not exist: fix training.pidfile, or set training.kind: none "
            "when no training job runs on this host"
        ]
    try:
        pid = read_pidfile(pidfile)
    except TrainingHaltError as error:
        return [str(error)]
    if pid is None:
        return [f"training pidfile {pidfile} is not readable: fix its permissions"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return []
    except PermissionError:
        return [
            f"training pid {pid} (from {pidfile}) belongs to another user: run datagen as that user or root"
        ]
    return []


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
