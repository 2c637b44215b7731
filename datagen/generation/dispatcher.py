"""The fleet-wide request dispatcher: one per flow process, shared by every running shard task.

Shard tasks run in different threads (Prefect's thread pool) and hand their requests over from any of
them: :meth:`Dispatcher.submit_stream` registers a shard's whole list of requests at once (results come
back through a callback), :meth:`Dispatcher.submit` one request (a future comes back). The dispatcher
owns a background thread running an asyncio loop; all scheduling state lives on that loop.

How work flows (see docs/architecture.md, "Generation: from shards to servers and back"):

* Streams: every registered stream is a backlog the dispatcher pulls from, oldest stream first. Only
  ``admission_limit`` requests (a few times the fleet's total slots) are admitted at once, whichever
  shards they come from; a request is admitted the moment another one resolves. So the fleet never
  waits for a whole shard, a shard finishing late never starves it, and memory and per-request
  bookkeeping stay bounded by requests, not by shards.
* Slots: admitted requests wait in one FIFO queue; each server holds at most
  ``max_inflight_per_server``; the next request goes to the live server with the fewest outstanding
  requests. When a request finishes, its server's slot is refilled at once (O(1): while requests wait,
  no other server has a free slot), so a wave of many slots freeing together is refilled in one pass.
* HTTP: one keep-alive pool per server (:mod:`datagen.generation.http`, a plain asyncio protocol with
  httptools' parser), at most that server's in-flight cap busy: connections are reused, the pool never
  queues, and a request costs a few microseconds of bookkeeping whatever the fleet's size (measured:
  ~0.06 ms of CPU per request, against ~0.4 ms for aiohttp's ``ClientSession`` and ~2 ms for httpx, whose
  ``AsyncConnectionPool`` scans every connection for every request).

Failures: transient errors (connection errors, resets, timeouts, 5xx, 408/409/429, an empty or invalid
body) are retried with exponential backoff and jitter, preferring another server, up to
``GenerationConfig.max_attempts`` tries; other 4xx answers are final. A reset or a connect timeout makes
the server suspect: it takes no new request until ``GET /health`` answers (then it is known good again)
or refuses (then it is down). A server that refuses connections, or that ``liveness`` reports dead, is
marked down and its in-flight requests go back to the head of the queue at the cost of one attempt
each; the health checker marks it up again once ``/health`` answers, so restarted servers rejoin. When
no server is up for ``GenerationConfig.no_live_server_timeout_s`` the waiting requests fail with "no
live servers". Every request resolves exactly once, with a :class:`~datagen.records.CompletionRecord`
or a :class:`~datagen.records.FailureRecord`; a retried request that a server may already have answered
(a reset after the server finished) still yields one record, never two.

:meth:`Dispatcher.stats` reads plain counters from the calling thread: it never waits for the loop, so
a saturated dispatcher cannot make a progress read fail or stall.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from types import TracebackType
from typing import Any

import orjson

from datagen.config import GenerationConfig
from datagen.engines import engine_class
from datagen.generation.dispatch_state import (
    DispatcherStats,
    Final,
    GenerationResult,
    Job,
    Outcome,
    RequestStream,
    ResultCallback,
    ServerState,
    ServerStats,
    Success,
    Transient,
)
from datagen.generation.generate_api import (
    GENERATE_PATH,
    build_request_payload,
    generate_field_names,
    parse_generate_completion,
    require_prompt_tokens,
)
from datagen.generation.http import (
    ConnectFailedError,
    ConnectionBrokenError,
    ConnectTimeoutError,
    HttpError,
    HttpPool,
    MalformedResponseError,
    new_event_loop,
)
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
    utc_now,
)

logger = logging.getLogger(__name__)


# How often down and suspect servers are probed and liveness is polled: fast enough that a restarted
# server rejoins within a second or two, slow enough to cost nothing.
HEALTH_INTERVAL_S = 1.0
HTTP_INTERNAL_ERROR = 500
HEALTH_TIMEOUT_S = 5.0
# Opening a TCP connection to a live server on the same network takes milliseconds; ten seconds
# without one means the server is gone or wedged.
CONNECT_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 30.0
# uvicorn (transformers serve, vLLM, SGLang) closes a connection idle for 5 s; closing ours first means
# we never send a request down a socket the server is about to close.
KEEPALIVE_IDLE_S = 4.0
# 408 (timeout), 409 (conflict) and 429 (overloaded) are the 4xx answers a retry can cure.
RETRYABLE_4XX = frozenset({408, 409, 429})
# Backoff delays are drawn from [JITTER_FLOOR * delay, delay] so retries of a burst spread out.
JITTER_FLOOR = 0.5
# Requests admitted at once (queued + in flight + backing off), as a multiple of the fleet's slots:
# enough queued work to refill every slot of a lockstep wave twice over, small enough that a shard's
# requests are not all pulled into memory-resident jobs at once.
ADMISSION_SLOTS_FACTOR = 3
# ...and never fewer than this, so a small fleet still has a queue to refill from.
ADMISSION_MIN_REQUESTS = 256
# A suspect server whose /health neither answers nor refuses within this long is trusted again: SGLang's
# /health runs a generation behind the queue, so a busy server may be slow to answer without being ill.
SUSPECT_MAX_S = 10.0
# Requests pulled from streams per admission pass, so one huge backlog cannot hold the loop for long.
ADMIT_BATCH = 512
# /health probes: one at a time per server (a probe is skipped while the last one runs); two connections
# leave room for the one closing.
HEALTH_POOL_SIZE = 2
# The loop thread gives up the GIL on every socket operation; with Python's default 5 ms switch interval
# it then waits up to 5 ms behind any busy thread of the flow process (shard tasks writing parts, Prefect's
# engine) before it may read the next answer: at a thousand requests per second that convoy, not the
# network, would set the pace (measured: the first wave of a run took seconds to reach the servers).
# A shorter interval hands the GIL back sooner (process-wide; harmless here).
GIL_SWITCH_INTERVAL_S = 0.0005


class Dispatcher:
    """Send generation requests to a fleet of OpenAI-compatible servers, from any thread.

    Args:
        servers: Base URLs of the servers (``http://host:port``); each is used once ``GET /health``
            answers 200.
        model: The model name sent in every request.
        engine: The engine kind (recorded in completions; decides which sampling fields are sent).
        max_inflight_per_server: Requests kept in flight on each server (also its connection pool size).
        generation: Timeouts, retries and backoff.
        liveness: Optional check that a server's process is alive; a False answer marks it down at once.
        api_key: Sent as a bearer token when set.
        admission_limit: Requests admitted at once across all streams; by default
            ``ADMISSION_SLOTS_FACTOR`` times the fleet's slots (at least ``ADMISSION_MIN_REQUESTS``).
        exact_tokens: Send SGLang ``/generate`` requests (the prompt's token ids, which every request must carry)
            and keep the answers' ``output_ids``, instead of OpenAI chat completions.

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
        admission_limit: int | None = None,
        exact_tokens: bool = False,
    ) -> None:
        if max_inflight_per_server < 1:
            raise ValueError("max_inflight_per_server must be at least 1")
        self.model = model
        self.engine = engine
        self.max_inflight_per_server = max_inflight_per_server
        self.generation = generation
        self.liveness = liveness
        self._api_key = api_key
        self._fixed_admission_limit = admission_limit
        self._servers: dict[str, ServerState] = {}
        for url in servers:
            self._servers.setdefault(
                _normalise(url), ServerState(_normalise(url), cap=max_inflight_per_server)
            )
        # Sum of the servers' caps, kept as servers come and go (read from any thread).
        self._slots = sum(server.cap for server in self._servers.values())
        self._streams: deque[RequestStream] = deque()
        self._queue: deque[Job] = deque()
        # Jobs waiting out a retry delay (their timer holds them otherwise).
        self._retry_jobs: set[Job] = set()
        self._admitted = 0
        self._backlog = 0
        self._backing_off = 0
        self._dispatched = 0
        self._completed = 0
        self._failed = 0
        self._retries = 0
        self._output_tokens = 0
        self._first_dispatch_at: float | None = None
        self._last_result_at: float | None = None
        self._all_down_since: float | None = None
        self._engine_rules = engine_class(engine)
        self._dropped_fields = self._engine_rules.unsupported_sampling_fields
        # Exact-token mode: the prompt's ids to /generate, its output ids back; otherwise chat completions.
        self.exact_tokens = exact_tokens
        self._generation_path = GENERATE_PATH if exact_tokens else CHAT_COMPLETIONS_PATH
        if exact_tokens:
            self._dropped_fields = generate_field_names(self._dropped_fields)
        self._dropped_fields_logged = False
        self._lock = threading.Lock()
        self._state = "new"
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop_event: asyncio.Event | None = None
        self._final_stats: DispatcherStats | None = None
        # The loop holds tasks only weakly: keep probe tasks referenced until they end.
        self._probes: set[asyncio.Task[None]] = set()

    @property
    def admission_limit(self) -> int:
        """Requests admitted at once (queued, in flight or backing off), across every stream."""
        if self._fixed_admission_limit is not None:
            return self._fixed_admission_limit
        return max(ADMISSION_MIN_REQUESTS, ADMISSION_SLOTS_FACTOR * self._slots)

    # --- lifecycle (any thread) -------------------------------------------------------------------

    def start(self) -> Dispatcher:
        """Start the background loop; returns self.

        Raises:
            RuntimeError: Already started or closed.

        """
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"Dispatcher cannot start: it is {self._state}")
            if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
                sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
            started = threading.Event()
            self._loop = new_event_loop()
            self._thread = threading.Thread(
                target=self._thread_main, args=(started,), name="datagen-dispatcher", daemon=True
            )
            self._thread.start()
            if not started.wait(CLOSE_TIMEOUT_S):
                self._state = "closed"
                raise RuntimeError("Dispatcher loop did not start; see the log for the error")
            self._state = "running"
        logger.info(
            "dispatcher started servers=%d model=%s engine=%s max_inflight_per_server=%d admission_limit=%d "
            "exact_tokens=%s",
            len(self._servers),
            self.model,
            self.engine,
            self.max_inflight_per_server,
            self.admission_limit,
            self.exact_tokens,
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
            # Queued after every submit that got the lock before us, so those streams are known at shutdown.
            self._loop.call_soon_threadsafe(self._stop_event.set)
        assert self._thread is not None
        self._thread.join(CLOSE_TIMEOUT_S)
        stats = self._final_stats
        if stats is not None:
            logger.info(
                "dispatcher closed completed=%d failed=%d retries=%d output_tokens=%d tokens_per_s=%.1f "
                "requests_per_s=%.1f",
                stats.completed,
                stats.failed,
                stats.retries,
                stats.output_tokens,
                stats.tokens_per_s,
                stats.requests_per_s,
            )

    def __enter__(self) -> Dispatcher:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- public API (any thread) ------------------------------------------------------------------

    def submit_stream(self, requests: list[GenerationRequest], deliver: ResultCallback) -> RequestStream:
        """Register many requests at once; they are admitted as slots free, oldest stream first.

        Args:
            requests: What to generate, in the order to send it.
            deliver: Called once per request as ``deliver(request, result)``, on the dispatcher's loop
                thread: keep it short (hand the result to a queue).

        Returns:
            The stream's handle (cancel it to drop the requests not in flight yet).

        Raises:
            RuntimeError: The dispatcher is not running (call start() or use it as a context manager).
            ValueError: In exact-token mode, a request without its prompt's ids.

        """
        if self.exact_tokens:
            require_prompt_tokens(requests)
        stream = RequestStream(requests, deliver, len(requests))
        with self._lock:
            if self._state != "running":
                raise RuntimeError(
                    f"Dispatcher is {self._state}: call start() (or use `with Dispatcher(...)`) "
                    "before submitting requests"
                )
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._add_stream, stream)
        return stream

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        """Queue one request.

        Args:
            request: What to generate.

        Returns:
            A future that always resolves with a CompletionRecord or a FailureRecord; cancelling it
            before the request is sent drops the request.

        Raises:
            RuntimeError: The dispatcher is not running (call start() or use it as a context manager).

        """
        future: Future[GenerationResult] = Future()
        stream = self.submit_stream([request], lambda _request, result: _set_result(future, result))
        future.add_done_callback(lambda done: stream.cancel() if done.cancelled() else None)
        return future

    def add_server(self, url: str, max_inflight: int | None = None) -> None:
        """Add a server; it takes requests once its ``/health`` answers 200.

        Args:
            url: The server's base URL.
            max_inflight: Requests kept in flight on it (its host's plan); ``max_inflight_per_server`` if None.

        """
        cap = max_inflight or self.max_inflight_per_server
        self._call_on_loop(functools.partial(self._add_server, cap=cap), _normalise(url))

    def remove_server(self, url: str) -> None:
        """Stop routing to a server; its in-flight requests go back to the queue without losing an attempt."""
        self._call_on_loop(self._remove_server, _normalise(url))

    def stats(self) -> DispatcherStats:
        """A snapshot of backlog, queue, in-flight and throughput counters; never waits for the loop."""
        with self._lock:
            running = self._state == "running"
        if not running and self._final_stats is not None:
            return self._final_stats
        return self._snapshot()

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

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    def _open_pools(self, server: ServerState) -> None:
        # One pool per server, sized to its cap: the dispatcher never has more in flight there, so the pool
        # never queues a request, and every slot keeps its own warm connection.
        server.pool = HttpPool(
            server.url,
            limit=server.cap,
            keepalive_idle_s=KEEPALIVE_IDLE_S,
            connect_timeout_s=min(CONNECT_TIMEOUT_S, self.generation.request_timeout_s),
            headers=self._headers(),
        )
        server.health_pool = HttpPool(
            server.url,
            limit=HEALTH_POOL_SIZE,
            keepalive_idle_s=KEEPALIVE_IDLE_S,
            connect_timeout_s=HEALTH_TIMEOUT_S,
            headers=self._headers(),
        )

    @staticmethod
    def _close_pools(server: ServerState) -> None:
        for pool in (server.pool, server.health_pool):
            if pool is not None:
                pool.close()

    async def _main(self, started: threading.Event) -> None:
        self._stop_event = asyncio.Event()
        for server in self._servers.values():
            self._open_pools(server)
        self._all_down_since = time.monotonic()
        health_task = asyncio.create_task(self._health_loop())
        started.set()
        try:
            await self._stop_event.wait()
        finally:
            self._closing = True
            health_task.cancel()
            # Collected before the cancellations below take the in-flight jobs off their servers.
            jobs = self._all_jobs()
            tasks = [job.task for job in jobs if job.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(health_task, *tasks, *self._probes, return_exceptions=True)
            reason = "dispatcher closed before the request finished"
            for job in jobs:
                if job.timer is not None:
                    job.timer.cancel()
                self._fail(job, reason, "dispatcher_closed", None)
            self._fail_backlog(reason, "dispatcher_closed")
            self._queue.clear()
            self._backlog = 0
            self._backing_off = 0
            for server in self._servers.values():
                self._close_pools(server)
            self._final_stats = self._snapshot()

    def _all_jobs(self) -> list[Job]:
        jobs = list(self._queue)
        jobs += [job for server in self._servers.values() for job in server.in_flight]
        jobs += list(self._retry_jobs)
        return jobs

    def _add_stream(self, stream: RequestStream) -> None:
        self._streams.append(stream)
        if self._closing:
            self._fail_backlog("dispatcher closed before the request was sent", "dispatcher_closed")
            return
        self._backlog += stream.pending
        self._admit()
        self._pump()

    def _fail_backlog(self, reason: str, error_type: str) -> None:
        """Fail every request of every stream that was not admitted yet."""
        while self._streams:
            stream = self._streams.popleft()
            while (request := stream.take()) is not None:
                self._admitted += 1  # resolving a job gives its admission back
                self._fail(Job(request, stream), reason, error_type, None)
        self._backlog = 0

    def _admit(self) -> None:
        """Move requests from the streams (oldest first) into the queue, up to the admission limit."""
        limit = self.admission_limit
        budget = min(limit - self._admitted, ADMIT_BATCH)
        while budget > 0 and self._streams:
            stream = self._streams[0]
            if stream.cancelled:
                self._backlog -= stream.pending
                stream.pending = 0
                self._streams.popleft()
                continue
            request = stream.take()
            if request is None:
                self._streams.popleft()
                continue
            self._backlog -= 1
            self._admitted += 1
            self._queue.append(Job(request, stream))
            budget -= 1
        if self._streams and self._admitted < limit:
            # A very large backlog: finish admitting on the next loop turn, after pending I/O.
            assert self._loop is not None
            self._loop.call_soon(self._admit_and_pump)

    def _admit_and_pump(self) -> None:
        self._admit()
        self._pump()

    def _pump(self) -> None:
        """Fill every free slot from the head of the queue, least-loaded server first."""
        queue = self._queue
        while queue and not self._closing:
            job = queue[0]
            if job.stream.cancelled:
                queue.popleft()
                self._admitted -= 1
                continue
            server = self._pick_server(job)
            if server is None:
                return
            queue.popleft()
            self._start(job, server)

    def _refill(self, freed: ServerState) -> None:
        """Give the slot ``freed`` just released to the head of the queue, in O(1).

        Only called when requests were waiting as the slot freed: then every other usable server is full
        (the queue would have drained into it otherwise), so the freed server is the least loaded one.
        """
        queue = self._queue
        while queue and not self._closing:
            job = queue[0]
            if job.stream.cancelled:
                queue.popleft()
                self._admitted -= 1
                continue
            usable = freed.usable and len(freed.in_flight) < freed.cap
            if usable and (job.last_server != freed.url or len(self._servers) == 1):
                queue.popleft()
                self._start(job, freed)
                return
            break
        self._pump()

    def _start(self, job: Job, server: ServerState) -> None:
        assert self._loop is not None
        server.in_flight.add(job)
        server.dispatched += 1
        self._dispatched += 1
        if self._first_dispatch_at is None:
            self._first_dispatch_at = time.monotonic()
        job.task = self._loop.create_task(self._run(job, server))

    def _pick_server(self, job: Job) -> ServerState | None:
        """The usable server with a free slot and the smallest share of its cap in use, not the last one tried."""
        best: ServerState | None = None
        fallback: ServerState | None = None
        for server in self._servers.values():
            if not server.usable or len(server.in_flight) >= server.cap:
                continue
            if server.url == job.last_server:
                fallback = server
                continue
            if best is None:
                best = server
                continue
            # in_flight / cap, compared by cross-multiplying: with equal caps, the in-flight counts.
            load, best_load = len(server.in_flight) * best.cap, len(best.in_flight) * server.cap
            if (load, server.dispatched) < (best_load, best.dispatched):
                best = server
        return best or fallback

    async def _run(self, job: Job, server: ServerState) -> None:
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
            outcome = Transient(reason=job.interrupted, interrupted=True)
            if job.refund:
                job.attempts -= 1
            job.interrupted = None
            job.refund = False
        finally:
            server.in_flight.discard(job)
            job.task = None
        saturated = bool(self._queue)
        self._settle(job, server, outcome)
        self._admit()
        if saturated:
            self._refill(server)
        else:
            self._pump()

    async def _try(self, job: Job, server: ServerState, started: float) -> Outcome:
        """One HTTP try, classified; never raises except on cancellation."""
        assert server.pool is not None
        body = orjson.dumps(self._payload(job))
        try:
            response = await server.pool.request(
                "POST", self._generation_path, body, timeout_s=self.generation.request_timeout_s
            )
        except ConnectFailedError as error:
            # Nothing listens (refused) or the host is unreachable: the server is down.
            return Transient(reason=f"connection refused: {_describe(error)}", server_down=True)
        except ConnectTimeoutError as error:
            return Transient(reason=f"connect timeout: {_describe(error)}", suspect=True)
        except ConnectionBrokenError as error:
            # The server may have finished the request before the connection broke: the retry is safe
            # because the request resolves once (one record), whichever try answers.
            return Transient(reason=f"connection reset: {_describe(error)}", suspect=True)
        except MalformedResponseError as error:
            return Transient(reason=f"malformed response: {_describe(error)}", suspect=True)
        except HttpError as error:
            # The request timeout: a slow answer is not proof the server is ill.
            return Transient(reason=f"{type(error).__name__}: {_describe(error)}")
        status, raw = response.status, response.body
        latency_s = time.monotonic() - started
        if status >= 500 or status in RETRYABLE_4XX:
            return Transient(reason=f"HTTP {status}: {excerpt(_text(raw))}", status=status)
        if status != 200:
            return Final(
                reason=f"HTTP {status}: {excerpt(_text(raw))}", error_type=f"http_{status}", status=status
            )
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            kind = "empty body" if not raw.strip() else f"invalid JSON body: {excerpt(_text(raw))}"
            return Transient(reason=f"HTTP 200 with {kind}", status=status)
        try:
            if self.exact_tokens:
                completion, finish_reason, usage = parse_generate_completion(data, job.request)
            else:
                completion, finish_reason, usage = parse_chat_completion(data)
        except UnusableResponseError as error:
            return Transient(reason=f"HTTP 200 with unusable completion: {error}", status=status)
        except BadToolArgumentsError as error:
            return Final(reason=str(error), error_type="invalid_tool_arguments", status=status)
        request = job.request
        # Every field is already a validated object (the request's, or built by parse_chat_completion):
        # validating the whole record again would cost more than the rest of the loop's work per request.
        record = CompletionRecord.model_construct(
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
            # Given, not defaulted: pydantic inspects a default factory's signature on every construct.
            created_at=utc_now(),
        )
        return Success(record)

    def _settle(self, job: Job, server: ServerState, outcome: Outcome) -> None:
        """Resolve, retry or fail one job after a try."""
        if isinstance(outcome, Success):
            server.completed += 1
            self._completed += 1
            self._output_tokens += outcome.record.usage.completion_tokens
            self._last_result_at = time.monotonic()
            self._resolve(job, outcome.record)
            return
        if isinstance(outcome, Final):
            self._fail(job, outcome.reason, outcome.error_type, outcome.status, server.url)
            return
        if outcome.server_down:
            self._mark_down(server, outcome.reason)
        elif outcome.suspect:
            self._mark_suspect(server, outcome.reason)
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
        self._retry_jobs.add(job)
        job.timer = self._loop.call_later(delay_s, self._requeue, job)

    def _requeue(self, job: Job) -> None:
        job.timer = None
        self._backing_off -= 1
        self._retry_jobs.discard(job)
        if self._closing:
            return
        # Retries go to the head: a request that already waited should not wait behind the whole fleet.
        self._queue.appendleft(job)
        self._pump()

    def _backoff_s(self, attempts: int) -> float:
        ceiling = min(self.generation.backoff_max_s, self.generation.backoff_initial_s * 2 ** (attempts - 1))
        return random.uniform(JITTER_FLOOR * ceiling, ceiling)

    def _resolve(self, job: Job, result: GenerationResult) -> None:
        self._admitted -= 1
        stream = job.stream
        if stream.cancelled:
            return
        try:
            stream.deliver(job.request, result)
        except Exception:
            # A broken callback must not take the loop down with it: the other streams keep going.
            logger.exception("result callback raised key=%s", job.request.key)

    def _fail(
        self, job: Job, reason: str, error_type: str, status: int | None, server: str | None = None
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
        if error_type != "dispatcher_closed":
            logger.warning(
                "request failed key=%s error_type=%s attempts=%d reason=%s",
                request.key,
                error_type,
                job.attempts,
                reason,
            )
        self._resolve(job, record)

    # --- server state -----------------------------------------------------------------------------

    def _mark_up(self, server: ServerState) -> None:
        if self._servers.get(server.url) is not server:
            return
        if server.up and server.suspect_since is None:
            return
        if server.suspect_since is not None:
            logger.info("server known good again url=%s", server.url)
        else:
            logger.info("server up url=%s", server.url)
        server.up = True
        server.suspect_since = None
        self._all_down_since = None
        self._pump()

    def _mark_suspect(self, server: ServerState, reason: str) -> None:
        """A reset or connect timeout: no new request for this server until its /health answers."""
        if not server.up or server.suspect_since is not None:
            return
        server.suspect_since = time.monotonic()
        logger.warning(
            "server suspect url=%s in_flight=%d reason=%s", server.url, len(server.in_flight), reason
        )
        self._probe_soon(server, mark_up=True)

    def _mark_down(self, server: ServerState, reason: str, *, refund: bool = False) -> None:
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
        if not any(other.up for other in self._servers.values()) and self._all_down_since is None:
            self._all_down_since = time.monotonic()

    def _add_server(self, url: str, cap: int | None = None) -> None:
        if url in self._servers:
            return
        server = ServerState(url, cap=cap or self.max_inflight_per_server)
        self._servers[url] = server
        self._slots += server.cap
        logger.info("server added url=%s max_inflight=%d", url, server.cap)
        if self._loop is not None and self._loop.is_running():
            self._open_pools(server)
            self._probe_soon(server, mark_up=True)

    def _remove_server(self, url: str) -> None:
        server = self._servers.get(url)
        if server is None:
            return
        self._mark_down(server, "removed", refund=True)
        del self._servers[url]
        self._slots -= server.cap
        logger.info("server removed url=%s", url)
        self._close_pools(server)

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
        now = time.monotonic()
        probes = []
        for server, is_alive in zip(servers, alive, strict=True):
            if not is_alive:
                self._mark_down(server, "liveness check reports the process dead")
            elif server.suspect_since is not None and now - server.suspect_since >= SUSPECT_MAX_S:
                logger.warning(
                    "server suspect for %.0fs without a verdict; trusting it again url=%s",
                    SUSPECT_MAX_S,
                    server.url,
                )
                self._mark_up(server)
            elif (not server.up or server.suspect_since is not None) and not server.probing:
                probes.append(self._probe(server, mark_up=True))
        await asyncio.gather(*probes)

    def _probe_soon(self, server: ServerState, *, mark_up: bool = False) -> None:
        if server.probing:
            return
        assert self._loop is not None
        task = self._loop.create_task(self._probe(server, mark_up=mark_up))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, server: ServerState, *, mark_up: bool) -> None:
        """GET /health: 200 marks a down or suspect server up; a refused connection marks it down."""
        assert server.health_pool is not None
        server.probing = True
        try:
            response = await server.health_pool.request(
                "GET", self._engine_rules.health_path, b"", timeout_s=HEALTH_TIMEOUT_S
            )
            status = response.status
        except ConnectFailedError as error:
            self._mark_down(server, f"health probe refused: {_describe(error)}")
            return
        except HttpError:
            # A busy server may answer /health slowly (SGLang runs a generation there); not proof of death.
            return
        finally:
            server.probing = False
        if status == 200 and mark_up:
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
        if waited_s < self.generation.no_live_server_timeout_s or not (self._queue or self._streams):
            return
        reason = (
            f"no live servers for {waited_s:.0f}s (limit no_live_server_timeout_s="
            f"{self.generation.no_live_server_timeout_s:g}); servers: {', '.join(self._servers) or 'none'}"
        )
        # Everything waiting fails, admitted or not: each shard reruns exactly these requests later.
        while self._queue:
            self._fail(self._queue.popleft(), reason, "no_live_servers", None)
        self._fail_backlog(reason, "no_live_servers")

    # --- requests and stats -----------------------------------------------------------------------

    def _payload(self, job: Job) -> dict[str, Any]:
        if self.exact_tokens:
            # The attempt in the rid keeps a retry distinct from an earlier try the server may still run.
            payload = build_request_payload(job.request, rid=f"{job.request.key}#{job.attempts}")
            fields: dict[str, Any] = payload["sampling_params"]
        else:
            payload = fields = build_chat_payload(job.request, self.model)
        if self._dropped_fields:
            dropped = sorted(self._dropped_fields & fields.keys())
            for name in dropped:
                del fields[name]
            if dropped and not self._dropped_fields_logged:
                self._dropped_fields_logged = True
                logger.warning("sampling fields not sent engine=%s fields=%s", self.engine, ",".join(dropped))
        return payload

    def _snapshot(self) -> DispatcherStats:
        """Counters read without the loop: each is a plain int written only by the loop thread."""
        for _ in range(3):
            try:
                servers = list(self._servers.values())
                break
            except RuntimeError:  # the loop added or removed a server while we copied
                continue
        else:
            servers = []
        elapsed_s = 0.0
        first = self._first_dispatch_at
        if first is not None:
            busy = self._admitted or self._backlog
            end = time.monotonic() if busy else (self._last_result_at or time.monotonic())
            elapsed_s = max(end - first, 0.0)
        resolved = self._completed + self._failed
        return DispatcherStats(
            servers=[
                ServerStats(
                    url=s.url,
                    up=s.up,
                    in_flight=len(s.in_flight),
                    dispatched=s.dispatched,
                    completed=s.completed,
                )
                for s in servers
            ],
            backlog=self._backlog,
            queued=len(self._queue),
            backing_off=self._backing_off,
            dispatched=self._dispatched,
            completed=self._completed,
            failed=self._failed,
            retries=self._retries,
            output_tokens=self._output_tokens,
            tokens_per_s=self._output_tokens / elapsed_s if elapsed_s > 0 else 0.0,
            requests_per_s=resolved / elapsed_s if elapsed_s > 0 else 0.0,
        )


def _set_result(future: Future[GenerationResult], result: GenerationResult) -> None:
    with contextlib.suppress(InvalidStateError):
        future.set_result(result)


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def _normalise(url: str) -> str:
    return url.rstrip("/")


def _describe(error: BaseException) -> str:
    return str(error) or type(error).__name__
