"""The host's GPU lock: one run at a time on a box's GPUs, released by the kernel when its holder dies.

A run holds an exclusive ``flock`` on ``<lock_dir>/<name>.lock`` from just before it halts training
until its servers are down and training is handed back. ``lock_dir`` (``DATAGEN_LOCK_DIR``, default
``/run/lock/datagen``) belongs to the box, not to a user: two users, a container and its host, or two workers
with different state folders take the same lock. The folder and the lock file are made writable by every
user when this process creates them (whatever its umask), so the next user's run can open them.

The kernel drops the lock the moment the holding process exits, however it exits (SIGKILL, the OOM killer,
a power cut of the worker's process group), so a crashed run never keeps the box: the next run takes the
lock at once. Nothing depends on a Prefect server keeping a lease alive.

The lock file also names its holder (run id, flow run id, pid, host, start time) so a waiting run, and
``datagen gpu-lock``, can say who holds the GPUs. The holder writes those details after it has the lock;
a reader that catches the file mid-write sees an unknown holder, never a wrong one.

Waiting is a loop of non-blocking attempts with short sleeps in the calling thread: a SIGINT or SIGTERM
handler that raises ends the wait at once (no thread to join, no service to drain).

Not filelock, although the locks hold it: the lock is one ``flock`` call, and what is around it is datagen's
own: the holder record written into the locked file (filelock keeps its descriptor private), a file shared by
every user of the box that is opened without ``O_CREAT`` when it exists (a sticky folder refuses that on
another user's file), and error messages that say how to fix the folder. filelock adds reentrancy, which one
holder per run does not need, and falls back to a soft lock on file systems without ``flock``: this lock must
be the kernel's, released the moment its holder dies.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from datagen.errors import GpuLockTimeoutError, GpuLockUnavailableError
from datagen.settings import get_settings

logger = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"
# The lock folder and its files are shared by every user of the box: whoever creates them opens them to all
# (a cooperative lock between datagen runs; no sticky bit, so another user's run can replace the halt record).
SHARED_DIR_MODE = 0o777
SHARED_FILE_MODE = 0o666
# Between two attempts while another run holds the lock: short enough that the box changes hands within a
# second of the holder ending, long enough to cost nothing.
LOCK_POLL_S = 0.5
# How often a waiting run repeats who it is waiting for (the first line comes at once).
WAIT_REMINDER_S = 600.0
# Any lock name becomes a safe file name: letters, digits, dot, dash and underscore.
_SAFE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_")


class GpuLockHolder(BaseModel):
    """Who holds a host's GPU lock, as its holder wrote it into the lock file."""

    model_config = ConfigDict(extra="forbid")

    run_id: str | None = Field(default=None, description="The datagen run holding the GPUs.")
    flow_run_id: str | None = Field(
        default=None, description="Its Prefect flow run (UI: /runs/flow-run/<id>)."
    )
    pid: int = Field(description="The holding process; the lock goes when it exits.")
    host: str = Field(description="Hostname of the holder.")
    started_at: str = Field(description="ISO 8601 UTC time the lock was taken.")

    def describe(self) -> str:
        """One phrase for log lines: ``run R (flow run F, pid P on H since T)``."""
        flow_run = f"flow run {self.flow_run_id}, " if self.flow_run_id else ""
        return f"run {self.run_id or '?'} ({flow_run}pid {self.pid} on {self.host} since {self.started_at})"


def current_holder(run_id: str | None, flow_run_id: str | None) -> GpuLockHolder:
    """The details this process writes when it takes the lock."""
    return GpuLockHolder(
        run_id=run_id,
        flow_run_id=flow_run_id,
        pid=os.getpid(),
        host=socket.gethostname(),
        started_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )


def gpu_lock_name() -> str:
    """The name of this host's GPU lock: ``DATAGEN_GPU_LOCK``, or one per hostname (``datagen-gpus-<host>``)."""
    configured = get_settings().gpu_lock
    if configured:
        return configured
    host = re.sub(r"[^a-z0-9-]+", "-", socket.gethostname().lower()).strip("-") or "localhost"
    return f"datagen-gpus-{host}"


def host_lock_path() -> Path:
    """The GPU lock file of this host: :func:`lock_path` of :func:`gpu_lock_name` under ``DATAGEN_LOCK_DIR``."""
    return lock_path(get_settings().lock_dir, gpu_lock_name())


def lock_path(lock_dir: str | Path, name: str) -> Path:
    """The lock file of lock ``name`` in the box's lock folder."""
    safe = "".join(char if char in _SAFE_CHARS else "-" for char in name).strip(".") or "gpus"
    return Path(lock_dir).expanduser() / f"{safe}{LOCK_SUFFIX}"


