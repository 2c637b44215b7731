"""The shard scheduler: one `generate-shard` task per shard, started as the dispatcher's backlog runs low.

A shard task registers all its requests with the dispatcher as one stream; the dispatcher admits requests (not
shards) as slots free. A new shard task starts whenever the requests registered but not yet admitted (plus those
of shard tasks still starting) fall below the dispatcher's admission limit, so work is always waiting, however
long the slowest request of any shard takes. Shards start as their datasets are prepared.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections import deque
from dataclasses import dataclass, field

from prefect import get_run_logger
from prefect.exceptions import ExternalSignal
from prefect.futures import PrefectFuture

from datagen.config import RunConfig
from datagen.errors import TrainingNotRestartedError, UnfixableStorageError, WindowClosingError
from datagen.generation.dispatcher import Dispatcher
from datagen.records import PreparedDataset, PromptShardRef, ShardSummary
from tasks.context import RunContext
from tasks.data import ShardProgress, generate_shard
from tasks.progress import GenerationProgressReporter, ServingCost

# Shard tasks running at once unless generation.max_concurrent_shards says otherwise: room for shards waiting
# on their slowest requests (a long tail keeps dozens open) while new ones feed the backlog, and for prepares.
MAX_SHARD_TASKS = 224
# How often the flow starts shard tasks when the dispatcher's backlog runs low (it holds seconds of work).
SCHEDULE_INTERVAL_S = 0.2


@dataclass
class Generated:
    """What generation produced and took.

    Attributes:
        prepared: The prepared datasets.
        summaries: Every finished shard's summary.
        errors: Each failed shard's error.
        servers: The servers that took part.
        wall_s: How long generation ran (the report's throughput divides by it).
        held_back: Why training was not restarted on the way out, if it was not (raised once the run is complete).
        requests: The run's requests in all (every prepared dataset's prompts times its samples).
        unsent: Requests generation ended without sending, when admission stopped (the window closed): those
            of shards never started and those the cut shards left unanswered; the run's next attempt sends them.
    """

    prepared: list[PreparedDataset] = field(default_factory=list)
    summaries: list[ShardSummary] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    servers: int = 0
    wall_s: float = 0.0
    held_back: list[TrainingNotRestartedError] = field(default_factory=list)
    unsent: int = 0
    requests: int = 0

    @property
    def window_closed(self) -> bool:
        """The window ended generation: every error is a shard it cut (none failed otherwise)."""
        return bool(self.errors) and all(isinstance(error, WindowClosingError) for error in self.errors)


def samples_per_prompt(config: RunConfig, dataset: str) -> int:
    """Requests per prompt of ``dataset`` (its sampling's ``samples_per_prompt``)."""
    return config.sampling_for(config.dataset(dataset)).samples_per_prompt


class ShardScheduler:
    """Feeds one dispatcher with shard tasks until every prepared shard has run (see the module docstring).

    Args:
        context: The run.
        prepared_futures: Every dataset's prepare task, in config order (shards start as each finishes).
        dispatcher: The dispatcher every shard task sends through.
        retry_failed: Shard tasks send the run's retryable failures again.
        started: When generation started (``time.monotonic()``): the report's wall time starts there too.
        cost: This box's GPUs, halt and window, for the progress card (None: not shown).
    """

    def __init__(
        self,
        context: RunContext,
        prepared_futures: list[PrefectFuture[PreparedDataset]],
        dispatcher: Dispatcher,
        *,
        retry_failed: bool,
        started: float,
        cost: ServingCost | None = None,
    ) -> None:
        self.context = context
        self.dispatcher = dispatcher
        self.retry_failed = retry_failed
        self.generated = Generated()
        self.total_requests = 0
        self.total_conversations = 0
        self.max_tasks = context.config.generation.max_concurrent_shards or MAX_SHARD_TASKS
        self._waiting_prepare = list(prepared_futures)
        self._pending: deque[PromptShardRef] = deque()
        self._running: dict[PrefectFuture[ShardSummary], PromptShardRef] = {}
        self._shard_progress = ShardProgress()
        self._progress = GenerationProgressReporter(dispatcher, started, cost)
        # Finished shard futures arrive here (their done-callback runs on the worker thread). Not prefect's wait(
        # timeout=): its SIGALRM timeout, armed five times a second, escaped as a CancelledError under load.
        self._finished: queue.SimpleQueue[PrefectFuture[ShardSummary]] = queue.SimpleQueue()
        # Set by a storage fault no retry cures (a full disk, no permission, the bucket gone): no new shard
        # starts, since each would generate answers it cannot store; the running ones end and the run stops.
        self._storage_fault: UnfixableStorageError | None = None

    def run(self) -> Generated:
        """Run every shard; a shard's own failure is collected (the run fails at its end), a signal propagates."""
        while self._work_left():
            self._take_prepared(block=self._admitting() and not self._pending and not self._running)
            self._start_shards()
            if self._running:
                self._collect_finished()
                self._report()
        summaries = self.generated.summaries
        answered = sum(s.completions + s.failures for s in summaries)
        self._progress.report(
            answered,
            self.total_requests,
            len(summaries),
            len(summaries),
            conversations=self._conversations(),
            force=True,
        )
        self._progress.close()
        self.generated.requests = self.total_requests
        if not self._admitting():
            self._take_prepared(block=True)  # counted as unsent
            self.generated.unsent = sum(
                shard.requests_per_sample * samples_per_prompt(self.context.config, shard.dataset)
                for shard in self._pending
            ) + sum(
                int(error.context.get("unanswered", 0))
                for error in self.generated.errors
                if isinstance(error, WindowClosingError)
            )
        return self.generated

    def _admitting(self) -> bool:
        """No fault and no window stopped the dispatcher's admission: new shards may start."""
        return self._storage_fault is None and self.dispatcher.stopped_by is None

    def _work_left(self) -> bool:
        if not self._admitting():
            return bool(self._running)
        return bool(self._waiting_prepare or self._pending or self._running)

    def _take_prepared(self, block: bool) -> None:
        """Queue the shards of every dataset prepared so far (waiting for the next one when ``block``)."""
        while self._waiting_prepare and (block or self._waiting_prepare[0].state.is_final()):
            item = self._waiting_prepare.pop(0).result()
            self.generated.prepared.append(item)
            samples = samples_per_prompt(self.context.config, item.dataset)
            self.total_requests += sum(shard.requests_per_sample for shard in item.shards) * samples
            if self.context.config.dataset(item.dataset).multi_turn == "on_policy":
                self.total_conversations += item.prompts * samples
            self._pending.extend(item.shards)
            block = False

    def _backlog(self) -> int:
        """Requests registered but not admitted, counting shard tasks that have not registered yet."""
        try:
            registered = self.dispatcher.stats().backlog
        except Exception:  # a read that fails counts as a full backlog: start nothing this turn
            return self.dispatcher.admission_limit
        run_id = self.context.run.run_id
        starting = sum(
            shard.prompts * samples_per_prompt(self.context.config, shard.dataset)
            for shard in self._running.values()
            if not self._shard_progress.registered(run_id, shard.dataset, shard.shard_index)
        )
        return registered + starting

    def _start_shards(self) -> None:
        while (
            self._admitting()
            and self._pending
            and len(self._running) < self.max_tasks
            and self._backlog() < self.dispatcher.admission_limit
        ):
            shard = self._pending.popleft()
            future = generate_shard.submit(
                self.context, shard, self.dispatcher, self._shard_progress, retry_failed=self.retry_failed
            )
            self._running[future] = shard
            future.add_done_callback(self._finished.put)

    def _collect_finished(self) -> None:
        done = []
        with contextlib.suppress(queue.Empty):
            done.append(self._finished.get(timeout=SCHEDULE_INTERVAL_S))
            while True:
                done.append(self._finished.get_nowait())
        logger = get_run_logger()
        for future in done:
            shard = self._running.pop(future)
            try:
                self.generated.summaries.append(future.result())
            except (KeyboardInterrupt, SystemExit, ExternalSignal):  # signalled while it waited here
                raise
            except BaseException as error:  # a shard's own failure: the run fails at the end
                logger.error(
                    "shard failed dataset=%s shard=%05d error=%r", shard.dataset, shard.shard_index, error
                )
                self.generated.errors.append(error)
                if isinstance(error, UnfixableStorageError) and self._storage_fault is None:
                    self._storage_fault = error
                    logger.error(
                        "no new shard starts: %s (shards running=%d not started=%d)",
                        error,
                        len(self._running),
                        len(self._pending),
                    )

    def _report(self) -> None:
        """Finished shards count all their requests (stored by any attempt); running ones what they have so far."""
        run_id = self.context.run.run_id
        summaries = self.generated.summaries
        answered = sum(s.completions + s.failures for s in summaries) + sum(
            self._shard_progress.done(run_id, shard.dataset, shard.shard_index)
            for shard in self._running.values()
        )
        shards_total = len(summaries) + len(self._running) + len(self._pending)
        self._progress.report(
            answered, self.total_requests, len(summaries), shards_total, conversations=self._conversations()
        )

    def _conversations(self) -> tuple[int, int] | None:
        """On-policy conversations over (finished shards' all, running shards' so far), and of the run (None: none)."""
        if not self.total_conversations:
            return None
        run_id = self.context.run.run_id
        running = sum(
            self._shard_progress.conversations_done(run_id, shard.dataset, shard.shard_index)
            for shard in self._running.values()
        )
        return sum(s.conversations for s in self.generated.summaries) + running, self.total_conversations


def generate_all(
    context: RunContext,
    prepared_futures: list[PrefectFuture[PreparedDataset]],
    dispatcher: Dispatcher,
    retry_failed: bool = False,
    started: float | None = None,
    cost: ServingCost | None = None,
) -> Generated:
    """Run one task per shard through ``dispatcher`` (:class:`ShardScheduler`); ``started`` defaults to now."""
    scheduler = ShardScheduler(
        context,
        prepared_futures,
        dispatcher,
        retry_failed=retry_failed,
        started=time.monotonic() if started is None else started,
        cost=cost,
    )
    return scheduler.run()
