"""Hosts joining and leaving the run's one dispatcher: every box's servers, one fleet-wide queue.

A multi-host run keeps a single :class:`~datagen.generation.dispatcher.Dispatcher` in the parent flow
process; each host's servers are added as the host publishes them (``fleet.json``, see
:mod:`datagen.output.multihost`) and removed when the host is lost. The dispatcher does the rest, as on one box:
continuous admission over all servers, least-outstanding routing, exactly one record per request.

A host is lost when its host flow run ends before the parent released it (crashed, failed, cancelled), or
when every one of its servers has been down (connection refused, liveness) for ``lost_after_s``: a killed
box leaves its flow run "Running" in Prefect forever (its worker died with it), so the servers' silence is
the signal that always comes. Removing a server hands its in-flight requests back to the queue without
costing them an attempt; the other hosts answer them.

A host's server that dies is restarted by its host, maybe on another port (another program took its own):
the host publishes each restart as a new version of its fleet, and :meth:`HostWatch.follow` reads them in
order, moving the dispatcher to the new URL. The parent cannot see whose process listens on a remote port,
so a server that refused a connection gets nothing more from the dispatcher until such a version vouches for
it (:class:`HostVouches`): a program that took the port is never sent a request, nor a probe.

When generation is over the parent checks once more (``check(..., at_end=True)``) before it releases the hosts:
a box that died near the end, maybe while none of its servers had a request (so no failed request told the
dispatcher), refuses or ignores a connection; it is lost then, named in the release and the report, and the
parent does not wait for a host part that will never end.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from datagen.generation.dispatcher import Dispatcher
from datagen.output.layout import RunLayout
from datagen.output.multihost import HostFleet, read_host_fleet
from datagen.output.store import Store

logger = logging.getLogger(__name__)

# How long the end-of-generation check waits for a server to accept a TCP connection: a box that is gone
# refuses at once (its processes died) or never answers (the machine died).
CONNECT_PROBE_TIMEOUT_S = 2.0
# Servers probed at once in that check.
MAX_PARALLEL_PROBES = 16


@dataclass
class LostHost:
    """A host removed mid-run, and why."""

    name: str
    reason: str
    in_flight: int


class HostVouches:
    """For each server URL, the version of its host's fleet that last vouched for it (thread-safe).

    The dispatcher reads it (``Dispatcher(vouch=vouches.version)``) before it trusts a gone server again. Only
    servers their host launched are here: an external server (``HostFleet.launched`` False) has no host to
    restart it, and the parent's own probes decide for it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._versions: dict[str, int] = {}

    def version(self, url: str) -> int | None:
        """The version that last vouched for ``url``; None when no host vouches for it."""
        with self._lock:
            return self._versions.get(url.rstrip("/"))

    def vouch(self, urls: list[str], version: int) -> None:
        """Version ``version`` of a host's fleet says these servers are its own, ready."""
        with self._lock:
            for url in urls:
                self._versions[url.rstrip("/")] = version

    def forget(self, url: str) -> None:
        """A URL its server moved off: nothing vouches for it any more."""
        with self._lock:
            self._versions.pop(url.rstrip("/"), None)


@dataclass
class _Member:
    fleet: HostFleet
    down_since: float | None = None


