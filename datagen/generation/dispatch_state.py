"""The dispatcher's state and what it reports: streams of requests, admitted jobs, servers, try outcomes.

Everything here is data; :mod:`datagen.generation.dispatcher` owns the loop that changes it. ``Job`` and
``ServerState`` live on the dispatcher's loop thread only; the stats models are the snapshots other threads
read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

from datagen.generation.failures import FailureKind
from datagen.generation.http import HttpPool
from datagen.generation.openai_chat import GenerationRequest
from datagen.records import CompletionRecord, FailureRecord

GenerationResult = CompletionRecord | FailureRecord
ResultCallback = Callable[[GenerationRequest, GenerationResult], None]
# Given a request's result, the request that follows it in the same stream (an on-policy conversation's next
# turn), or None.
FollowCallback = Callable[[GenerationRequest, GenerationResult], GenerationRequest | None]


class ServerStats(BaseModel):
    """The dispatcher's view of one server."""

    model_config = ConfigDict(extra="forbid")

    url: str
    up: bool
    in_flight: int
    dispatched: int
    completed: int


class DispatcherStats(BaseModel):
    """A snapshot of the dispatcher's counters.

    Attributes:
        servers: Per-server state, in the order servers were added.
        backlog: Requests registered by streams and not admitted yet.
        queued: Admitted requests waiting for a slot.
        backing_off: Requests waiting out a retry delay.
        dispatched: HTTP tries started (first tries and retries).
        completed: Requests resolved with a completion.
        failed: Requests that failed (their failure is a result: stored, counted in the report).
        unfinished: Requests that ended unserved (no live server, the dispatcher closed, admission stopped):
            never stored; their shards send them again.
        retries: Extra tries made after transient errors or server loss.
        output_tokens: Completion tokens reported by the servers.
        tokens_per_s: Output tokens per second while the dispatcher was busy (first request sent to last
            answer): the fleet's rate; a run's throughput counts the whole generation wall time instead
            (:mod:`datagen.progress`).
        requests_per_s: Resolved requests per second since the first request was dispatched.

    """

    model_config = ConfigDict(extra="forbid")

    servers: list[ServerStats]
    backlog: int = 0
    queued: int
    backing_off: int
    dispatched: int = 0
    completed: int
    failed: int
    unfinished: int = 0
    retries: int
    output_tokens: int
    tokens_per_s: float
    requests_per_s: float = 0.0

    @property
    def in_flight(self) -> dict[str, int]:
        """Requests in flight per server URL."""
        return {server.url: server.in_flight for server in self.servers}

    @property
    def servers_up(self) -> list[str]:
        """URLs of the servers currently marked up."""
        return [server.url for server in self.servers if server.up]


class RequestStream:
    """A handle on requests registered with :meth:`Dispatcher.submit_stream`.

    Every request of a stream resolves exactly once through the stream's callback, unless the stream is
    cancelled first. A stream with a ``follow`` grows as it goes: the request ``follow`` returns for a result is
    admitted at once, ahead of every backlog (a conversation's next turn).
    """

    def __init__(
        self,
        requests: Iterable[GenerationRequest],
        deliver: ResultCallback,
        size: int,
        follow: FollowCallback | None = None,
    ) -> None:
        self._requests: Iterator[GenerationRequest] = iter(requests)
        self.deliver = deliver
        self.follow = follow
        self.pending = size
        self.cancelled = False

    def cancel(self) -> None:
        """Drop the stream's requests that are not in flight yet; results of the others are discarded."""
        self.cancelled = True

    def take(self) -> GenerationRequest | None:
        """The next request not admitted yet (loop thread only)."""
        request = next(self._requests, None)
        if request is not None:
            self.pending -= 1
        return request


@dataclass(eq=False)
class Job:
    """One admitted request and its retry state; lives on the loop thread only."""

    request: GenerationRequest
    stream: RequestStream
    attempts: int = 0
    last_server: str | None = None
    task: asyncio.Task[None] | None = None
    timer: asyncio.TimerHandle | None = None
    # Set just before the dispatcher cancels this job's try, so the cancellation is told apart from
    # shutdown; `refund` gives the attempt back (a server removed on purpose is not the request's fault).
    interrupted: str | None = None
    refund: bool = False
    # Servers whose try of this request ended in HTTP 500 (an internal error, as opposed to 502-504 which
    # say the server is busy or restarting) or a connection reset (the server died under it): the same
    # error from several servers is the request's own fault.
    internal_error_servers: list[str] = field(default_factory=list)
    # When the current try was sent (monotonic): how long its server has had work without answering.
    sent_at: float = 0.0


@dataclass(eq=False)
class ServerState:
    """One server as the dispatcher sees it; lives on the loop thread only."""

    url: str
    # Requests kept in flight here: the run's default, or what the server's host planned (multi-host).
    cap: int = 1
    up: bool = False
    # A reset or a connect timeout: no new request until /health answers (or SUSPECT_MAX_S passes).
    suspect_since: float | None = None
    in_flight: set[Job] = field(default_factory=set)
    dispatched: int = 0
    completed: int = 0
    probing: bool = False
    # When the server last answered anything (monotonic; a response of any status, a reset, a refusal):
    # a server holding requests that answers nothing for far longer than any answer took is stalled.
    last_answer_at: float | None = None
    # Stalls in a row (an answer resets it) and when a stalled server may be probed again.
    stalls: int = 0
    held_until: float = 0.0
    # With a vouch (multi-host): its host's word for it when it refused a connection, until the word changes.
    gone_at_vouch: int | None = None
    # Generation requests, sized to the in-flight cap; and a separate small pool for /health probes,
    # so a probe never waits behind (or takes) a generation slot.
    pool: HttpPool | None = None
    health_pool: HttpPool | None = None

    @property
    def usable(self) -> bool:
        """Up and not suspect: may be given new requests."""
        return self.up and self.suspect_since is None


@dataclass(frozen=True)
class Success:
    """A try that produced a completion."""

    record: CompletionRecord


@dataclass(frozen=True)
class Final:
    """A try whose failure no retry can cure (the request fails with ``kind``)."""

    reason: str
    kind: FailureKind
    status: int | None = None


@dataclass(frozen=True)
class Transient:
    """A try that failed in a way a retry may cure."""

    reason: str
    status: int | None = None
    # server_down: the server refused the connection; suspect: a reset, worth a health probe.
    server_down: bool = False
    suspect: bool = False
    interrupted: bool = False
    # reset: the connection broke before the whole answer (counts toward max_internal_error_attempts);
    # timed_out: no answer within the request timeout (the server said nothing).
    reset: bool = False
    timed_out: bool = False


class ServerTable:
    """The servers by URL and the sum of their caps: what admission and health both read.

    Args:
        urls: The first servers (normalised base URLs), each kept at ``cap`` requests in flight.
        cap: Their in-flight cap.

    """

    def __init__(self, urls: list[str], cap: int) -> None:
        self.servers: dict[str, ServerState] = {}
        # Sum of the servers' caps, kept as servers come and go (read from any thread).
        self.slots = 0
        for url in urls:
            self.add(url, cap)

    def add(self, url: str, cap: int) -> ServerState | None:
        """Add a server; None when ``url`` is already in the table."""
        if url in self.servers:
            return None
        server = self.servers[url] = ServerState(url, cap=cap)
        self.slots += server.cap
        return server

    def remove(self, url: str) -> ServerState | None:
        """Take a server out of the table; None when it was not in it."""
        server = self.servers.pop(url, None)
        if server is not None:
            self.slots -= server.cap
        return server


Outcome = Success | Final | Transient
