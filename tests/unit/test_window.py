"""The generation window: its deadline from the config, and when admission stops so in-flight answers fit."""

from __future__ import annotations

import datetime as dt
import threading

import pytest

from datagen.config import WindowConfig, parse_run_config
from datagen.errors import ConfigError, WindowClosingError
from datagen.generation.window import MIN_MEASURED_ANSWERS, WindowPolicy, WindowWatch

UTC = dt.UTC


def test_the_deadline_is_the_earlier_of_the_length_and_the_next_time_of_day_in_the_zone() -> None:
    halted = dt.datetime(2026, 3, 1, 0, 0, tzinfo=UTC)  # 01:00 in Paris
    paris = WindowConfig(until="07:00", time_zone="Europe/Paris")
    assert paris.deadline(halted) == dt.datetime(2026, 3, 1, 6, 0, tzinfo=UTC)
    assert WindowConfig(max_hours=4, until="07:00", time_zone="Europe/Paris").deadline(
        halted
    ) == halted + dt.timedelta(hours=4)
    late = dt.datetime(2026, 3, 1, 7, 30, tzinfo=UTC)  # 08:30 in Paris: the next 07:00 is tomorrow's
    assert paris.deadline(late) == dt.datetime(2026, 3, 2, 6, 0, tzinfo=UTC)
    assert WindowConfig().deadline(halted) is None


@pytest.mark.parametrize(
    ("window", "message"),
    [({"until": "7am"}, "HH:MM"), ({"time_zone": "Mars/Olympus"}, "IANA"), ({"max_hours": 0}, "max_hours")],
)
def test_a_bad_window_is_refused_with_what_to_write(window: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_run_config(
            {
                "model": {"path": "/m"},
                "datasets": [{"name": "d", "format": "metamath", "path": "/d.json"}],
                "output": "/out",
                "window": window,
            }
        )


def test_a_window_leaves_the_run_identity_unchanged() -> None:
    base = {
        "model": {"path": "/m"},
        "datasets": [{"name": "d", "format": "metamath", "path": "/d.json"}],
        "output": "/o",
    }
    assert (
        parse_run_config(base).config_hash()
        == parse_run_config({**base, "window": {"max_hours": 6}}).config_hash()
    )


def test_admission_stops_a_measured_long_answer_before_the_end_of_generation() -> None:
    policy = WindowPolicy(generation_end=1000.0, initial_answer_s=300.0)
    assert policy.admission_end == 700.0  # before any answer: the caller's estimate
    for index in range(MIN_MEASURED_ANSWERS * 2):
        policy.observe_answer(10.0 + index)  # 10 .. 109 s
    assert policy.drain_s == pytest.approx(109.0, abs=1.0)  # the 99th percentile of what was measured
    assert policy.admitting(880.0) and not policy.admitting(900.0)
    assert not policy.cut(999.0) and policy.cut(1000.0)


def test_the_watch_stops_admission_once_then_cuts_only_what_is_still_in_flight() -> None:
    now = [0.0]
    stopped: list[Exception] = []
    cuts: list[float] = []
    in_flight = [3]
    done = threading.Event()
    policy = WindowPolicy(generation_end=10.0, initial_answer_s=4.0)

    def cut() -> None:
        cuts.append(now[0])
        done.set()

    with WindowWatch(
        policy, stop_admission=stopped.append, cut=cut, in_flight=lambda: in_flight[0], clock=lambda: now[0]
    ):
        for moment in (5.0, 6.0, 7.0, 10.0):
            now[0] = moment
            threading.Event().wait(0.2)
        assert done.wait(5)
    assert len(stopped) == 1 and isinstance(stopped[0], WindowClosingError)
    assert cuts == [10.0]
