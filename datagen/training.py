"""Halt the training job that holds the GPUs: signal, wait for its checkpoint and exit, escalate if allowed.

The job is reached through a pidfile (``training.kind: pidfile``). Halting is idempotent: a missing
pidfile or a pid that no longer runs is recorded as *already gone*, so a retried flow never fails here.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import signal
import subprocess
import time
from contextlib import suppress
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from datagen.config import TrainingJobConfig
from datagen.errors import TrainingHaltError
from datagen.probe import parse_compute_apps_csv

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
# A SIGKILLed process is gone within moments; this only bounds the wait.
KILL_WAIT_S = 10.0
# The driver frees a dead process's GPU memory shortly after exit; wait this long before reporting it held.
GPU_RELEASE_WAIT_S = 30.0
NVIDIA_SMI_TIMEOUT_S = 30.0
# A process that started this long after the pidfile was written cannot be the one that wrote it.
PID_REUSE_SLACK_S = 5.0


class HaltRecord(BaseModel):
    """What :func:`halt_training` did (stored as ``training.json`` of the attempt)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["none", "pidfile"]
    pid: int | None = None
    signal: str | None = None
    stopped: bool = False
    already_gone: bool = False
    escalated: bool = False
    waited_s: float = 0.0
    last_checkpoint: str | None = None
    gpu_memory_released: bool | None = None


def halt_training(cfg: TrainingJobConfig) -> HaltRecord:
    """Stop the training job gracefully and report what happened.

    Args:
        cfg: How to find and stop the job.

    Returns:
        The record. ``already_gone`` when the pidfile is missing or its process no longer runs (a second
        call after a successful halt lands here too).

    Raises:
        TrainingHaltError: The pidfile is unreadable, the process may not be signalled, or it did not exit
            within ``stop_timeout_s`` and ``escalate`` is off; the message says what to do.

    """
    if cfg.kind == "none":
        return HaltRecord(kind="none")
    assert cfg.pidfile is not None
    pidfile = Path(cfg.pidfile)
    pid = _read_pid(pidfile)
    if pid is None or not _is_running(pid) or _started_after(pid, pidfile):
        record = HaltRecord(
            kind="pidfile",
            pid=pid,
            already_gone=True,
            last_checkpoint=newest_checkpoint(cfg.checkpoint_glob),
            gpu_memory_released=_wait_gpu_release(pid) if pid is not None else _gpu_memory_free_of(None),
        )
        logger.info("training already gone pidfile=%s pid=%s", pidfile, pid)
        return record
    signum = signal.Signals[cfg.signal]
    started = time.monotonic()
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return HaltRecord(
            kind="pidfile", pid=pid, already_gone=True, last_checkpoint=newest_checkpoint(cfg.checkpoint_glob)
        )
    except PermissionError as error:
        raise TrainingHaltError(
            f"not allowed to signal training pid {pid} (from {pidfile}): run datagen as the trainer's user "
            "or root, or stop the trainer yourself and set training.kind: none",
            pid=pid,
        ) from error
    logger.info("sent %s to training pid=%d; waiting up to %.0fs", signum.name, pid, cfg.stop_timeout_s)
    escalated = False
    if not _wait_exit(pid, cfg.stop_timeout_s):
        if not cfg.escalate:
            raise TrainingHaltError(
                f"training pid {pid} did not exit within {cfg.stop_timeout_s:.0f}s after {signum.name} "
                "and still holds its GPUs. Check the trainer's log; stop it by hand, raise "
                "training.stop_timeout_s, or set training.escalate: true to SIGKILL it after the timeout "
                "(its last checkpoint is kept).",
                pid=pid,
            )
        logger.warning(
            "training pid=%d ignored %s for %.0fs: sending SIGKILL", pid, signum.name, cfg.stop_timeout_s
        )
        escalated = True
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if not _wait_exit(pid, KILL_WAIT_S):
            raise TrainingHaltError(
                f"training pid {pid} survived SIGKILL for {KILL_WAIT_S:.0f}s (uninterruptible I/O?); "
                "check the host before taking its GPUs",
                pid=pid,
            )
    waited_s = round(time.monotonic() - started, 3)
    record = HaltRecord(
        kind="pidfile",
        pid=pid,
        signal=signum.name,
        stopped=True,
        escalated=escalated,
        waited_s=waited_s,
        last_checkpoint=newest_checkpoint(cfg.checkpoint_glob),
        gpu_memory_released=_wait_gpu_release(pid),
    )
    logger.info(
        "training stopped pid=%d waited_s=%.1f escalated=%s last_checkpoint=%s",
        pid,
        waited_s,
        escalated,
        record.last_checkpoint,
    )
    return record