@dataclass
class HostWatch:
    """The hosts whose servers the dispatcher uses; decides when one is lost.

    Args:
        dispatcher: The run's dispatcher (running).
        lost_after_s: How long all of a host's servers may be down before the host is removed.
        vouches: What the hosts' fleets say of each server (the same object the dispatcher reads).
        clock: Monotonic seconds (a parameter for tests).
    """

    dispatcher: Dispatcher
    lost_after_s: float
    vouches: HostVouches = field(default_factory=HostVouches)
    clock: Callable[[], float] = time.monotonic
    members: dict[str, _Member] = field(default_factory=dict)
    lost: list[LostHost] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def join(self, fleet: HostFleet) -> bool:
        """Add a host's servers to the dispatcher (once per host); False when it was already lost or joined."""
        with self._lock:
            if fleet.host in self.members or any(lost.name == fleet.host for lost in self.lost):
                return False
            self.members[fleet.host] = _Member(fleet)
        if fleet.launched:
            self.vouches.vouch(fleet.urls, fleet.version)
        for url in fleet.urls:
            self.dispatcher.add_server(url, max_inflight=fleet.max_inflight_per_server)
        logger.info(
            "host joined host=%s hostname=%s servers=%d max_inflight_per_server=%d urls=%s",
            fleet.host,
            fleet.hostname,
            len(fleet.urls),
            fleet.max_inflight_per_server,
            ",".join(fleet.urls),
        )
        return True

    def follow(self, store: Store, layout: RunLayout, attempt_id: str) -> int:
        """Apply every new version of the members' fleets, in order; returns how many were applied.

        A version's URLs are in plan order: one that differs from the version before is a server moved to
        another port, and the dispatcher moves with it. Its restarted servers are vouched for from then on.
        """
        with self._lock:
            members = list(self.members.items())
        applied = 0
        for name, member in members:
            while True:
                newer = read_host_fleet(store, layout, attempt_id, name, member.fleet.version + 1)
                if newer is None:
                    break
                self._apply(name, member, newer)
                applied += 1
        return applied

    def _apply(self, name: str, member: _Member, newer: HostFleet) -> None:
        before = member.fleet
        if len(newer.urls) != len(before.urls):
            # A host never adds or drops servers mid-run; a version that does is not one it wrote.
            logger.error(
                "host fleet version ignored host=%s version=%d: %d servers where it had %d",
                name,
                newer.version,
                len(newer.urls),
                len(before.urls),
            )
            member.fleet = before.model_copy(update={"version": newer.version})
            return
        if newer.launched:
            self.vouches.vouch(newer.restarted, newer.version)
        for old, new in zip(before.urls, newer.urls, strict=True):
            if old != new:
                self.vouches.forget(old)
                self.dispatcher.move_server(old, new)
                logger.warning(
                    "host server moved host=%s from=%s to=%s version=%d", name, old, new, newer.version
                )
        logger.info(
            "host servers restarted host=%s version=%d urls=%s",
            name,
            newer.version,
            ",".join(newer.restarted),
        )
        member.fleet = newer

    @property
    def active(self) -> list[str]:
        """Names of the hosts whose servers are in use."""
        with self._lock:
            return list(self.members)

    @property
    def silent(self) -> list[str]:
        """Names of the hosts in use whose servers are all down, as of the last :meth:`check`."""
        with self._lock:
            return [name for name, member in self.members.items() if member.down_since is not None]

    def check(
        self, ended: Mapping[str, str], *, at_end: bool = False, lost_after_s: float | None = None
    ) -> list[LostHost]:
        """Remove the hosts that are gone; returns the ones lost by this call.

        Args:
            ended: Host name -> final state of its host flow run, for hosts whose flow run has ended.
            at_end: Generation is over: a server the dispatcher counts up must also accept a TCP connection
                now (an idle server that died was never told apart by a request), and reasons say when.
            lost_after_s: Overrides ``lost_after_s`` for this call (0: a host whose servers are all down now
                is lost at once).
        """
        now = self.clock()
        limit = self.lost_after_s if lost_after_s is None else lost_after_s
        servers = {server.url: server for server in self.dispatcher.stats().servers}
        newly_lost: list[LostHost] = []
        with self._lock:
            members = list(self.members.items())
        answering: set[str] = set()
        if at_end:
            counted_up = [
                url
                for _, member in members
                for url in member.fleet.urls
                if (state := servers.get(url.rstrip("/"))) is not None and state.up
            ]
            answering = _accepting_connections(counted_up)
        for name, member in members:
            reason: str | None = None
            if name in ended:
                when = "before the release" if at_end else "while generation went on"
                reason = f"its host flow run ended ({ended[name]}) {when}"
            else:
                states = [servers.get(url.rstrip("/")) for url in member.fleet.urls]
                if any(
                    state is not None and state.up and (not at_end or url in answering)
                    for url, state in zip(member.fleet.urls, states, strict=True)
                ):
                    member.down_since = None
                else:
                    if member.down_since is None:
                        member.down_since = now
                    if now - member.down_since >= limit:
                        reason = f"all {len(states)} of its servers down for {now - member.down_since:.0f}s"
                        if at_end:
                            reason += " at the end of generation"
            if reason is not None:
                newly_lost.append(self._lose(name, member, reason, servers))
        return newly_lost

    def give_up(self, name: str, reason: str) -> LostHost:
        """Record a host that never joined (its fleet never came, or its flow run ended first)."""
        lost = LostHost(name=name, reason=reason, in_flight=0)
        with self._lock:
            self.lost.append(lost)
        logger.error("host lost before it served host=%s reason=%s", name, reason)
        return lost

    def _lose(self, name: str, member: _Member, reason: str, servers: Mapping[str, object]) -> LostHost:
        in_flight = sum(getattr(servers.get(url.rstrip("/")), "in_flight", 0) for url in member.fleet.urls)
        for url in member.fleet.urls:
            self.dispatcher.remove_server(url)
        lost = LostHost(name=name, reason=reason, in_flight=in_flight)
        with self._lock:
            self.members.pop(name, None)
            self.lost.append(lost)
        logger.error(
            "host lost host=%s reason=%s in_flight_requeued=%d hosts_left=%d",
            name,
            reason,
            in_flight,
            len(self.members),
        )
        return lost


def _accepts_connection(url: str) -> bool:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", port), timeout=CONNECT_PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def _accepting_connections(urls: list[str]) -> set[str]:
    """The URLs whose server accepts a TCP connection now (probed in parallel, each within a timeout)."""
    if not urls:
        return set()
    with ThreadPoolExecutor(max_workers=min(len(urls), MAX_PARALLEL_PROBES)) as pool:
        accepted = list(pool.map(_accepts_connection, urls))
    return {url for url, ok in zip(urls, accepted, strict=True) if ok}
