"""Who holds a run id's lease on this box: a record next to the GPU lock, so a dead holder's lease is freed at once.

A run holds its run id's Prefect concurrency lease (``tasks/run_lease.py``) for as long as it runs. A runner
killed outright stops renewing it, but the server frees it only when it expires (about a minute later): a resume
started at once would be refused. The runner records here, on its own box, which lease it holds and which
process holds it; a later runner on the same box that finds the lease taken and its recorded holder gone (its
process exited, or its pid now names another process) releases exactly that lease and takes its own. A holder
on another box is never judged from here.
"""

from __future__ import annotations

import contextlib
import os
import socket
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from datagen.host.gpu_lock import SHARED_FILE_MODE, lock_path, make_shared_dir
from datagen.processes import is_running, start_ticks

# Suffix of a holder record (beside ``<name>.lock`` files in the box's lock folder).
RECORD_SUFFIX = ".holder.json"


class RunLeaseHolder(BaseModel):
    """The process on this box that holds a run id's lease, and which lease it is."""

    model_config = ConfigDict(extra="forbid")

    run_id: str
    lease_id: str = Field(description="The Prefect concurrency lease the holder took.")
    flow_run_id: str | None = None
    pid: int
    start_ticks: int | None = Field(description="When the pid started (pid reuse changes it).")
    host: str
    started_at: str

    @classmethod
    def this_process(cls, run_id: str, lease_id: str, flow_run_id: str | None) -> RunLeaseHolder:
        """The record this process writes once it holds ``lease_id``."""
        pid = os.getpid()
        return cls(
            run_id=run_id,
            lease_id=lease_id,
            flow_run_id=flow_run_id,
            pid=pid,
            start_ticks=start_ticks(pid),
            host=socket.gethostname(),
            started_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )

    def is_gone(self) -> bool:
        """Whether the holder was a process of this box that no longer runs (so its lease is nobody's)."""
        if self.host != socket.gethostname():
            return False
        return not is_running(self.pid) or start_ticks(self.pid) != self.start_ticks


def holder_path(lock_dir: str | Path, lease_name: str) -> Path:
    """The record of the holder of lease ``lease_name`` in the box's lock folder."""
    return lock_path(lock_dir, lease_name).with_suffix(RECORD_SUFFIX)


def read_holder(path: Path) -> RunLeaseHolder | None:
    """The recorded holder, or None when there is none (or it cannot be read)."""
    try:
        return RunLeaseHolder.model_validate_json(path.read_text())
    except (OSError, ValidationError):
        return None


def write_holder(path: Path, holder: RunLeaseHolder) -> None:
    """Record ``holder`` (replacing any record: only the lease's holder writes it), readable by every user."""
    make_shared_dir(path.parent)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(holder.model_dump_json())
    os.chmod(temporary, SHARED_FILE_MODE)
    os.replace(temporary, path)


def remove_holder(path: Path, lease_id: str) -> None:
    """Remove the record if it still names ``lease_id`` (a later holder's record stays)."""
    found = read_holder(path)
    if found is not None and found.lease_id == lease_id:
        with contextlib.suppress(OSError):
            path.unlink()
