"""The fleet-wide request dispatcher: one per flow process, shared by every running shard task.

Shard tasks run in different threads (Prefect's thread pool) and call :meth:`Dispatcher.submit` from
any of them. The dispatcher owns a background thread running an asyncio loop with one
``httpx.AsyncClient``; all scheduling state lives on that loop, so it needs no locks beyond the one
guarding start/stop against late submissions.

Scheduling: one FIFO queue for the whole fleet; each server holds at most ``max_inflight_per_server``
requests; the next request goes to the live server with the fewest outstanding requests. A slot is
refilled the moment any request finishes, whichever shard it belongs to, so there is no barrier
between shards and one slow request never idles the other slots.

Failures: transient errors (connection errors, resets, timeouts, 5xx, 408/409/429, an empty or invalid
body) are retried with exponential backoff and jitter, preferring another server, up to
``GenerationConfig.max_attempts`` tries; other 4xx answers are final. A server that refuses
connections, or that ``liveness`` reports dead, is marked down and its in-flight requests go back to
the head of the queue at the cost of one attempt each; a health checker marks it up again once
``GET /health`` answers, so restarted servers rejoin. When no server is up for
``GenerationConfig.no_live_server_timeout_s`` the waiting requests fail with "no live servers". Every
submitted future resolves, with a :class:`~datagen.records.CompletionRecord` or a
:class:`~datagen.records.FailureRecord`; it never raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict

from datagen.config import GenerationConfig
from datagen.generation.wire import (
    CHAT_COMPLETIONS_PATH,
    BadToolArgumentsError,
    GenerationRequest,
    UnusableResponseError,
    build_chat_payload,
    excerpt,
    parse_chat_completion,
)
from datagen.records import (
    CompletionRecord,
    FailureRecord,
)

logger = logging.getLogger(__name__)

GenerationResult = CompletionRecord | FailureRecord

HEALTH_PATH = "/health"
# How often down servers are probed and liveness is polled: fast enough that a restarted server
# rejoins within a second or two, slow enough to cost nothing.
HEALTH_INTERVAL_S = 1.0
HTTP_INTERNAL_ERROR = 500
HEALTH_TIMEOUT_S = 5.0
# Opening a TCP connection to a live server on the same network takes milliseconds; ten seconds
# without one means the server is gone or wedged.
CONNECT_TIMEOUT_S = 10.0
STATS_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 30.0
# 408 (timeout), 409 (conflict) and 429 (overloaded) are the 4xx answers a retry can cure.
RETRYABLE_4XX = frozenset({408, 409, 429})
# Backoff delays are drawn from [JITTER_FLOOR * delay, delay] so retries of a burst spread out.
JITTER_FLOOR = 0.5
# Sampling fields an engine refuses outright: `transformers serve` answers 422 to top_k and min_p.
UNSUPPORTED_FIELDS: dict[str, frozenset[str]] = {"transformers": frozenset({"top_k", "min_p"})}


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
        queued: Requests waiting for a slot.
        backing_off: Requests waiting out a retry delay.
        completed: Requests resolved with a completion.
        failed: Requests resolved with a failure record.
        retries: Extra tries made after transient errors or server loss.
        output_tokens: Completion tokens reported by the servers.
        tokens_per_s: Output tokens per second since the first request was dispatched.

    """

    model_config = ConfigDict(extra="forbid")

    servers: list[ServerStats]
    queued: int
    backing_off: int
    completed: int
    failed: int
    retries: int
    output_tokens: int
    tokens_per_s: float

    @property
    def in_flight(self) -> dict[str, int]:
        """Requests in flight per server URL."""
        return {server.url: server.in_flight for server in self.servers}

    @property
    def servers_up(self) -> list[str]:
        """URLs of the servers currently marked up."""
        return [server.url for server in self.servers if server.up]


@dataclass(eq=False)
class _Job:
    """One submitted request and its retry state; lives on the loop thread only."""

    request: GenerationRequest
    future: Future[GenerationResult]
    attempts: int = 0
    last_server: str | None = None
    task: asyncio.Task[None] | None = None
    timer: asyncio.TimerHandle | None = None
    # Set just before the dispatcher cancels this job's try, so the cancellation is told apart from
    # shutdown; `refund` gives the attempt back (a server removed on purpose is not the request's fault).
    interrupted: str | None = None
    refund: bool = False
    # Servers that answered this request with HTTP 500 (an internal error, as opposed to 502-504 which say
    # the server is busy or restarting): the same error from several servers is the request's own fault.
    internal_error_servers: list[str] = field(default_factory=list)


