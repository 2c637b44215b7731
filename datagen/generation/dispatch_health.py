"""The dispatcher's servers and their health: who is up, suspect, stalled or down.

Owns each server's two connection pools (generation requests sized to its cap; a small one for ``/health``),
servers joining and leaving, and the health loop: once a second it polls ``liveness``, probes down and
suspect servers, trusts a suspect server again after :data:`SUSPECT_MAX_S` without a verdict, marks down a
stalled server (below), and fails the waiting requests when no server has been up for
``GenerationConfig.no_live_server_timeout_s``. Loop thread only, except the table, which stats read from
any thread.

A stalled server is one that holds requests and has answered nothing for :meth:`ServerHealth.stall_limit_s`:
the larger of ``GenerationConfig.stall_min_s`` and :data:`STALL_FACTOR` times the slowest completion any
server gave so far. The dispatcher never gives a server more than its cap, so a healthy server works on every
request it holds and answers one at least every slowest-completion; one silent for several times that is
wedged, whatever its ``/health`` says (a chat-hung server still answers it). Its tries are cut short and sent
elsewhere at once, and it is held out of rotation (``/health`` is not asked) for the limit, doubled for each
stall in a row, before it may rejoin. Until some server has completed a request there is no yardstick and
only ``request_timeout_s`` applies.

With ``vouch`` (a multi-host run's parent, which cannot see whose process listens on a remote port), a server
that refused a connection is gone: another program may take its port, and its ``/health`` would answer for
it. Such a server is neither probed nor given requests again until its host vouches for it: ``vouch(url)``
changes when the host publishes that it restarted the server there and checked it is its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from datagen.config import GenerationConfig
from datagen.generation.dispatch_admission import Admission
from datagen.generation.dispatch_attempt import describe
from datagen.generation.dispatch_state import Outcome, ServerState, ServerTable, Success, Transient
from datagen.generation.http import ConnectFailedError, HttpError, HttpPool

logger = logging.getLogger(__name__)

# How often down and suspect servers are probed and liveness is polled: fast enough that a restarted
# server rejoins within a second or two, slow enough to cost nothing.
HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 5.0
# Opening a TCP connection to a live server on the same network takes milliseconds; ten seconds
# without one means the server is gone or wedged.
CONNECT_TIMEOUT_S = 10.0
# uvicorn (transformers serve, vLLM, SGLang) closes a connection idle for 5 s; closing ours first means
# we never send a request down a socket the server is about to close.
KEEPALIVE_IDLE_S = 4.0
# A suspect server whose /health neither answers nor refuses within this long is trusted again: SGLang's
# /health runs a generation behind the queue, so a busy server may be slow to answer without being ill.
SUSPECT_MAX_S = 10.0
# /health probes: one at a time per server (a probe is skipped while the last one runs); two connections
# leave room for the one closing.
HEALTH_POOL_SIZE = 2
# A server silent for this many times the slowest completion seen is stalled (module docstring).
STALL_FACTOR = 3.0
# The longest a stalled server is held out of rotation, however many stalls in a row.
STALL_HOLD_MAX_S = 600.0


class ServerHealth:
    """The fleet as the dispatcher sees it (see the module docstring).

    Args:
        table: The servers.
        admission: The waiting requests: told when a server becomes usable (fill its slots), asked whether
            requests wait, and told to fail them when no server was up for too long.
        generation: The request timeout (caps the connect timeout and the stall limit), the stall floor
            and the no-live-server deadline.
        health_path: The engine's readiness path.
        headers: Sent with every request (the API key).
        liveness: Optional check that a server's process is alive; False marks it down at once.
        vouch: Optional: the version of its host's word for a server (None: no host vouches for it, probes
            decide); a gone server is trusted again only once it changes (see the module docstring).

    """

    def __init__(
        self,
        table: ServerTable,
        admission: Admission,
        *,
        generation: GenerationConfig,
        health_path: str,
        headers: dict[str, str],
        liveness: Callable[[str], bool] | None,
        vouch: Callable[[str], int | None] | None = None,
    ) -> None:
        self.table = table
        self.servers = table.servers
        self.admission = admission
        self.generation = generation
        self.health_path = health_path
        self.headers = headers
        self.liveness = liveness
        self.vouch = vouch
        self.all_down_since: float | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # The slowest completion any server gave (seconds): the stall yardstick; None until the first.
        self.slowest_completion_s: float | None = None
        # The loop holds tasks only weakly: keep probe tasks referenced until they end.
        self.probes: set[asyncio.Task[None]] = set()

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Open every server's pools on ``loop`` (the dispatcher's) and start the no-live-server clock."""
        self.loop = loop
        for server in self.servers.values():
            self._open_pools(server)
        self.all_down_since = time.monotonic()

    def close(self) -> None:
        """Close every pool."""
        for server in self.servers.values():
            _close_pools(server)

    def _open_pools(self, server: ServerState) -> None:
        # One pool per server, sized to its cap: the dispatcher never has more in flight there, so the pool
        # never queues a request, and every slot keeps its own warm connection.
        server.pool = HttpPool(
            server.url,
            limit=server.cap,
            keepalive_idle_s=KEEPALIVE_IDLE_S,
            connect_timeout_s=min(CONNECT_TIMEOUT_S, self.generation.request_timeout_s),
            headers=self.headers,
        )
        server.health_pool = HttpPool(
            server.url,
            limit=HEALTH_POOL_SIZE,
            keepalive_idle_s=KEEPALIVE_IDLE_S,
            connect_timeout_s=HEALTH_TIMEOUT_S,
            headers=self.headers,
        )

    def add(self, url: str, cap: int) -> None:
        """Add a server; it takes requests once its ``/health`` answers 200."""
        server = self.table.add(url, cap)
        if server is None:
            return
        logger.info("server added url=%s max_inflight=%d", url, server.cap)
        if self.loop is not None and self.loop.is_running():
            self._open_pools(server)
            self.probe_soon(server)

    def remove(self, url: str) -> None:
        """Stop routing to a server; its in-flight tries are cut short without costing an attempt."""
        server = self.servers.get(url)
        if server is None:
            return
        self.mark_down(server, "removed", refund=True)
        self.table.remove(url)
        logger.info("server removed url=%s", url)
        _close_pools(server)

    def move(self, old_url: str, new_url: str) -> None:
        """The server at ``old_url`` now listens at ``new_url``: the same cap there, the old URL removed."""
        server = self.servers.get(old_url)
        if server is None:
            return
        self.remove(old_url)
        self.add(new_url, server.cap)

    def mark_up(self, server: ServerState) -> None:
        """``/health`` answered (or a suspect server was trusted again): give it requests."""
        if self.servers.get(server.url) is not server:
            return
        if server.up and server.suspect_since is None:
            return
        if server.suspect_since is not None:
            logger.info("server known good again url=%s", server.url)
        else:
            logger.info("server up url=%s", server.url)
        server.up = True
        server.suspect_since = None
        self.all_down_since = None
        self.admission.pump()

    def answered(self, server: ServerState, outcome: Outcome, now: float) -> None:
        """Record that ``server`` ended a try with ``outcome`` (the stall clock and its yardstick)."""
        if isinstance(outcome, Success):
            latency_s = outcome.record.latency_s
            if self.slowest_completion_s is None or latency_s > self.slowest_completion_s:
                self.slowest_completion_s = latency_s
            server.stalls = 0
        elif isinstance(outcome, Transient) and (outcome.timed_out or outcome.interrupted):
            # Silence, or a try the dispatcher cut short: the server said nothing.
            return
        server.last_answer_at = now

    def stall_limit_s(self) -> float | None:
        """How long a server holding requests may answer nothing before it is stalled; None: no yardstick yet."""
        slowest = self.slowest_completion_s
        if slowest is None:
            return None
        limit = max(self.generation.stall_min_s, STALL_FACTOR * slowest)
        return min(limit, self.generation.request_timeout_s)

    def mark_suspect(self, server: ServerState, reason: str) -> None:
        """A reset or connect timeout: no new request for this server until its /health answers."""
        if not server.up or server.suspect_since is not None:
            return
        server.suspect_since = time.monotonic()
        logger.warning(
            "server suspect url=%s in_flight=%d reason=%s", server.url, len(server.in_flight), reason
        )
        self.probe_soon(server)

    def mark_down(
        self, server: ServerState, reason: str, *, refund: bool = False, gone: bool = False
    ) -> None:
        """The server went away: cut its tries short (their requests are retried at once elsewhere).

        ``gone``: it refused a connection (nothing of ours listens there now); with ``vouch``, it waits for its
        host's word before it is probed again.
        """
        vouched = self.vouch(server.url) if gone and self.vouch is not None else None
        if vouched is not None and server.gone_at_vouch is None:
            server.gone_at_vouch = vouched
            logger.warning(
                "server gone url=%s: no request or probe goes there until its host says it restarted it "
                "(another program may take the port)",
                server.url,
            )
        if not server.up:
            return
        server.up = False
        server.suspect_since = None
        logger.warning("server down url=%s in_flight=%d reason=%s", server.url, len(server.in_flight), reason)
        for job in list(server.in_flight):
            if job.task is not None and not job.task.done():
                job.interrupted = f"server {server.url} went away: {reason}"
                job.refund = refund
                job.task.cancel()
        if not any(other.up for other in self.servers.values()) and self.all_down_since is None:
            self.all_down_since = time.monotonic()

    async def run(self) -> None:
        """The health loop (until cancelled)."""
        while True:
            try:
                await self._check_servers()
                self._expire_if_no_live_servers()
            except Exception:
                # The health loop is what brings servers back and enforces the no-live-server deadline:
                # it must outlive any single bad check.
                logger.exception("health check failed; retrying in %.1fs", HEALTH_INTERVAL_S)
            await asyncio.sleep(HEALTH_INTERVAL_S)

    def _awaits_vouch(self, server: ServerState) -> bool:
        """Gone, and its host has not vouched for it since (so nothing may reach its port)."""
        if server.gone_at_vouch is None or self.vouch is None:
            return False
        if self.vouch(server.url) == server.gone_at_vouch:
            return True
        server.gone_at_vouch = None
        logger.info("server vouched for by its host again url=%s", server.url)
        return False

    def _is_alive(self, url: str) -> bool:
        assert self.liveness is not None
        try:
            return self.liveness(url)
        except Exception:
            logger.exception("liveness check raised url=%s; treating the server as alive", url)
            return True

    async def _check_servers(self) -> None:
        servers = list(self.servers.values())
        if self.liveness is not None:
            alive = await asyncio.gather(*(asyncio.to_thread(self._is_alive, s.url) for s in servers))
        else:
            alive = [True] * len(servers)
        now = time.monotonic()
        stall_limit_s = self.stall_limit_s()
        probes = []
        for server, is_alive in zip(servers, alive, strict=True):
            if not is_alive:
                self.mark_down(server, "liveness check reports the process dead", gone=True)
            elif stall_limit_s is not None and self._stalled(server, now, stall_limit_s):
                continue
            elif server.suspect_since is not None and now - server.suspect_since >= SUSPECT_MAX_S:
                logger.warning(
                    "server suspect for %.0fs without a verdict; trusting it again url=%s",
                    SUSPECT_MAX_S,
                    server.url,
                )
                self.mark_up(server)
            elif self._needs_probe(server, now):
                probes.append(self._probe(server))
        await asyncio.gather(*probes)

    def _needs_probe(self, server: ServerState, now: float) -> bool:
        """Whether to probe ``server``: down or suspect, not being probed, not held out after a stall.

        Not either while it is gone without its host's word since (``vouch``).
        """
        waiting = not server.up or server.suspect_since is not None
        return waiting and not server.probing and now >= server.held_until and not self._awaits_vouch(server)

    def _stalled(self, server: ServerState, now: float, limit_s: float) -> bool:
        """Mark ``server`` down and hold it out when it held requests and answered nothing for ``limit_s``."""
        if not server.up or not server.in_flight:
            return False
        oldest_sent = min(job.sent_at for job in server.in_flight)
        silent_since = max(server.last_answer_at or oldest_sent, oldest_sent)
        silent_s = now - silent_since
        if silent_s < limit_s:
            return False
        server.stalls += 1
        hold_s = min(limit_s * 2 ** (server.stalls - 1), STALL_HOLD_MAX_S)
        server.held_until = now + hold_s
        logger.warning(
            "server stalled url=%s in_flight=%d silent_s=%.1f limit_s=%.1f slowest_completion_s=%.2f "
            "stalls=%d hold_s=%.0f: its requests go to other servers",
            server.url,
            len(server.in_flight),
            silent_s,
            limit_s,
            self.slowest_completion_s or 0.0,
            server.stalls,
            hold_s,
        )
        self.mark_down(server, f"stalled: no answer for {silent_s:.0f}s while holding requests")
        return True

    def probe_soon(self, server: ServerState) -> None:
        """Probe ``server``'s ``/health`` now, in the background (skipped while a probe runs)."""
        if server.probing:
            return
        assert self.loop is not None
        task = self.loop.create_task(self._probe(server))
        self.probes.add(task)
        task.add_done_callback(self.probes.discard)

    async def _probe(self, server: ServerState) -> None:
        """GET /health: 200 marks a down or suspect server up; a refused connection marks it down."""
        assert server.health_pool is not None
        server.probing = True
        try:
            response = await server.health_pool.request(
                "GET", self.health_path, b"", timeout_s=HEALTH_TIMEOUT_S
            )
            status = response.status
        except ConnectFailedError as error:
            self.mark_down(server, f"health probe refused: {describe(error)}", gone=True)
            return
        except HttpError:
            # A busy server may answer /health slowly (SGLang runs a generation there); not proof of death.
            return
        finally:
            server.probing = False
        if status == 200 and not self._awaits_vouch(server):
            self.mark_up(server)

    def _expire_if_no_live_servers(self) -> None:
        if any(server.up for server in self.servers.values()):
            self.all_down_since = None
            return
        now = time.monotonic()
        if self.all_down_since is None:
            self.all_down_since = now
            return
        waited_s = now - self.all_down_since
        if waited_s < self.generation.no_live_server_timeout_s or not self.admission.has_waiting():
            return
        self.admission.fail_waiting(
            f"no live servers for {waited_s:.0f}s (limit no_live_server_timeout_s="
            f"{self.generation.no_live_server_timeout_s:g}); servers: {', '.join(self.servers) or 'none'}"
        )


def _close_pools(server: ServerState) -> None:
    for pool in (server.pool, server.health_pool):
        if pool is not None:
            pool.close()