def validate_training_job(cfg: TrainingJobConfig) -> list[str]:
    """Check, without signalling anything, that :func:`halt_training` can do its job.

    Args:
        cfg: The training job config.

    Returns:
        One line per problem with its fix; empty when halting can proceed.

    """
    if cfg.kind == "none":
        return []
    assert cfg.pidfile is not None
    pidfile = Path(cfg.pidfile)
    if not pidfile.exists():
        return [
            f"training pidfile {pidfile} does not exist: fix training.pidfile, or set training.kind: none "
            "when no training job runs on this host"
        ]
    try:
        pid = _read_pid(pidfile)
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


def newest_checkpoint(pattern: str | None) -> str | None:
    """The most recently modified file matching ``pattern`` (``**`` allowed); None without matches."""
    if not pattern:
        return None
    files = [Path(path) for path in glob.glob(os.path.expanduser(pattern), recursive=True)]
    files = [path for path in files if path.is_file()]
    if not files:
        return None
    return str(max(files, key=lambda path: path.stat().st_mtime_ns))


def _read_pid(pidfile: Path) -> int | None:
    try:
        text = pidfile.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise TrainingHaltError(
            f"cannot read training pidfile {pidfile}: {error}; fix its permissions"
        ) from error
    first = text.split()[0] if text else ""
    if not first.isdigit() or int(first) <= 1:
        raise TrainingHaltError(
            f"training pidfile {pidfile} holds {text[:40]!r}, not a process id; point "
            "training.pidfile at the file the trainer writes its pid to",
            pidfile=str(pidfile),
        )
    return int(first)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    # An exited child of ours stays a zombie until reaped; it holds no GPU memory and counts as gone.
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return raw[raw.rfind(")") + 2 :].split()[0] in {"Z", "X"}


def _started_after(pid: int, pidfile: Path) -> bool:
    """True when ``pid`` started after the pidfile was written: the pid was reused by another process."""
    started = _process_start_epoch_s(pid)
    if started is None:
        return False
    try:
        written = pidfile.stat().st_mtime
    except OSError:
        return False
    return started > written + PID_REUSE_SLACK_S


def _process_start_epoch_s(pid: int) -> float | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        uptime_fields = Path("/proc/stat").read_text()
    except OSError:
        return None
    start_ticks = int(raw[raw.rfind(")") + 2 :].split()[19])
    boot = next((line.split()[1] for line in uptime_fields.splitlines() if line.startswith("btime ")), None)
    if boot is None:
        return None
    return int(boot) + start_ticks / os.sysconf("SC_CLK_TCK")


def _wait_exit(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _is_running(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_INTERVAL_S)
    return True


def _gpu_memory_free_of(pid: int | None) -> bool | None:
    """Whether no compute process ``pid`` holds GPU memory; None without nvidia-smi (nothing to check)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        result = subprocess.run(
            [smi, "--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    processes = parse_compute_apps_csv(result.stdout)
    if pid is None:
        return True
    return all(process.pid != pid for process in processes)


def _wait_gpu_release(pid: int) -> bool | None:
    deadline = time.monotonic() + GPU_RELEASE_WAIT_S
    while True:
        released = _gpu_memory_free_of(pid)
        if released is None or released or time.monotonic() >= deadline:
            if released is False:
                logger.warning("training pid=%d exited but nvidia-smi still lists it holding GPU memory", pid)
            return released
        time.sleep(1.0)