@dataclass(eq=False)
class _Server:
    url: str
    up: bool = False
    in_flight: set[_Job] = field(default_factory=set)
    dispatched: int = 0
    completed: int = 0
    probing: bool = False


@dataclass(frozen=True)
class _Success:
    record: CompletionRecord


@dataclass(frozen=True)
class _Final:
    reason: str
    error_type: str
    status: int | None = None


@dataclass(frozen=True)
class _Transient:
    reason: str
    status: int | None = None
    # server_down: the server refused the connection; suspect: a reset, worth a health probe.
    server_down: bool = False
    suspect: bool = False
    interrupted: bool = False


_Outcome = _Success | _Final | _Transient


class Dispatcher:
    """Send generation requests to a fleet of OpenAI-compatible servers, from any thread.

    Args:
        servers: Base URLs of the servers (``http://host:port``); each is used once ``GET /health``
            answers 200.
        model: The model name sent in every request.
        engine: The engine kind (recorded in completions; decides which sampling fields are sent).
        max_inflight_per_server: Requests kept in flight on each server.
        generation: Timeouts, retries and backoff.
        liveness: Optional check that a server's process is alive; a False answer marks it down at once.
        api_key: Sent as a bearer token when set.

    Example:
        >>> with Dispatcher(urls, model=m, engine="sglang", max_inflight_per_server=64,
        ...                 generation=config.generation) as dispatcher:  # doctest: +SKIP
        ...     record = dispatcher.submit(request).result()

    """

    def __init__(
        self,
        servers: list[str],
        *,
        model: str,
        engine: str,
        max_inflight_per_server: int,
        generation: GenerationConfig,
        liveness: Callable[[str], bool] | None = None,
        api_key: str | None = None,
    ) -> None:
        if max_inflight_per_server < 1:
            raise ValueError("max_inflight_per_server must be at least 1")
        self.model = model
        self.engine = engine
        self.max_inflight_per_server = max_inflight_per_server
        self.generation = generation
        self.liveness = liveness
        self._api_key = api_key
        self._servers: dict[str, _Server] = {}
        for url in servers:
            self._servers.setdefault(_normalise(url), _Server(_normalise(url)))
        self._queue: deque[_Job] = deque()
        self._jobs: set[_Job] = set()
        self._backing_off = 0
        self._completed = 0
        self._failed = 0
        self._retries = 0
        self._output_tokens = 0
        self._first_dispatch_at: float | None = None
        self._last_result_at: float | None = None
        self._all_down_since: float | None = None
        self._dropped_fields_logged = False
        self._lock = threading.Lock()
        self._state = "new"
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop_event: asyncio.Event | None = None
        self._client: httpx.AsyncClient | None = None
        self._health_client: httpx.AsyncClient | None = None
        self._final_stats: DispatcherStats | None = None
        # The loop holds tasks only weakly: keep probe tasks referenced until they end.
        self._probes: set[asyncio.Task[None]] = set()

    # --- lifecycle (any thread) -------------------------------------------------------------------

    def start(self) -> Dispatcher:
        """Start the background loop; returns self.

        Raises:
            RuntimeError: Already started or closed.

        """
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"Dispatcher cannot start: it is {self._state}")
            started = threading.Event()
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._thread_main, args=(started,), name="datagen-dispatcher", daemon=True
            )
            self._thread.start()
            if not started.wait(CLOSE_TIMEOUT_S):
                self._state = "closed"
                raise RuntimeError("Dispatcher loop did not start; see the log for the error")
            self._state = "running"
        logger.info(
            "dispatcher started servers=%d model=%s engine=%s max_inflight_per_server=%d",
            len(self._servers),
            self.model,
            self.engine,
            self.max_inflight_per_server,
        )
        return self

    def close(self) -> None:
        """Stop the loop. Requests still pending resolve as failures ("dispatcher closed")."""
        with self._lock:
            if self._state != "running":
                self._state = "closed"
                return
            self._state = "closed"
            assert self._loop is not None and self._stop_event is not None
            # Queued after every submit that got the lock before us, so those jobs are known at shutdown.
            self._loop.call_soon_threadsafe(self._stop_event.set)
        assert self._thread is not None
        self._thread.join(CLOSE_TIMEOUT_S)
        stats = self._final_stats
        if stats is not None:
            logger.info(
                "dispatcher closed completed=%d failed=%d retries=%d output_tokens=%d tokens_per_s=%.1f",
                stats.completed,
                stats.failed,
                stats.retries,
                stats.output_tokens,
                stats.tokens_per_s,
            )

    def __enter__(self) -> Dispatcher:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- public API (any thread) ------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        """Queue one request.

        Args:
            request: What to generate.

        Returns:
            A future that always resolves with a CompletionRecord or a FailureRecord.

        Raises:
            RuntimeError: The dispatcher is not running (call start() or use it as a context manager).

        """
        future: Future[GenerationResult] = Future()
        job = _Job(request=request, future=future)
        with self._lock:
            if self._state != "running":
                raise RuntimeError(
                    f"Dispatcher is {self._state}: call start() (or use `with Dispatcher(...)`) "
                    "before submit()"
                )
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._enqueue, job)
        return future

    def add_server(self, url: str) -> None:
        """Add a server; it takes requests once its ``/health`` answers 200."""
        self._call_on_loop(self._add_server, _normalise(url))

    def remove_server(self, url: str) -> None:
        """Stop routing to a server; its in-flight requests go back to the queue without losing an attempt."""
        self._call_on_loop(self._remove_server, _normalise(url))

    def stats(self) -> DispatcherStats:
        """A snapshot of queue, in-flight and throughput counters."""
        with self._lock:
            loop = self._loop if self._state == "running" else None
        if loop is None:
            return self._final_stats or self._snapshot()
        if threading.current_thread() is self._thread:
            # A future's done-callback runs on the loop: waiting on the loop from there would deadlock.
            return self._snapshot()
        return asyncio.run_coroutine_threadsafe(self._snapshot_async(), loop).result(STATS_TIMEOUT_S)

    def _call_on_loop(self, function: Callable[[str], None], url: str) -> None:
        with self._lock:
            if self._state == "running":
                assert self._loop is not None
                self._loop.call_soon_threadsafe(function, url)
                return
            if self._state == "new":
                function(url)

    # --- the loop ---------------------------------------------------------------------------------

    def _thread_main(self, started: threading.Event) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main(started))
        finally:
            self._loop.close()

    async def _main(self, started: threading.Event) -> None:
        self._stop_event = asyncio.Event()
        timeout = httpx.Timeout(
            self.generation.request_timeout_s,
            connect=min(CONNECT_TIMEOUT_S, self.generation.request_timeout_s),
        )
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        # The dispatcher enforces the per-server caps itself; the pool must never be the bottleneck.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers)
        self._health_client = httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S, headers=headers)
        self._all_down_since = time.monotonic()
        health_task = asyncio.create_task(self._health_loop())
        started.set()
        try:
            await self._stop_event.wait()
        finally:
            self._closing = True
            health_task.cancel()
            tasks = [job.task for job in self._jobs if job.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(health_task, *tasks, return_exceptions=True)
            for job in list(self._jobs):
                if job.timer is not None:
                    job.timer.cancel()
                self._fail(job, "dispatcher closed before the request finished", "dispatcher_closed", None)
            self._queue.clear()
            self._backing_off = 0
            await self._client.aclose()
            await self._health_client.aclose()
            self._final_stats = self._snapshot()

    def _enqueue(self, job: _Job) -> None:
        if self._closing:
            self._fail(job, "dispatcher closed before the request was sent", "dispatcher_closed", None)
            return
        self._jobs.add(job)
        self._queue.append(job)
        self._pump()

    def _pump(self) -> None:
        """Fill free slots from the head of the queue."""
        assert self._loop is not None
        while self._queue and not self._closing:
            job = self._queue[0]
            if job.future.cancelled():
                self._queue.popleft()
                self._jobs.discard(job)
                continue
            server = self._pick_server(job)
            if server is None:
                return
            self._queue.popleft()
            server.in_flight.add(job)
            server.dispatched += 1
            if self._first_dispatch_at is None:
                self._first_dispatch_at = time.monotonic()
            job.task = self._loop.create_task(self._run(job, server))

    def _pick_server(self, job: _Job) -> _Server | None:
        """The live server with a free slot and the fewest outstanding requests, not the last one tried."""
        candidates = [
            server
            for server in self._servers.values()
            if server.up and len(server.in_flight) < self.max_inflight_per_server
        ]
        if job.last_server is not None:
            elsewhere = [server for server in candidates if server.url != job.last_server]
            candidates = elsewhere or candidates
        if not candidates:
            return None
        return min(candidates, key=lambda server: (len(server.in_flight), server.dispatched))

    async def _run(self, job: _Job, server: _Server) -> None:
        job.attempts += 1
        job.last_server = server.url
        started = time.monotonic()
        try:
            outcome = await self._try(job, server, started)
        except asyncio.CancelledError:
            if job.interrupted is None:
                raise
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            outcome = _Transient(reason=job.interrupted, interrupted=True)
            if job.refund:
                job.attempts -= 1
            job.interrupted = None
            job.refund = False
        finally:
            server.in_flight.discard(job)
            job.task = None
        self._settle(job, server, outcome)
        self._pump()

    async def _try(self, job: _Job, server: _Server, started: float) -> _Outcome:
        """One HTTP try, classified; never raises except on cancellation."""
        assert self._client is not None
        payload = self._payload(job.request)
        try:
            response = await self._client.post(server.url + CHAT_COMPLETIONS_PATH, json=payload)
        except httpx.ConnectError as error:
            return _Transient(reason=f"connection refused: {_describe(error)}", server_down=True)
        except httpx.TimeoutException as error:
            connect = isinstance(error, httpx.ConnectTimeout)
            return _Transient(reason=f"{type(error).__name__}: {_describe(error)}", suspect=connect)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as error:
            return _Transient(reason=f"connection reset: {_describe(error)}", suspect=True)
        except httpx.HTTPError as error:
            return _Transient(reason=f"{type(error).__name__}: {_describe(error)}")
        latency_s = time.monotonic() - started
        status = response.status_code
        if status >= 500 or status in RETRYABLE_4XX:
            return _Transient(reason=f"HTTP {status}: {excerpt(response.text)}", status=status)
        if status != 200:
            return _Final(
                reason=f"HTTP {status}: {excerpt(response.text)}", error_type=f"http_{status}", status=status
            )
        try:
            data = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            kind = (
                "empty body"
                if not response.content.strip()
                else f"invalid JSON body: {excerpt(response.text)}"
            )
            return _Transient(reason=f"HTTP 200 with {kind}", status=status)
        try:
            completion, finish_reason, usage = parse_chat_completion(data)
        except UnusableResponseError as error:
            return _Transient(reason=f"HTTP 200 with unusable completion: {error}", status=status)
        except BadToolArgumentsError as error:
            return _Final(reason=str(error), error_type="invalid_tool_arguments", status=status)
        request = job.request
        record = CompletionRecord(
            prompt_id=request.prompt.prompt_id,
            sample_index=request.sample_index,
            dataset=request.dataset,
            messages=request.prompt.messages,
            tools=request.prompt.tools,
            completion=completion,
            finish_reason=finish_reason,
            usage=usage,
            model=self.model,
            engine=self.engine,
            server=server.url,
            sampling=request.sampling,
            attempts=job.attempts,
            latency_s=latency_s,
        )
        return _Success(record)

    def _settle(self, job: _Job, server: _Server, outcome: _Outcome) -> None:
        """Resolve, retry or fail one job after a try."""
        if isinstance(outcome, _Success):
            server.completed += 1
            self._completed += 1
            self._output_tokens += outcome.record.usage.completion_tokens
            self._last_result_at = time.monotonic()
            self._resolve(job, outcome.record)
            return
        if isinstance(outcome, _Final):
            self._fail(job, outcome.reason, outcome.error_type, outcome.status, server.url)
            return
        if outcome.server_down:
            self._mark_down(server, outcome.reason)
        elif outcome.suspect:
            self._probe_soon(server)
        if outcome.status == HTTP_INTERNAL_ERROR:
            job.internal_error_servers.append(server.url)
            repeated = len(job.internal_error_servers) >= self.generation.max_internal_error_attempts
            distinct = len(set(job.internal_error_servers))
            cut_short = job.attempts < self.generation.max_attempts
            if repeated and cut_short and distinct >= min(2, len(self._servers)):
                # A whole generation is redone on every try: stop paying for an answer the servers cannot give.
                self._fail(
                    job,
                    f"HTTP 500 from {distinct} server(s) on each of "
                    f"{len(job.internal_error_servers)} attempts; last error: {outcome.reason}",
                    "repeated_internal_error",
                    outcome.status,
                    server.url,
                )
                return
        if job.attempts >= self.generation.max_attempts:
            self._fail(
                job,
                f"retries exhausted after {job.attempts} attempts; last error: {outcome.reason}",
                "retries_exhausted",
                outcome.status,
                server.url,
            )
            return
        self._retries += 1
        delay_s = 0.0 if outcome.interrupted else self._backoff_s(job.attempts)
        logger.warning(
            "retry key=%s attempt=%d max_attempts=%d server=%s status=%s delay_s=%.2f reason=%s",
            job.request.key,
            job.attempts,
            self.generation.max_attempts,
            server.url,
            outcome.status,
            delay_s,
            outcome.reason,
        )
        assert self._loop is not None
        self._backing_off += 1
        job.timer = self._loop.call_later(delay_s, self._requeue, job)

    def _requeue(self, job: _Job) -> None:
        job.timer = None
        self._backing_off -= 1
        if self._closing or job not in self._jobs:
            return
        # Retries go to the head: a request that already waited should not wait behind the whole fleet.
        self._queue.appendleft(job)
        self._pump()

    def _backoff_s(self, attempts: int) -> float:
        ceiling = min(self.generation.backoff_max_s, self.generation.backoff_initial_s * 2 ** (attempts - 1))
        return random.uniform(JITTER_FLOOR * ceiling, ceiling)

    def _resolve(self, job: _Job, result: GenerationResult) -> None:
        self._jobs.discard(job)
        with contextlib.suppress(InvalidStateError):
            job.future.set_result(result)

    def _fail(
        self, job: _Job, reason: str, error_type: str, status: int | None, server: str | None = None
    ) -> None:
        self._failed += 1
        self._last_result_at = time.monotonic()
        request = job.request
        record = FailureRecord(
            prompt_id=request.prompt.prompt_id,
            sample_index=request.sample_index,
            dataset=request.dataset,
            reason=reason,
            error_type=error_type,
            attempts=job.attempts,
            last_status=status,
            server=server or job.last_server,
        )
        logger.warning(
            "request failed key=%s error_type=%s attempts=%d reason=%s",
            request.key,
            error_type,
            job.attempts,
            reason,
        )
        self._resolve(job, record)

    # --- server state -----------------------------------------------------------------------------

    def _mark_up(self, server: _Server) -> None:
        if server.up or self._servers.get(server.url) is not server:
            return
        server.up = True
        self._all_down_since = None
        logger.info("server up url=%s", server.url)
        self._pump()

    def _mark_down(self, server: _Server, reason: str, *, refund: bool = False) -> None:
        if not server.up:
            return
        server.up = False
        logger.warning("server down url=%s in_flight=%d reason=%s", server.url, len(server.in_flight), reason)
        for job in list(server.in_flight):
            if job.task is not None and not job.task.done():
                job.interrupted = f"server {server.url} went away: {reason}"
                job.refund = refund
                job.task.cancel()
        if not any(other.up for other in self._servers.values()) and self._all_down_since is None:
            self._all_down_since = time.monotonic()

    def _add_server(self, url: str) -> None:
        if url in self._servers:
            return
        server = _Server(url)
        self._servers[url] = server
        logger.info("server added url=%s", url)
        if self._loop is not None and self._loop.is_running():
            self._probe_soon(server, mark_up=True)

    def _remove_server(self, url: str) -> None:
        server = self._servers.get(url)
        if server is None:
            return
        self._mark_down(server, "removed", refund=True)
        del self._servers[url]
        logger.info("server removed url=%s", url)

    async def _health_loop(self) -> None:
        while True:
            try:
                await self._check_servers()
                self._expire_if_no_live_servers()
            except Exception:
                # The health loop is what brings servers back and enforces the no-live-server deadline:
                # it must outlive any single bad check.
                logger.exception("health check failed; retrying in %.1fs", HEALTH_INTERVAL_S)
            await asyncio.sleep(HEALTH_INTERVAL_S)

    def _is_alive(self, url: str) -> bool:
        assert self.liveness is not None
        try:
            return self.liveness(url)
        except Exception:
            logger.exception("liveness check raised url=%s; treating the server as alive", url)
            return True

    async def _check_servers(self) -> None:
        servers = list(self._servers.values())
        if self.liveness is not None:
            alive = await asyncio.gather(*(asyncio.to_thread(self._is_alive, s.url) for s in servers))
        else:
            alive = [True] * len(servers)
        probes = []
        for server, is_alive in zip(servers, alive, strict=True):
            if not is_alive:
                self._mark_down(server, "liveness check reports the process dead")
            elif not server.up and not server.probing:
                probes.append(self._probe(server, mark_up=True))
        await asyncio.gather(*probes)

    def _probe_soon(self, server: _Server, *, mark_up: bool = False) -> None:
        if server.probing:
            return
        assert self._loop is not None
        task = self._loop.create_task(self._probe(server, mark_up=mark_up))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, server: _Server, *, mark_up: bool) -> None:
        """GET /health: 200 marks a down server up; a refused connection marks an up server down."""
        assert self._health_client is not None
        server.probing = True
        try:
            response = await self._health_client.get(server.url + HEALTH_PATH)
        except httpx.ConnectError as error:
            self._mark_down(server, f"health probe refused: {_describe(error)}")
            return
        except httpx.HTTPError:
            # A busy server may answer /health slowly (SGLang runs a generation there); not proof of death.
            return
        finally:
            server.probing = False
        if response.status_code == 200 and mark_up:
            self._mark_up(server)

    def _expire_if_no_live_servers(self) -> None:
        if any(server.up for server in self._servers.values()):
            self._all_down_since = None
            return
        now = time.monotonic()
        if self._all_down_since is None:
            self._all_down_since = now
            return
        waited_s = now - self._all_down_since
        if waited_s < self.generation.no_live_server_timeout_s or not self._queue:
            return
        reason = (
            f"no live servers for {waited_s:.0f}s (limit no_live_server_timeout_s="
            f"{self.generation.no_live_server_timeout_s:g}); servers: {', '.join(self._servers) or 'none'}"
        )
        while self._queue:
            self._fail(self._queue.popleft(), reason, "no_live_servers", None)

    # --- requests and stats -----------------------------------------------------------------------

    def _payload(self, request: GenerationRequest) -> dict[str, Any]:
        payload = build_chat_payload(request, self.model)
        dropped = sorted(UNSUPPORTED_FIELDS.get(self.engine, frozenset()) & payload.keys())
        for name in dropped:
            del payload[name]
        if dropped and not self._dropped_fields_logged:
            self._dropped_fields_logged = True
            logger.warning("sampling fields not sent engine=%s fields=%s", self.engine, ",".join(dropped))
        return payload

    async def _snapshot_async(self) -> DispatcherStats:
        return self._snapshot()

    def _snapshot(self) -> DispatcherStats:
        elapsed_s = 0.0
        if self._first_dispatch_at is not None:
            end = time.monotonic() if self._jobs else (self._last_result_at or time.monotonic())
            elapsed_s = max(end - self._first_dispatch_at, 0.0)
        return DispatcherStats(
            servers=[
                ServerStats(
                    url=s.url,
                    up=s.up,
                    in_flight=len(s.in_flight),
                    dispatched=s.dispatched,
                    completed=s.completed,
                )
                for s in self._servers.values()
            ],
            queued=len(self._queue),
            backing_off=self._backing_off,
            completed=self._completed,
            failed=self._failed,
            retries=self._retries,
            output_tokens=self._output_tokens,
            tokens_per_s=self._output_tokens / elapsed_s if elapsed_s > 0 else 0.0,
        )


def _normalise(url: str) -> str:
    return url.rstrip("/")


def _describe(error: BaseException) -> str:
    return str(error) or type(error).__name__
