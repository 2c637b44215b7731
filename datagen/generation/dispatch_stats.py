"""The dispatcher's progress counters and the snapshot other threads read without waiting for the loop.

Every counter is a plain int or float written only by the loop thread; :func:`snapshot` copies them from
any thread, so a saturated dispatcher cannot make a progress read fail or stall.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from datagen.generation.dispatch_admission import Admission
from datagen.generation.dispatch_state import DispatcherStats, ServerState, ServerStats
from datagen.progress import output_tokens_per_s

# Copying the server table races the loop adding or removing a server; a few tries always get one copy.
COPY_TRIES = 3


@dataclass
class Counters:
    """Fleet-wide totals (loop thread writes, any thread reads)."""

    first_dispatch_at: float | None = None
    last_result_at: float | None = None
    dispatched: int = 0
    completed: int = 0
    failed: int = 0
    unfinished: int = 0
    retries: int = 0
    output_tokens: int = 0


def snapshot(servers: dict[str, ServerState], admission: Admission, counters: Counters) -> DispatcherStats:
    """The counters now, with per-server state and throughput since the first request was dispatched."""
    table: list[ServerState] = []
    for _ in range(COPY_TRIES):
        try:
            table = list(servers.values())
            break
        except RuntimeError:  # the loop added or removed a server while we copied
            continue
    elapsed_s = 0.0
    first = counters.first_dispatch_at
    if first is not None:
        busy = admission.admitted or admission.backlog
        end = time.monotonic() if busy else (counters.last_result_at or time.monotonic())
        elapsed_s = max(end - first, 0.0)
    resolved = counters.completed + counters.failed + counters.unfinished
    return DispatcherStats(
        servers=[
            ServerStats(
                url=s.url,
                up=s.up,
                in_flight=len(s.in_flight),
                dispatched=s.dispatched,
                completed=s.completed,
            )
            for s in table
        ],
        backlog=admission.backlog,
        queued=len(admission.queue),
        backing_off=admission.backing_off,
        dispatched=counters.dispatched,
        completed=counters.completed,
        failed=counters.failed,
        unfinished=counters.unfinished,
        retries=counters.retries,
        output_tokens=counters.output_tokens,
        tokens_per_s=output_tokens_per_s(counters.output_tokens, elapsed_s),
        requests_per_s=resolved / elapsed_s if elapsed_s > 0 else 0.0,
    )
