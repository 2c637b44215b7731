"""When a windowed run stops admitting requests, so that training runs again before its window ends.

A window (``window:`` of the config) bounds the time from the halt of training to its restart. After the last
answer the fleet must still stop and training restart, and every request admitted must have time to finish: a
request admitted just before admission stops may be one of the longest answers. So admission stops at

    end of window - (fleet stop + training restart) - drain allowance

where the drain allowance is a high quantile of the answer durations measured so far in this run (before the
first answers, the caller's estimate). Requests still in flight when generation must end are cut and recorded as
unfinished by the dispatcher (never half-written); the next attempt sends them again.

:class:`WindowPolicy` decides (pure, any clock); :class:`WindowWatch` applies it to a dispatcher on a thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from datagen.errors import WindowClosingError

logger = logging.getLogger(__name__)

# The drain allowance is this quantile of recent answer durations: the longest answers (capped by
# max_tokens) finish; a rarer one still running at the end is cut and sent again by the next attempt.
DRAIN_QUANTILE = 0.99
# Answers the quantile is taken over: recent enough to follow a fleet that slows down as it fills.
RECENT_ANSWERS = 2000
# Answers measured before the measured quantile replaces the caller's estimate.
MIN_MEASURED_ANSWERS = 50
# How often the watch compares the clock with the policy, in seconds: small against any window.
WATCH_INTERVAL_S = 0.05


class WindowPolicy:
    """When admission stops and when generation ends, for one attempt with a window.

    Args:
        generation_end: The clock time (the caller's clock, e.g. ``time.monotonic()``) by which the last answer
            must be in: the window's end minus the measured (or default) times of stopping the fleet and
            restarting training.
        initial_answer_s: The expected duration of a long answer before any is measured (e.g. max_tokens over
            the per-request decode rate).
        quantile: The quantile of measured answer durations that must fit in the drain.
    """

    def __init__(
        self, *, generation_end: float, initial_answer_s: float, quantile: float = DRAIN_QUANTILE
    ) -> None:
        if not 0 < quantile <= 1:
            raise ValueError("quantile must be in (0, 1]")
        self.generation_end = generation_end
        self.initial_answer_s = initial_answer_s
        self.quantile = quantile
        self._recent: deque[float] = deque(maxlen=RECENT_ANSWERS)
        self._lock = threading.Lock()

    def observe_answer(self, duration_s: float) -> None:
        """Count one answered request's duration (from admission to its answer), from any thread."""
        with self._lock:
            self._recent.append(duration_s)

    @property
    def drain_s(self) -> float:
        """The time kept free at the end for the requests in flight to finish."""
        with self._lock:
            recent = sorted(self._recent)
        if len(recent) < MIN_MEASURED_ANSWERS:
            return self.initial_answer_s
        return recent[min(len(recent) - 1, int(self.quantile * len(recent)))]

    @property
    def admission_end(self) -> float:
        """The clock time after which no new request is admitted."""
        return self.generation_end - self.drain_s

    def admitting(self, now: float) -> bool:
        """New requests may still be sent at ``now``."""
        return now < self.admission_end

    def cut(self, now: float) -> bool:
        """Generation must end at ``now``: what is still in flight is cut."""
        return now >= self.generation_end


class WindowWatch:
    """Applies a :class:`WindowPolicy` on a thread: stops admission in time, then cuts what is left.

    Args:
        policy: The policy.
        stop_admission: Called once when admission must stop (e.g. ``Dispatcher.stop_admission``).
        cut: Called once at the end of generation when requests are still in flight (e.g. closing the
            dispatcher: what is pending resolves unfinished, nothing is written for it).
        in_flight: How many requests are in flight now (the cut is skipped when none is).
        clock: The policy's clock.
    """

    def __init__(
        self,
        policy: WindowPolicy,
        *,
        stop_admission: Callable[[Exception], None],
        cut: Callable[[], None],
        in_flight: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self._stop_admission = stop_admission
        self._cut = cut
        self._in_flight = in_flight
        self._clock = clock
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="datagen-window", daemon=True)
        self.admission_stopped_at: float | None = None
        self.cut_at: float | None = None

    def __enter__(self) -> WindowWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(WATCH_INTERVAL_S):
            now = self._clock()
            if self.admission_stopped_at is None and not self.policy.admitting(now):
                self.admission_stopped_at = now
                logger.info(
                    "window closing: admission stopped drain_s=%.1f in_flight=%d",
                    self.policy.drain_s,
                    self._in_flight(),
                )
                self._stop_admission(WindowClosingError("the generation window is closing"))
            if self.policy.cut(now):
                if self._in_flight():
                    self.cut_at = now
                    logger.warning("window closed: cutting in_flight=%d", self._in_flight())
                    self._cut()
                return
