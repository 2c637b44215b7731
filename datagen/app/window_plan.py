"""A windowed run's admission policy, made when training is halted: the window's end less what comes after.

The window (``window:``) ends when training must run again. Generation must end earlier by the time the box
takes to stop its fleet and restart training (this box's measured medians from its history, else the preview's
named defaults), and admission earlier still by the drain allowance (:mod:`datagen.generation.window`).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Sequence

from datagen.app.history import BoxRecord, matching
from datagen.app.preview import run_overheads
from datagen.config import RunConfig
from datagen.generation.window import WindowPolicy

# Decode rate of one request before any answer is measured, in tokens per second: low for a long answer of a
# 27B-class model on a full fleet, so the first drain allowance is generous (the measured quantile replaces it
# after the first answers).
ASSUMED_REQUEST_TOKENS_PER_S = 20.0


def window_policy(
    config: RunConfig,
    halted_at: dt.datetime,
    history: Sequence[BoxRecord],
    *,
    now: dt.datetime | None = None,
    clock_now: float | None = None,
) -> WindowPolicy | None:
    """The admission policy of a run that halted training at ``halted_at``; None when its window is unbounded.

    Args:
        config: The run's config (its ``window``, model, engine and largest ``max_tokens``).
        halted_at: When the halt of training began (timezone-aware).
        history: The box's records (:func:`datagen.app.history.read_history`): the measured fleet stop and
            training restart of earlier runs of the same model and engine.
        now: The wall clock now (default: now).
        clock_now: ``time.monotonic()`` at ``now`` (default: now): the policy runs on the monotonic clock.
    """
    deadline = config.window.deadline(halted_at)
    if deadline is None:
        return None
    now = now or dt.datetime.now(dt.UTC)
    clock_now = time.monotonic() if clock_now is None else clock_now
    names = {config.model.path, *([config.model.served_name] if config.model.served_name else [])}
    overheads = run_overheads(config, matching(history, names, config.fleet.engine))
    generation_end = clock_now + (deadline - now).total_seconds() - overheads.after_generation_s
    longest_tokens = max(config.sampling_for(dataset).max_tokens for dataset in config.datasets)
    initial_answer_s = min(config.generation.request_timeout_s, longest_tokens / ASSUMED_REQUEST_TOKENS_PER_S)
    return WindowPolicy(generation_end=generation_end, initial_answer_s=initial_answer_s)
