"""Processes on this host as ``/proc`` shows them, the teardown of whole process groups, and usable cores.

One place for what the fleet (its servers and their registry) and the training-job handles both need:
``/proc/<pid>/stat`` parsing (state, parent, process group, start time), zombie checks, command lines,
descendants and group members, the TCP sockets listening on a port and the processes holding them, and
stopping process groups (SIGTERM, a grace period, SIGKILL). Where there is no ``/proc`` (macOS laptops),
command lines come from ``ps``, groups are probed with ``killpg`` and listeners are unknown (None).
:func:`usable_cores` is the one count of cores that every pool and CPU server of datagen sizes itself by.

Not psutil, although the locks hold it: what the fleet decides on is what psutil does not give. A server's
port counts as ours only when the listening socket's inode is held by the server's process tree (psutil
reports one pid per connection, not the socket inodes a parent and its workers share), teardown is by process
group (psutil has no process-group view), and pid reuse is told by the start time in clock ticks that the
fleet registry records. psutil would replace a few small readers here (command line, children, create time)
and leave the rest, so one module would read processes two ways.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator
from contextlib import suppress
from pathlib import Path

logger = logging.getLogger(__name__)

PROC = Path("/proc")
# Process states (/proc/<pid>/stat field 3) of a process that has exited: it holds no memory, GPU or other.
EXITED_STATES = frozenset({"Z", "X"})
# Fields of /proc/<pid>/stat counted from the state (field 3), after the command name.
_STATE, _PARENT, _GROUP, _START_TICKS = 0, 1, 2, 19
# How often a teardown checks whether signalled groups are gone.
GROUP_POLL_INTERVAL_S = 0.125
# Bound on how long SIGKILLed processes may take to disappear (they cannot refuse; this only guards waits).
KILL_WAIT_S = 10.0
# The socket state of a listening TCP socket in /proc/net/tcp{,6}.
TCP_LISTEN = "0A"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity mask where the OS has one, else the machine's count.

    A pinned container or ``taskset`` leaves fewer cores than the machine has: pools and CPU servers size by these.
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS has no affinity masks
        return os.cpu_count() or 1


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name; None when gone or unreadable."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its closing paren.
    return raw[raw.rfind(")") + 2 :].split()


def is_running(pid: int) -> bool:
    """Whether ``pid`` exists and has not exited (a zombie, an exited child not yet reaped, holds nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat_fields(pid)
    return fields is None or fields[_STATE] not in EXITED_STATES


def is_exited(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie, judged from ``/proc`` alone (True when unreadable)."""
    fields = _stat_fields(pid)
    return fields is None or fields[_STATE] in EXITED_STATES


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc`` stat field 22): pid reuse changes it."""
    fields = _stat_fields(pid)
    return int(fields[_START_TICKS]) if fields else None


def start_epoch_s(pid: int) -> float | None:
    """When ``pid`` started, in seconds since the epoch; None where unknown."""
    ticks = start_ticks(pid)
    try:
        boot_line = next(
            line for line in (PROC / "stat").read_text().splitlines() if line.startswith("btime ")
        )
    except (OSError, StopIteration):
        return None
    if ticks is None:
        return None
    return int(boot_line.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")


def group_of(pid: int) -> int | None:
    """The process group id of ``pid``; None when gone."""
    fields = _stat_fields(pid)
    return int(fields[_GROUP]) if fields else None


def _pids() -> Iterator[int]:
    if not PROC.is_dir():
        return
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            yield int(entry.name)


def group_members(pgid: int) -> Iterator[int]:
    """Every process in group ``pgid`` (zombies included); nothing where there is no ``/proc``."""
    for pid in _pids():
        if group_of(pid) == pgid:
            yield pid


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (workers of a launcher such as torchrun), sorted."""
    return descendants_of([pid])


def descendants_of(pids: Iterable[int]) -> list[int]:
    """Every live descendant of any of ``pids``, sorted (one pass over ``/proc``)."""
    children: dict[int, list[int]] = {}
    for child in _pids():
        fields = _stat_fields(child)
        if fields is not None:
            children.setdefault(int(fields[_PARENT]), []).append(child)
    roots = set(pids)
    found: set[int] = set()
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found and child not in roots:
                found.add(child)
                stack.append(child)
    return sorted(found)


def read_argv(pid: int) -> list[str] | None:
    """The argv of a running process (``/proc``, or ``ps`` where there is no ``/proc``); None if gone.

    Without ``/proc``, ``ps`` splits the arguments on spaces: compare such an argv by its joined form.
    """
    if PROC.is_dir():
        try:
            raw = (PROC / str(pid) / "cmdline").read_bytes()
        except OSError:
            return None
        return [part.decode(errors="replace") for part in raw.split(b"\0") if part] or None
    result = subprocess.run(
        ["ps", "-o", "args=", "-p", str(pid)], capture_output=True, text=True, check=False
    )
    return result.stdout.split() if result.returncode == 0 and result.stdout.strip() else None


def read_command_line(pid: int) -> str | None:
    """The command line of ``pid``, its arguments joined by spaces (what a regex is searched in)."""
    argv = read_argv(pid)
    return " ".join(argv) if argv else None


def signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to process group ``pgid``; False when the group is gone or not ours to signal."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        logger.warning("no permission to signal process group pgid=%d", pgid)
        return False
    return True


def group_exists(pgid: int) -> bool:
    """Whether any process of group ``pgid`` still runs (reaping the leader if it is our child)."""
    # A zombie leader still counts as a group member until reaped; reap it if it is our child.
    with suppress(ChildProcessError, OSError):
        os.waitpid(pgid, os.WNOHANG)
    for pid in group_members(pgid):
        if not is_exited(pid):
            return True
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return not PROC.is_dir()


def terminate_groups(pgids: list[int], grace_s: float) -> None:
    """SIGTERM every group, wait up to ``grace_s`` for all to vanish, SIGKILL the rest.

    Args:
        pgids: The process groups (one per server: each is its group's leader).
        grace_s: Time between SIGTERM and SIGKILL; 0 kills at once.

    """
    live = [pgid for pgid in pgids if signal_group(pgid, signal.SIGTERM)] if grace_s > 0 else list(pgids)
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline:
        time.sleep(GROUP_POLL_INTERVAL_S)
        live = [pgid for pgid in live if group_exists(pgid)]
    stubborn = [pgid for pgid in live if signal_group(pgid, signal.SIGKILL)]
    if stubborn and grace_s > 0:
        logger.warning("process groups ignored SIGTERM for %.0fs, killed pgids=%s", grace_s, stubborn)
    kill_deadline = time.monotonic() + KILL_WAIT_S
    while stubborn and time.monotonic() < kill_deadline:
        time.sleep(GROUP_POLL_INTERVAL_S)
        stubborn = [pgid for pgid in stubborn if group_exists(pgid)]


# --- listening sockets --------------------------------------------------------------------------


def listening_sockets() -> dict[int, list[tuple[IPAddress, int]]] | None:
    """Every TCP socket listening in this network namespace, by port: (local address, socket inode).

    IPv4-mapped IPv6 addresses are given as IPv4. None where there is no ``/proc`` (nothing can be told).
    """
    if not (PROC / "net" / "tcp").exists():
        return None
    found: dict[int, list[tuple[IPAddress, int]]] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != TCP_LISTEN:
                continue
            address_hex, _, port_hex = fields[1].partition(":")
            found.setdefault(int(port_hex, 16), []).append((_proc_net_address(address_hex), int(fields[9])))
    return found


def _proc_net_address(hex_address: str) -> IPAddress:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in host (little-endian) byte order."""
    raw = b"".join(bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8))
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw)
    address = ipaddress.IPv6Address(raw)
    return address.ipv4_mapped or address


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets ``pid`` holds open (empty when gone or not ours to read)."""
    fd_dir = PROC / str(pid) / "fd"
    try:
        entries = os.listdir(fd_dir)
    except OSError:
        return set()
    inodes: set[int] = set()
    for entry in entries:
        try:
            target = os.readlink(fd_dir / entry)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def not_held_by(pid: int, inodes: set[int]) -> set[int]:
    """The sockets of ``inodes`` that neither ``pid`` nor a member of its group or a descendant holds.

    The leader is checked first: a server's listening socket is almost always its own, and the tree is only
    walked when it is not.
    """
    left = inodes - socket_inodes(pid)
    if not left:
        return left
    for member in sorted((set(descendants(pid)) | set(group_members(pid))) - {pid}):
        left -= socket_inodes(member)
        if not left:
            break
    return left


def socket_holder(inode: int) -> int | None:
    """The pid holding socket ``inode``; None when no process we may inspect holds it (another user's)."""
    for pid in _pids():
        if inode in socket_inodes(pid):
            return pid
    return None
