"""Admission and server choice: which request goes next, and to which server.

Registered streams are backlogs the dispatcher pulls from, oldest stream first. Only
:attr:`Admission.limit` requests (a few times the fleet's slots) are admitted at once, whichever shards they
come from; a request is admitted the moment another one resolves. Admitted requests wait in one FIFO queue
(retries go to its head); each server holds at most its cap, and the next request goes to the usable server
with the smallest share of its cap in use, preferring another server than the request's last one. When a
request finishes while others wait, its own slot is refilled at once, in O(1). Loop thread only; the
counters are plain ints that stats read from any thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from datagen.generation.dispatch_state import GenerationResult, Job, RequestStream, ServerState, ServerTable
from datagen.generation.failures import FailureKind

logger = logging.getLogger(__name__)

# Requests admitted at once (queued + in flight + backing off), as a multiple of the fleet's slots:
# enough queued work to refill every slot of a lockstep wave twice over, small enough that a shard's
# requests are not all pulled into memory-resident jobs at once.
ADMISSION_SLOTS_FACTOR = 3
# ...and never fewer than this, so a small fleet still has a queue to refill from.
ADMISSION_MIN_REQUESTS = 256
# Requests pulled from streams per admission pass, so one huge backlog cannot hold the loop for long.
ADMIT_BATCH = 512

Fail = Callable[[Job, str, FailureKind, int | None], None]


class Admission:
    """The streams, the queue of admitted requests, and the choice of a server for each.

    Args:
        table: The servers (their slots size the admission limit).
        start: Starts one try of a job on a server (the dispatcher's).
        fail: Resolves a job as a failure ``fail(job, reason, kind, status)``.
        fixed_limit: Requests admitted at once; None: ``ADMISSION_SLOTS_FACTOR`` x the fleet's slots.

    """

    def __init__(
        self,
        table: ServerTable,
        *,
        start: Callable[[Job, ServerState], None],
        fail: Fail,
        fixed_limit: int | None,
    ) -> None:
        self.table = table
        self.servers = table.servers
        self._start = start
        self._fail = fail
        self.fixed_limit = fixed_limit
        self.streams: deque[RequestStream] = deque()
        self.queue: deque[Job] = deque()
        # Jobs waiting out a retry delay (their timer holds them otherwise).
        self.retry_jobs: set[Job] = set()
        self.admitted = 0
        self.backlog = 0
        self.backing_off = 0
        self.closing = False
        # Why admission stopped for good (a storage fault no retry cures); None while it admits.
        self.stopped: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def limit(self) -> int:
        """Requests admitted at once (queued, in flight or backing off), across every stream."""
        if self.fixed_limit is not None:
            return self.fixed_limit
        return max(ADMISSION_MIN_REQUESTS, ADMISSION_SLOTS_FACTOR * self.table.slots)

    def add_stream(self, stream: RequestStream) -> None:
        """Register a stream; its requests are admitted as the limit allows."""
        self.streams.append(stream)
        if self.closing:
            self.fail_backlog("dispatcher closed before the request was sent", FailureKind.DISPATCHER_CLOSED)
            return
        if self.stopped is not None:
            self.fail_backlog(self.stopped, FailureKind.ADMISSION_STOPPED)
            return
        self.backlog += stream.pending
        self.admit()
        self.pump()

    def fail_backlog(self, reason: str, kind: FailureKind) -> None:
        """Fail every request of every stream that was not admitted yet."""
        while self.streams:
            stream = self.streams.popleft()
            while (request := stream.take()) is not None:
                self.admitted += 1  # resolving a job gives its admission back
                self._fail(Job(request, stream), reason, kind, None)
        self.backlog = 0

    def stop(self, reason: str) -> None:
        """Send nothing more: every request not in flight ends now, unsent; those in flight finish.

        Queued requests, those waiting out a retry delay, every stream's backlog and any stream registered later
        resolve as :attr:`FailureKind.ADMISSION_STOPPED` (unfinished: their shards send them again later).
        """
        if self.stopped is not None or self.closing:
            return
        self.stopped = reason
        for job in list(self.retry_jobs):
            if job.timer is not None:
                job.timer.cancel()
                job.timer = None
            self.backing_off -= 1
            self.retry_jobs.discard(job)
            self._fail(job, reason, FailureKind.ADMISSION_STOPPED, None)
        while self.queue:
            self._fail(self.queue.popleft(), reason, FailureKind.ADMISSION_STOPPED, None)
        self.fail_backlog(reason, FailureKind.ADMISSION_STOPPED)

    def has_waiting(self) -> bool:
        """Whether requests wait for a server (admitted or not)."""
        return bool(self.queue or self.streams)

    def fail_waiting(self, reason: str) -> None:
        """Fail everything waiting, admitted or not: each shard reruns exactly these requests later."""
        while self.queue:
            self._fail(self.queue.popleft(), reason, FailureKind.NO_LIVE_SERVERS, None)
        self.fail_backlog(reason, FailureKind.NO_LIVE_SERVERS)

    def all_jobs(self) -> list[Job]:
        """Every admitted job: queued, in flight, backing off."""
        jobs = list(self.queue)
        jobs += [job for server in self.servers.values() for job in server.in_flight]
        jobs += list(self.retry_jobs)
        return jobs

    def admit(self) -> None:
        """Move requests from the streams (oldest first) into the queue, up to the admission limit."""
        limit = self.limit
        budget = min(limit - self.admitted, ADMIT_BATCH)
        while budget > 0 and self.streams:
            stream = self.streams[0]
            if stream.cancelled:
                self.backlog -= stream.pending
                stream.pending = 0
                self.streams.popleft()
                continue
            request = stream.take()
            if request is None:
                self.streams.popleft()
                continue
            self.backlog -= 1
            self.admitted += 1
            self.queue.append(Job(request, stream))
            budget -= 1
        if self.streams and self.admitted < limit:
            # A very large backlog: finish admitting on the next loop turn, after pending I/O.
            assert self.loop is not None
            self.loop.call_soon(self._admit_and_pump)

    def _admit_and_pump(self) -> None:
        self.admit()
        self.pump()

    def _head(self) -> Job | None:
        """The first queued job whose stream is not cancelled (cancelled ones are dropped); None when closing."""
        queue = self.queue
        while queue and not self.closing:
            job = queue[0]
            if not job.stream.cancelled:
                return job
            queue.popleft()
            self.admitted -= 1
        return None

    def pump(self) -> None:
        """Fill every free slot from the head of the queue, least-loaded server first."""
        while (job := self._head()) is not None:
            server = self.pick_server(job)
            if server is None:
                return
            self.queue.popleft()
            self._start(job, server)

    def refill(self, freed: ServerState) -> None:
        """Give the slot ``freed`` just released to the head of the queue, in O(1).

        Only called when requests were waiting as the slot freed: then every other usable server is full
        (the queue would have drained into it otherwise), so the freed server is the least loaded one.
        """
        job = self._head()
        usable = freed.usable and len(freed.in_flight) < freed.cap
        if job is not None and usable and (job.last_server != freed.url or len(self.servers) == 1):
            self.queue.popleft()
            self._start(job, freed)
            return
        self.pump()

    def pick_server(self, job: Job) -> ServerState | None:
        """The usable server with a free slot and the smallest share of its cap in use, not the last one tried."""
        best: ServerState | None = None
        fallback: ServerState | None = None
        for server in self.servers.values():
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

    def defer(self, job: Job, delay_s: float) -> None:
        """Put ``job`` back at the queue's head after ``delay_s`` (a retry's backoff)."""
        assert self.loop is not None
        self.backing_off += 1
        self.retry_jobs.add(job)
        job.timer = self.loop.call_later(delay_s, self._requeue, job)

    def _requeue(self, job: Job) -> None:
        job.timer = None
        self.backing_off -= 1
        self.retry_jobs.discard(job)
        if self.closing:
            return
        # Retries go to the head: a request that already waited should not wait behind the whole fleet.
        self.queue.appendleft(job)
        self.pump()

    def resolve(self, job: Job, result: GenerationResult) -> None:
        """Hand ``job``'s result to its stream (once) and give its admission back.

        When the stream follows its results (an on-policy conversation), the request that follows this one is
        admitted in its place at once and joins the queue's tail: the chain's next turn is queued the moment the
        previous one lands and keeps the admission it freed. At the tail, not the head: the requests with the
        most work behind them (new conversations' first turns) go first, which shortens the run's end, where
        only chains' last turns remain (benchmarks/bench_conversations.py: 0.95 of independent requests at the
        tail, 0.89 at the head, on a loaded 2-core box).
        """
        self.admitted -= 1
        stream = job.stream
        if stream.cancelled:
            return
        try:
            stream.deliver(job.request, result)
            following = stream.follow(job.request, result) if stream.follow is not None else None
        except Exception:
            # A broken callback must not take the loop down with it: the other streams keep going.
            logger.exception("result callback raised key=%s", job.request.key)
            return
        if following is not None:
            self._admit_following(Job(following, stream))

    def _admit_following(self, job: Job) -> None:
        """Admit a stream's follow-up request now (ended at once when admission closed or stopped)."""
        self.admitted += 1  # resolving the job gives it back
        if self.closing:
            self._fail(
                job, "dispatcher closed before the request was sent", FailureKind.DISPATCHER_CLOSED, None
            )
            return
        if self.stopped is not None:
            self._fail(job, self.stopped, FailureKind.ADMISSION_STOPPED, None)
            return
        self.queue.append(job)
        # A result that did not come from a try (no pump follows it) must not leave the request waiting.
        assert self.loop is not None
        self.loop.call_soon(self.pump)

    def clear(self) -> None:
        """Forget the queue and the counters (at shutdown, after every job was failed)."""
        self.queue.clear()
        self.backlog = 0
        self.backing_off = 0
