"""A windowed run's policy: the window's end, less this box's measured stop and restart, on the monotonic clock."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from datagen.app.history import BoxRecord
from datagen.app.preview import DEFAULT_FLEET_STOP_S, DEFAULT_TRAINING_RESTART_S
from datagen.app.window_plan import ASSUMED_REQUEST_TOKENS_PER_S, window_policy
from datagen.config import RunConfig

HALTED = dt.datetime(2026, 12, 6, 1, 0, tzinfo=dt.UTC)


def _config(tmp_path: Path, window: dict[str, object] | None, *, launched: bool = False) -> RunConfig:
    """External servers and no training job; ``launched``: servers the run starts and a trainer it restarts."""
    data: dict[str, object] = {
        "model": {"path": str(tmp_path / "model")},
        "fleet": {"engine": "external", "external_urls": ["http://127.0.0.1:30000"]},
        "sampling": {"max_tokens": 400},
        "datasets": [{"name": "a", "format": "openai_messages", "path": str(tmp_path / "a.jsonl")}],
        "output": str(tmp_path / "out"),
        "training": {"kind": "none"},
    }
    if launched:
        data["fleet"] = {"engine": "sglang"}
        data["training"] = {
            "kind": "pidfile",
            "pidfile": str(tmp_path / "trainer.pid"),
            "restart_after_run": True,
            "restart_command": ["true"],
        }
    if window is not None:
        data["window"] = window
    return RunConfig.model_validate(data)


def _record(tmp_path: Path, stop_s: float, restart_s: float, engine: str = "sglang") -> BoxRecord:
    return BoxRecord(
        kind="run",
        model=str(tmp_path / "model"),
        engine=engine,
        plan="external 1 x tp 1",
        output_tokens_per_s=1.0,
        fleet_stop_s=stop_s,
        training_restart_s=restart_s,
    )


def test_an_unbounded_window_has_no_policy(tmp_path: Path) -> None:
    assert window_policy(_config(tmp_path, None), HALTED, []) is None


def test_generation_ends_before_the_window_by_the_measured_stop_and_restart(tmp_path: Path) -> None:
    config = _config(tmp_path, {"max_hours": 6}, launched=True)
    now = HALTED + dt.timedelta(minutes=10)
    measured = window_policy(config, HALTED, [_record(tmp_path, 20.0, 40.0)], now=now, clock_now=1000.0)
    assert measured is not None
    assert measured.generation_end == 1000.0 + (6 * 3600 - 600) - 60.0
    # Another engine's records do not count: the preview's named defaults stand in.
    default = window_policy(
        config, HALTED, [_record(tmp_path, 20.0, 40.0, "external")], now=now, clock_now=1000.0
    )
    assert default is not None
    expected = 1000.0 + (6 * 3600 - 600) - (DEFAULT_FLEET_STOP_S + DEFAULT_TRAINING_RESTART_S)
    assert default.generation_end == expected


def test_a_run_that_stops_no_server_and_restarts_no_training_generates_until_the_window_ends(
    tmp_path: Path,
) -> None:
    # External servers stay up after the run, and no training job comes back: nothing to reserve after it.
    config = _config(tmp_path, {"max_hours": 6})
    now = HALTED + dt.timedelta(minutes=10)
    policy = window_policy(config, HALTED, [], now=now, clock_now=1000.0)
    assert policy is not None
    assert policy.generation_end == 1000.0 + (6 * 3600 - 600)


def test_the_first_drain_allowance_is_the_longest_answer_at_an_assumed_rate(tmp_path: Path) -> None:
    policy = window_policy(_config(tmp_path, {"until": "07:00", "time_zone": "UTC"}), HALTED, [])
    assert policy is not None
    assert policy.drain_s == 400 / ASSUMED_REQUEST_TOKENS_PER_S
    assert policy.admission_end == policy.generation_end - policy.drain_s
