"""The fleet's pidfile registry: which server processes a fleet owns, and stopping them from elsewhere.

A :class:`~datagen.host.fleet.Fleet` records its servers in ``<state_dir>/servers.json`` (written
atomically by :func:`write_registry`) so another process (a Prefect state hook, the next run after a crash)
can stop them with :func:`stop_fleet_from_pidfile` / :func:`cleanup_orphans`. A recorded group is only
signalled while it provably is the recorded server (same command line, or members left in its group), and
the owner's start time tells a live owner from a reused pid.
"""

from __future__ import annotations

import logging
import os
from contextlib import suppress
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from datagen import processes

logger = logging.getLogger(__name__)

PIDFILE_NAME = "servers.json"
PIDFILE_VERSION = 1
# SIGTERM gives servers time to free GPU memory and sockets; after this they get SIGKILL.
STOP_GRACE_S = 30.0

# Pidfiles of the fleets running in this process: never orphans, whatever cleanup is asked for.
_live_pidfiles: set[Path] = set()


class ServerRecord(BaseModel):
    """One running server as the pidfile registry records it."""

    model_config = ConfigDict(extra="forbid")

    index: int
    pid: int
    pgid: int
    port: int
    url: str
    cmd: list[str]
    log_path: str | None = None
    started_at: str = Field(description="ISO 8601 UTC time of the launch.")


class FleetRegistry(BaseModel):
    """Content of the pidfile: who owns the servers and which processes they are."""

    model_config = ConfigDict(extra="forbid")

    version: int = PIDFILE_VERSION
    owner_pid: int
    owner_start_ticks: int | None = Field(
        default=None, description="Start time of the owner (/proc stat field 22) so pid reuse is detected."
    )
    servers: list[ServerRecord] = Field(default_factory=list)


def mark_live(pidfile: Path) -> None:
    """Record that a fleet of this process owns ``pidfile``, so cleanup never takes its servers for orphans."""
    _live_pidfiles.add(pidfile.resolve())


def mark_stopped(pidfile: Path) -> None:
    """Undo :func:`mark_live` once the fleet has stopped."""
    _live_pidfiles.discard(pidfile.resolve())


def write_registry(pidfile: Path, registry: FleetRegistry) -> None:
    """Replace the registry in ``pidfile`` atomically: a concurrent reader sees the old or the new one."""
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    temporary = pidfile.with_suffix(".json.tmp")
    temporary.write_text(registry.model_dump_json(indent=2))
    temporary.replace(pidfile)


def fleet_pidfile(state_dir: str | Path) -> Path:
    """The pidfile a :class:`~datagen.host.fleet.Fleet` with this ``state_dir`` writes (for hooks, cleanup)."""
    return Path(state_dir) / PIDFILE_NAME


def read_registry(path: Path) -> FleetRegistry | None:
    """The registry in ``path``; None when the file is missing or unreadable (logged)."""
    try:
        return FleetRegistry.model_validate_json(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        logger.warning("unreadable fleet pidfile path=%s error=%s", path, error)
        return None


def stop_fleet_from_pidfile(path: str | Path, *, grace_s: float = STOP_GRACE_S) -> int:
    """Stop the servers recorded in a pidfile (for hooks running in another process).

    A recorded group is only signalled when its leader still runs the recorded command line (or the
    leader is gone but members of its group remain), so a reused pid is never killed.

    Args:
        path: The pidfile (``<state_dir>/servers.json``).
        grace_s: Time between SIGTERM and SIGKILL.

    Returns:
        The number of server process groups that were signalled. The pidfile is removed.

    """
    pidfile = Path(path)
    registry = read_registry(pidfile)
    if registry is None:
        with suppress(FileNotFoundError):
            pidfile.unlink()
        return 0
    groups = [record.pgid for record in registry.servers if _group_is_ours(record)]
    processes.terminate_groups(groups, grace_s)
    with suppress(FileNotFoundError):
        pidfile.unlink()
    if groups:
        logger.info("stopped servers from pidfile path=%s groups=%d", pidfile, len(groups))
    return len(groups)


def cleanup_orphans(state_dir: str | Path, *, grace_s: float = STOP_GRACE_S, recursive: bool = False) -> int:
    """Stop servers left by an earlier run whose owner process is gone (call before starting).

    Servers of an owner that is still alive (another run on this host) are left alone and logged.

    Args:
        state_dir: The state folder holding ``servers.json``.
        grace_s: Time between SIGTERM and SIGKILL.
        recursive: Also look in every folder below ``state_dir`` (one state folder per flow run: pass
            their common parent to find the orphans of any earlier run).

    Returns:
        The number of orphaned server groups stopped.

    """
    root = Path(state_dir)
    pidfiles = sorted(root.rglob(PIDFILE_NAME)) if recursive else [fleet_pidfile(root)]
    stopped = 0
    for pidfile in pidfiles:
        registry = read_registry(pidfile)
        if registry is None:
            continue
        if pidfile.resolve() in _live_pidfiles or (
            registry.owner_pid != os.getpid() and _owner_alive(registry)
        ):
            logger.warning(
                "servers in %s belong to a live fleet (pid=%d): left alone", pidfile, registry.owner_pid
            )
            continue
        stopped += stop_fleet_from_pidfile(pidfile, grace_s=grace_s)
    return stopped


def _owner_alive(registry: FleetRegistry) -> bool:
    try:
        os.kill(registry.owner_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    ticks = processes.start_ticks(registry.owner_pid)
    if registry.owner_start_ticks is not None and ticks is not None:
        return ticks == registry.owner_start_ticks
    return True


def _cmdline_matches(actual: list[str], recorded: list[str]) -> bool:
    if actual == recorded:
        return True
    # Without /proc, `ps` splits arguments on spaces; compare the joined form instead.
    return " ".join(actual) == " ".join(recorded)


def _group_is_ours(record: ServerRecord) -> bool:
    leader_cmd = processes.read_argv(record.pgid)
    if leader_cmd is not None and not processes.is_exited(record.pgid):
        if _cmdline_matches(leader_cmd, record.cmd):
            return True
        logger.warning(
            "pid %d now runs %r, not the recorded server %r: leaving it alone",
            record.pgid,
            leader_cmd,
            record.cmd,
        )
        return False
    # Leader gone: while members of its group remain the kernel cannot reuse the id, so they are ours.
    return any(not processes.is_exited(pid) for pid in processes.group_members(record.pgid))
