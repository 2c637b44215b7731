"""The fleet-wide request dispatcher: one per flow process, shared by every running shard task.

Shard tasks hand their requests over from any thread: :meth:`Dispatcher.submit_stream` registers a shard's
whole list (results come back through a callback), :meth:`Dispatcher.submit` one request (a future comes
back). All scheduling state lives on one asyncio loop on the dispatcher's own thread. At most
``admission_limit`` requests are admitted at once, oldest stream first, so the fleet never waits for a whole
shard and memory stays bounded by requests, not shards; each server holds at most its in-flight cap, and a
freed slot is refilled at once. Transient failures are retried, preferably on another server
(:mod:`~datagen.generation.retry`); a suspect or dead server takes no new request until ``/health`` answers
again, and a server that holds requests and answers none for several times the slowest completion seen is
marked down whatever its ``/health`` says. Every request resolves exactly once, with a
:class:`~datagen.records.CompletionRecord` or a :class:`~datagen.records.FailureRecord`.
:meth:`Dispatcher.stats` reads plain counters and never waits for the loop, so a saturated dispatcher cannot
stall a progress read.

The parts, one concern each: :mod:`~datagen.generation.dispatch_admission` (streams, the queue, the choice
of a server), :mod:`~datagen.generation.dispatch_attempt` (one try: body, HTTP, what the answer means),
:mod:`~datagen.generation.retry` (the retry policy), :mod:`~datagen.generation.dispatch_health` (pools,
the health loop, the stall rule), :mod:`~datagen.generation.dispatch_stats` (counters and snapshots), over
one :class:`~datagen.generation.dispatch_state.ServerTable`. Each gets what it uses in its constructor (the
table, then admission, then health, which tells admission when servers come and go). This module builds
them on one loop thread and is the only one other code uses. The whole path, step by step:
docs/architecture.md, "Generation: from shards to servers and back".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from types import TracebackType

from datagen.config import GenerationConfig, RunConfig
from datagen.engines import engine_class, exact_tokens_enabled
from datagen.generation.dispatch_admission import Admission
from datagen.generation.dispatch_attempt import RequestSender, failure_record
from datagen.generation.dispatch_health import ServerHealth
from datagen.generation.dispatch_loop import LoopThread
from datagen.generation.dispatch_state import (
    DispatcherStats,
    Final,
    FollowCallback,
    GenerationResult,
    Job,
    Outcome,
    RequestStream,
    ResultCallback,
    ServerState,
    ServerTable,
    Success,
)
from datagen.generation.dispatch_stats import Counters, snapshot
from datagen.generation.failures import FailureKind, is_unfinished
from datagen.generation.openai_chat import GenerationRequest
from datagen.generation.retry import GiveUp, RetryPolicy
from datagen.generation.sglang_generate import require_prompt_tokens
from datagen.settings import server_api_key

logger = logging.getLogger(__name__)


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
        vouch: Optional, for servers on other hosts: the version of the host's word for a server (None: no
            host vouches for it). A vouched-for server that refused a connection gets no request or probe
            until the version changes.
        api_key: Sent as a bearer token when set.
        admission_limit: Requests admitted at once across all streams; by default
            ``ADMISSION_SLOTS_FACTOR`` times the fleet's slots (at least ``ADMISSION_MIN_REQUESTS``).
        exact_tokens: Send SGLang ``/generate`` requests (the prompt's token ids, which every request must carry)
            and keep the answers' ``output_ids``, instead of OpenAI chat completions.
        on_answer: Told each answer's duration in seconds, on the dispatcher's loop (a windowed run's drain
            allowance is measured so); it must not block.

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
        vouch: Callable[[str], int | None] | None = None,
        api_key: str | None = None,
        admission_limit: int | None = None,
        exact_tokens: bool = False,
        on_answer: Callable[[float], None] | None = None,
    ) -> None:
        if max_inflight_per_server < 1:
            raise ValueError("max_inflight_per_server must be at least 1")
        self.model = model
        self.engine = engine
        self.max_inflight_per_server = max_inflight_per_server
        self.generation = generation
        self.exact_tokens = exact_tokens
        self._on_answer = on_answer
        rules = engine_class(engine)
        self._table = ServerTable([_normalise(url) for url in servers], max_inflight_per_server)
        self._admission = Admission(
            self._table, start=self._start, fail=self._fail, fixed_limit=admission_limit
        )
        self._health = ServerHealth(
            self._table,
            self._admission,
            generation=generation,
            health_path=rules.health_path,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
            liveness=liveness,
            vouch=vouch,
        )
        self._sender = RequestSender(
            model=model,
            engine=engine,
            unsupported_fields=rules.unsupported_sampling_fields,
            request_timeout_s=generation.request_timeout_s,
            exact_tokens=exact_tokens,
        )
        self._retry = RetryPolicy(generation)
        self._counters = Counters()
        self._thread = LoopThread("Dispatcher", "datagen-dispatcher")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._final_stats: DispatcherStats | None = None
        self._stopped_by: Exception | None = None

    @classmethod
    def for_run(
        cls,
        config: RunConfig,
        servers: list[str],
        *,
        model: str,
        max_inflight_per_server: int,
        liveness: Callable[[str], bool] | None = None,
        vouch: Callable[[str], int | None] | None = None,
        on_answer: Callable[[float], None] | None = None,
    ) -> Dispatcher:
        """The dispatcher of a run over ``servers``, on one box or several.

        The run's engine, generation settings and token mode, and the servers' API key, in one place.

        Args:
            config: The run's config.
            servers: The servers' base URLs.
            model: The served model's name.
            max_inflight_per_server: Requests kept in flight on each server (the plan's).
            liveness: One box's check that a server's process is alive (its fleet).
            vouch: Several boxes': the version of a host's word for a server (see the class).
            on_answer: Told each answer's duration (a windowed run's policy).
        """
        return cls(
            servers,
            model=model,
            engine=config.fleet.engine,
            max_inflight_per_server=max_inflight_per_server,
            generation=config.generation,
            liveness=liveness,
            vouch=vouch,
            api_key=server_api_key(),
            exact_tokens=exact_tokens_enabled(config),
            on_answer=on_answer,
        )

    @property
    def stopped_by(self) -> Exception | None:
        """The fault that stopped admission for good (:meth:`stop_admission`); None while requests are sent."""
        return self._stopped_by

    @property
    def admission_limit(self) -> int:
        """Requests admitted at once (queued, in flight or backing off), across every stream."""
        return self._admission.limit

    # --- lifecycle (any thread) -------------------------------------------------------------------

    def start(self) -> Dispatcher:
        """Start the background loop; returns self.

        Raises:
            RuntimeError: Already started or closed.

        """
        self._thread.start(self._main)
        logger.info(
            "dispatcher started servers=%d model=%s engine=%s max_inflight_per_server=%d admission_limit=%d "
            "exact_tokens=%s",
            len(self._table.servers),
            self.model,
            self.engine,
            self.max_inflight_per_server,
            self.admission_limit,
            self.exact_tokens,
        )
        return self

    def close(self) -> None:
        """Stop the loop. Requests still pending resolve as failures ("dispatcher closed").

        Its log line counts those apart (``unfinished``, with every other request that was never served): no
        record is written for them and their shards send them again, so they are not the run's failures.
        """
        if not self._thread.stop():
            return
        stats = self._final_stats
        if stats is not None:
            logger.info(
                "dispatcher closed completed=%d failed=%d unfinished=%d retries=%d output_tokens=%d "
                "tokens_per_s=%.1f requests_per_s=%.1f",
                stats.completed,
                stats.failed,
                stats.unfinished,
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

    def submit_stream(
        self,
        requests: list[GenerationRequest],
        deliver: ResultCallback,
        *,
        follow: FollowCallback | None = None,
    ) -> RequestStream:
        """Register many requests at once; they are admitted as slots free, oldest stream first.

        Args:
            requests: What to generate, in the order to send it.
            deliver: Called once per request as ``deliver(request, result)``, on the dispatcher's loop
                thread: keep it short (hand the result to a queue).
            follow: Called on the loop thread right after each ``deliver``; the request it returns (an on-policy
                conversation's next turn) joins the stream and is admitted at once, ahead of every backlog, and
                its result comes back the same way. Keep it short too; in exact-token mode the request it returns
                carries its prompt's ids (it renders them: one render per turn).

        Returns:
            The stream's handle (cancel it to drop the requests not in flight yet).

        Raises:
            RuntimeError: The dispatcher is not running (call start() or use it as a context manager); once
                admission was stopped (:meth:`stop_admission`), a closed dispatcher ends the requests unsent instead.
            ValueError: In exact-token mode, a request without its prompt's ids.

        """
        if self.exact_tokens:
            require_prompt_tokens(requests)
        stream = RequestStream(requests, deliver, len(requests), follow)
        try:
            self._thread.call_soon(self._admission.add_stream, stream)
        except RuntimeError:
            if self._stopped_by is None:
                raise
            # Admission stopped for good (a window's end cut the loop, a storage fault), and a shard that was
            # starting registers only now: its requests end unsent at once, as stop_admission promises, on this
            # thread (the loop is gone), and its shard says why.
            reason = f"not sent: admission stopped by {self._stopped_by}"
            while (request := stream.take()) is not None:
                deliver(
                    request, failure_record(Job(request, stream), reason, FailureKind.ADMISSION_STOPPED, None)
                )
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

    def stop_admission(self, cause: Exception) -> None:
        """Send no request from now on, because every answer from now on would be lost (any thread).

        For a storage fault no retry cures (no space, no permission, the bucket gone): each request sent after
        it would be answered and then thrown away, so what the run loses is bounded by what was in flight.
        Requests in flight finish and are delivered; every other request, of every stream, registered now or
        later, resolves at once as unfinished (:attr:`FailureKind.ADMISSION_STOPPED`). The first cause stays
        (:attr:`stopped_by`); later calls change nothing.

        Args:
            cause: The fault, named in the failures' reason and the log.

        """
        if self._stopped_by is not None:
            return
        self._stopped_by = cause
        self._thread.call_now_or_soon(lambda: self._stop_admission(cause))

    def _stop_admission(self, cause: Exception) -> None:
        if self._admission.stopped is not None or self._admission.closing:
            return
        in_flight = sum(len(server.in_flight) for server in self._table.servers.values())
        logger.error("admission stopped in_flight=%d cause=%s", in_flight, cause)
        self._admission.stop(f"not sent: admission stopped by {cause}")

    def add_server(self, url: str, max_inflight: int | None = None) -> None:
        """Add a server; it takes requests once its ``/health`` answers 200.

        Args:
            url: The server's base URL.
            max_inflight: Requests kept in flight on it (its host's plan); ``max_inflight_per_server`` if None.

        """
        cap = max_inflight or self.max_inflight_per_server
        self._thread.call_now_or_soon(lambda: self._health.add(_normalise(url), cap))

    def remove_server(self, url: str) -> None:
        """Stop routing to a server; its in-flight requests go back to the queue without losing an attempt."""
        self._thread.call_now_or_soon(lambda: self._health.remove(_normalise(url)))

    def move_server(self, old_url: str, new_url: str) -> None:
        """A server now listens at ``new_url``: route to it there, at its cap, and never to ``old_url`` again.

        Requests in flight on the old URL go back to the queue without losing an attempt (the fleet moved it
        because another program took its port: ``Fleet.on_server_moved``).
        """
        self._thread.call_now_or_soon(lambda: self._health.move(_normalise(old_url), _normalise(new_url)))

    def stats(self) -> DispatcherStats:
        """A snapshot of backlog, queue, in-flight and throughput counters; never waits for the loop."""
        if not self._thread.running and self._final_stats is not None:
            return self._final_stats
        return snapshot(self._table.servers, self._admission, self._counters)

    # --- the loop ---------------------------------------------------------------------------------

    async def _main(self, started: threading.Event, stop: asyncio.Event) -> None:
        self._loop = self._admission.loop = asyncio.get_running_loop()
        self._health.open(self._loop)
        health_task = asyncio.create_task(self._health.run())
        started.set()
        try:
            await stop.wait()
        finally:
            self._admission.closing = True
            health_task.cancel()
            # Collected before the cancellations below take the in-flight jobs off their servers.
            jobs = self._admission.all_jobs()
            tasks = [job.task for job in jobs if job.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(health_task, *tasks, *self._health.probes, return_exceptions=True)
            reason = "dispatcher closed before the request finished"
            for job in jobs:
                if job.timer is not None:
                    job.timer.cancel()
                self._fail(job, reason, FailureKind.DISPATCHER_CLOSED, None)
            self._admission.fail_backlog(reason, FailureKind.DISPATCHER_CLOSED)
            self._admission.clear()
            self._health.close()
            self._final_stats = snapshot(self._table.servers, self._admission, self._counters)

    def _start(self, job: Job, server: ServerState) -> None:
        assert self._loop is not None
        server.in_flight.add(job)
        server.dispatched += 1
        counters = self._counters
        counters.dispatched += 1
        if counters.first_dispatch_at is None:
            counters.first_dispatch_at = time.monotonic()
        job.task = self._loop.create_task(self._run(job, server))

    async def _run(self, job: Job, server: ServerState) -> None:
        job.attempts += 1
        job.last_server = server.url
        started = job.sent_at = time.monotonic()
        try:
            outcome = await self._sender.attempt(job, server, started)
        except asyncio.CancelledError:
            if job.interrupted is None:
                raise
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            outcome = self._retry.interrupted(job)
        finally:
            server.in_flight.discard(job)
            job.task = None
        self._health.answered(server, outcome, time.monotonic())
        admission = self._admission
        saturated = bool(admission.queue)
        self._settle(job, server, outcome)
        admission.admit()
        if saturated:
            admission.refill(server)
        else:
            admission.pump()

    def _settle(self, job: Job, server: ServerState, outcome: Outcome) -> None:
        """Resolve, retry or fail one job after a try."""
        if isinstance(outcome, Success):
            server.completed += 1
            counters = self._counters
            counters.completed += 1
            counters.output_tokens += outcome.record.usage.completion_tokens
            counters.last_result_at = time.monotonic()
            if self._on_answer is not None:
                self._on_answer(outcome.record.latency_s)
            self._admission.resolve(job, outcome.record)
            return
        if isinstance(outcome, Final):
            self._fail(job, outcome.reason, outcome.kind, outcome.status, server.url)
            return
        if outcome.server_down:
            self._health.mark_down(server, outcome.reason, gone=True)
        elif outcome.suspect:
            self._health.mark_suspect(server, outcome.reason)
        step = self._retry.after(job, outcome, server.url, len(self._table.servers))
        if isinstance(step, GiveUp):
            self._fail(job, step.reason, step.kind, outcome.status, server.url)
            return
        stopped = self._admission.stopped
        if stopped is not None:  # a retry would be sent after the stop
            self._fail(job, stopped, FailureKind.ADMISSION_STOPPED, outcome.status, server.url)
            return
        self._counters.retries += 1
        logger.warning(
            "retry key=%s attempt=%d max_attempts=%d server=%s status=%s delay_s=%.2f reason=%s",
            job.request.key,
            job.attempts,
            self.generation.max_attempts,
            server.url,
            outcome.status,
            step.delay_s,
            outcome.reason,
        )
        self._admission.defer(job, step.delay_s)

    def _fail(
        self, job: Job, reason: str, kind: FailureKind, status: int | None, server: str | None = None
    ) -> None:
        record = failure_record(job, reason, kind, status, server)
        counters = self._counters
        if is_unfinished(record):
            counters.unfinished += 1
        else:
            counters.failed += 1
        counters.last_result_at = time.monotonic()
        self._admission.resolve(job, record)


def _set_result(future: Future[GenerationResult], result: GenerationResult) -> None:
    with contextlib.suppress(InvalidStateError):
        future.set_result(result)


def _normalise(url: str) -> str:
    return url.rstrip("/")
