"""A windowed run's watch over its dispatcher: admission stops in time for training to restart inside the window."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator

from prefect import get_run_logger

import datagen.app.history
import datagen.app.window_plan
from datagen.config import RunConfig
from datagen.generation.dispatcher import Dispatcher
from datagen.generation.window import WindowPolicy, WindowWatch
from datagen.settings import get_settings


def window_policy(config: RunConfig, halted_at: dt.datetime) -> WindowPolicy | None:
    """The run's admission policy from the halt at ``halted_at`` (None: no window), with this box's history."""
    history = datagen.app.history.read_history(get_settings().state_dir)
    policy = datagen.app.window_plan.window_policy(config, halted_at, history)
    if policy is not None:
        deadline = config.window.deadline(halted_at)
        get_run_logger().info(
            "window: training runs again by %s; admission stops about %.0f s before generation must end",
            deadline.isoformat(timespec="minutes") if deadline else "-",
            policy.drain_s,
        )
    return policy


@contextlib.contextmanager
def watch_window(policy: WindowPolicy | None, dispatcher: Dispatcher) -> Iterator[None]:
    """Apply ``policy`` to ``dispatcher`` for the block: stop admission in time, cut what is left at the end.

    A cut request resolves unfinished (nothing is written for it); its shard ends with the window, not failed.
    """
    if policy is None:
        yield
        return
    watch = WindowWatch(
        policy,
        stop_admission=dispatcher.stop_admission,
        cut=dispatcher.close,
        in_flight=lambda: sum(dispatcher.stats().in_flight.values()),
    )
    with watch:
        yield