def make_shared_dir(path: Path) -> None:
    """Create the lock folder (and its parents) open to every user of the box; an existing one is kept."""
    if path.is_dir():
        return
    make_shared_dir(path.parent)
    try:
        path.mkdir()
    except FileExistsError:
        return
    os.chmod(path, SHARED_DIR_MODE)  # mkdir's mode is cut by the umask


def open_lock_file(path: Path) -> int:
    """Open (creating it open to every user when missing) the lock file for reading and writing.

    An existing file is opened without ``O_CREAT``: in a sticky folder, ``fs.protected_regular`` refuses
    ``O_CREAT`` on another user's file even when its mode allows writing.

    Raises:
        GpuLockUnavailableError: The folder or the file cannot be created or opened by this user.
    """
    try:
        make_shared_dir(path.parent)
        while True:
            try:
                return os.open(path, os.O_RDWR)
            except FileNotFoundError:
                pass
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, SHARED_FILE_MODE)
            except FileExistsError:
                continue  # another run created it between the two calls: open that one
            os.fchmod(fd, SHARED_FILE_MODE)
            return fd
    except OSError as error:
        raise GpuLockUnavailableError(
            f"cannot open the box's GPU lock {path}: {error.strerror or error}. Every run on this box must "
            f"take this lock before it halts training. Fix: let this user write it (`sudo mkdir -p "
            f"{path.parent} && sudo chmod 1777 {path.parent}`, or `sudo chmod 666 {path}` if it exists), or "
            "set DATAGEN_LOCK_DIR to a folder every user of the box can write (the same one for all of them).",
            path=str(path),
        ) from error


def read_holder(path: Path) -> GpuLockHolder | None:
    """The holder named in the lock file; None when it is empty, unreadable or being written.

    The file outlives its holder (only the lock goes), so a name here is the *last* holder: combine with
    :func:`is_held` to know whether it still holds the GPUs.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    if not text.strip():
        return None
    try:
        return GpuLockHolder.model_validate_json(text)
    except ValidationError:
        return None


class HostGpuLock:
    """An exclusive ``flock`` on one lock file, owned by this object (close it to release).

    The descriptor is not inherited by child processes (Python opens files close-on-exec), so servers and
    a restarted trainer never keep the lock alive after the run.

    Args:
        path: The lock file (it and its folder are created, open to every user, when missing).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def try_acquire(self, holder: GpuLockHolder) -> bool:
        """Take the lock if it is free and write ``holder`` into the file; never waits.

        Returns:
            True when this object holds the lock now.

        Raises:
            GpuLockUnavailableError: The lock file cannot be opened (:func:`open_lock_file`).
        """
        if self._fd is not None:
            return True
        fd = open_lock_file(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        self._fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder.model_dump_json().encode(), 0)
            os.fsync(fd)
        except OSError as error:  # the details are for humans: a full disk must not cost the lock
            logger.warning("GPU lock holder details not written path=%s error=%s", self.path, error)
        return True

    def release(self) -> None:
        """Release the lock (idempotent). The file stays, naming its last holder."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def is_held(path: Path) -> bool:
    """Whether some process holds the lock at ``path`` now (tries it without waiting, then lets go)."""
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


@contextlib.contextmanager
def hold_gpu_lock(
    path: Path,
    holder: GpuLockHolder,
    *,
    timeout_s: float,
    on_wait: Callable[[GpuLockHolder | None], None] | None = None,
    poll_s: float = LOCK_POLL_S,
    name: str | None = None,
) -> Iterator[HostGpuLock]:
    """Hold the lock for the block, waiting (at most ``timeout_s``) while another process holds it.

    Args:
        path: The lock file (:func:`lock_path`).
        holder: The details to write once the lock is taken.
        timeout_s: How long to wait for another holder to finish.
        on_wait: Called when the lock is taken by someone else, at once and every
            :data:`WAIT_REMINDER_S`, with the holder named in the file (None when unknown).
        poll_s: Seconds between attempts.
        name: The lock's name, for the timeout message.

    Yields:
        The held lock.

    Raises:
        GpuLockTimeoutError: Another process held the lock for longer than ``timeout_s``.
    """
    lock = HostGpuLock(path)
    deadline = time.monotonic() + timeout_s
    next_reminder = 0.0
    try:
        while not lock.try_acquire(holder):
            now = time.monotonic()
            if now >= deadline:
                other = read_holder(path)
                raise GpuLockTimeoutError(
                    f"Another run held this host's GPUs for more than {timeout_s:.0f} s: "
                    f"{other.describe() if other else 'holder unknown'} holds the lock file {path}. "
                    "Start this run again when that one is done (`datagen gpu-lock` shows the holder), or raise "
                    "DATAGEN_GPU_LOCK_TIMEOUT_S.",
                    lock=name or path.stem,
                )
            if on_wait is not None and now >= next_reminder:
                on_wait(read_holder(path))
                next_reminder = now + WAIT_REMINDER_S
            time.sleep(min(poll_s, max(0.0, deadline - now)))
        yield lock
    finally:
        lock.release()
