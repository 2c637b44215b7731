"""Generation progress for people: the progress artifact, the periodic log line and the live terminal view.

Prefect's API is never on the shard scheduler's path: the artifact is published by a thread of its own
(:class:`ProgressPublisher`), and a failed read or update never fails a run.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import threading
import time
from dataclasses import dataclass
from typing import cast
from uuid import UUID

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from datagen.generation.dispatch_state import DispatcherStats
from datagen.generation.dispatcher import Dispatcher
from datagen.generation.window import WindowPolicy
from datagen.progress import GenerationProgress, report_progress
from datagen.records import utc_now
from datagen.settings import get_settings

# How often a watcher of the run (the live terminal view) hears how far generation is: a bar that moves smoothly;
# the log line and the artifact keep progress_interval_s.
WATCHED_PROGRESS_INTERVAL_S = 0.5
# How long the end of generation waits for its last progress update to reach the API (it never waits longer:
# with the API away, the run goes on to the merge and reports there).
PROGRESS_CLOSE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ServingCost:
    """What this box's serving costs training, for the progress card: its GPUs, the halt, the window.

    Attributes:
        gpus: GPUs the fleet holds.
        halted_at: When the halt of training began (None: this attempt halted nothing).
        window_ends_at: When training must run again (None: no window).
        window: The window's admission policy (None: no window).
    """

    gpus: int
    halted_at: dt.datetime | None = None
    window_ends_at: dt.datetime | None = None
    window: WindowPolicy | None = None


def progress_card(
    answered: int,
    total: int,
    stats: DispatcherStats,
    elapsed_s: float,
    cost: ServingCost | None = None,
    conversations: tuple[int, int] | None = None,
) -> tuple[GenerationProgress, str]:
    """Generation so far and the progress artifact's text: the figures, then the dispatcher's queues.

    ``conversations``: on-policy conversations over so far and of the run (None: the run has none).
    """
    now = utc_now()
    done, planned = conversations or (0, 0)
    progress = GenerationProgress(
        answered=answered,
        total=total,
        conversations_done=done,
        conversations=planned,
        failed=stats.failed,
        output_tokens=stats.output_tokens,
        elapsed_s=elapsed_s,
        answered_here=stats.completed + stats.failed,
        gpus=cost.gpus if cost else 0,
        training_paused_s=(now - cost.halted_at).total_seconds() if cost and cost.halted_at else None,
        window_left_s=(cost.window_ends_at - now).total_seconds() if cost and cost.window_ends_at else None,
        window_closing=bool(cost and cost.window and not cost.window.admitting(time.monotonic())),
    )
    detail = f"{sum(stats.in_flight.values())} in flight · {stats.queued} queued · {stats.retries} retries"
    return progress, progress.card(detail)


class ProgressPublisher:
    """Publishes the progress artifact from a thread of its own: Prefect's API is never on the scheduler's path.

    The scheduler only leaves the latest (progress, description) here. While the API is away, a call blocks
    this thread for as long as Prefect's client retries (about a minute) and the updates made meanwhile are
    dropped, only the latest kept: the first call that goes through once the API is back shows it. Runs in
    a copy of the flow run's context (the client and the run logger need it).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: tuple[float, str] | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._idle = threading.Event()
        self._idle.set()
        self.progress_id: UUID | None = None
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._publish_forever,), name="progress-artifact", daemon=True
        )
        self._thread.start()

    def publish(self, progress: float, description: str) -> None:
        """Leave the latest progress for the thread (never waits for the API)."""
        with self._lock:
            self._latest = (progress, description)
            self._idle.clear()
        self._wake.set()

    def close(self, timeout_s: float) -> None:
        """Publish what is left (waiting at most ``timeout_s``), then stop the thread."""
        self._idle.wait(timeout_s)
        self._stopping = True
        self._wake.set()

    def _publish_forever(self) -> None:
        logger = get_run_logger()
        away_since: float | None = None
        while not self._stopping:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                latest, self._latest = self._latest, None
            if latest is None:
                self._idle.set()
                continue
            try:
                if self.progress_id is None:
                    self.progress_id = cast(
                        UUID,
                        create_progress_artifact(latest[0], key="generation-progress", description=latest[1]),
                    )
                else:
                    update_progress_artifact(self.progress_id, latest[0], description=latest[1])
            except Exception as error:  # progress is for humans: never worth failing a run over
                if away_since is None:
                    away_since = time.monotonic()
                    logger.warning("progress update failed (generation goes on) error=%s", error)
                continue
            finally:
                with self._lock:
                    if self._latest is None:
                        self._idle.set()
            if away_since is not None:
                logger.info(
                    "progress updates reach the Prefect API again after %.0f s", time.monotonic() - away_since
                )
                away_since = None


class GenerationProgressReporter:
    """The progress bar and the periodic progress line; a failed read or update never fails the run.

    ``started`` is when generation started (``time.monotonic()``): the report's generation wall time starts
    there too, so the tok/s shown here is the report's definition (:mod:`datagen.progress`).
    What Prefect 3.9.1's run page (``/v2``) shows of it: its Logs tab (the default) polls every 5 s while the
    run runs, so the progress line is what updates by itself; the Artifacts tab's card shows the artifact's
    figures as of when the tab was opened (switching tabs or reloading fetches them again). The header shows
    no state message, and a new Running state would count as another run attempt: nothing goes there.
    """

    def __init__(self, dispatcher: Dispatcher, started: float, cost: ServingCost | None = None) -> None:
        self.dispatcher = dispatcher
        self.started = started
        self.cost = cost
        self.last_report = 0.0
        self.last_watched = 0.0
        self.publisher = ProgressPublisher()
        self.publisher.publish(0.0, "**0.0%** · generation starting")

    def close(self) -> None:
        """Let the last update reach the API if it can, briefly (the run's end never waits on the API)."""
        self.publisher.close(PROGRESS_CLOSE_TIMEOUT_S)

    def report(
        self,
        answered: int,
        total: int,
        shards_done: int,
        shards_total: int,
        *,
        conversations: tuple[int, int] | None = None,
        force: bool = False,
    ) -> None:
        """Show how far generation is: the live view often, the log line and the artifact when due (or forced).

        ``conversations``: on-policy conversations over so far and of the run (None: the run has none).
        """
        now = time.monotonic()
        due = force or now - self.last_report >= get_settings().progress_interval_s
        if not due and now - self.last_watched < WATCHED_PROGRESS_INTERVAL_S:
            return
        self.last_watched = now
        logger = get_run_logger()
        try:
            stats = self.dispatcher.stats()
        except Exception as error:  # progress is for humans: never worth failing a run over
            if due:
                self.last_report = now
                logger.warning("progress read failed error=%s", error)
            return
        progress, description = progress_card(
            answered, total, stats, now - self.started, self.cost, conversations
        )
        report_progress(progress)
        if not due:
            return
        self.last_report = now
        self.publisher.publish(100.0 if force else progress.percent, description)
        logger.info(
            "progress %s | in_flight=%d queued=%d backlog=%d shards_done=%d/%d req/s=%.1f",
            progress.line(),
            sum(stats.in_flight.values()),
            stats.queued,
            stats.backlog,
            shards_done,
            shards_total,
            stats.requests_per_s,
        )
