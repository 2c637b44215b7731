"""The run report counts every attempt: throughput is all tokens over all generation time."""

from __future__ import annotations

from pathlib import Path

from datagen.config import RunConfig
from datagen.dataset.report import (
    GenerationWindow,
    build_report,
    generation_time_over_attempts,
    record_generation_window,
)
from datagen.output.layout import RunLayout
from datagen.output.store import Store
from datagen.records import ShardSummary


def _config(tmp_path: Path) -> RunConfig:
    return RunConfig.model_validate(
        {
            "run_id": "r-1",
            "model": {"path": "m"},
            "datasets": [{"name": "d", "format": "metamath", "path": "x.json"}],
            "output": str(tmp_path),
        }
    )


def _shard(index: int, tokens: int) -> ShardSummary:
    return ShardSummary(
        dataset="d",
        shard_index=index,
        requests=10,
        completions=10,
        failures=0,
        prompt_tokens=0,
        completion_tokens=tokens,
        generation_s=1.0,
        completions_path="c",
        failures_path="f",
    )


def test_a_resumed_run_reports_throughput_over_every_attempt(tmp_path: Path) -> None:
    store, layout = Store(str(tmp_path)), RunLayout("r-1")
    # The first attempt was interrupted after 30 s, the second finished in 10 s (and its rerun adds nothing).
    record_generation_window(store, layout, GenerationWindow(attempt_id="a1", wall_s=30.0, interrupted=True))
    record_generation_window(store, layout, GenerationWindow(attempt_id="a2", wall_s=10.0))
    record_generation_window(store, layout, GenerationWindow(attempt_id="a2", wall_s=99.0))
    wall_s, attempts = generation_time_over_attempts(store, layout)
    assert (wall_s, attempts) == (40.0, 2)
    report = build_report(
        run_id="r-1",
        config=_config(tmp_path),
        prepared=[],
        shards=[_shard(0, 3000), _shard(1, 1000)],
        tokenize_summary=None,
        servers=2,
        generation_wall_s=wall_s,
        generation_attempts=attempts,
        dataset_mix=[],
        mix_by_category=[],
    )
    assert report.output_tokens_per_s == 100.0
    assert "40.0 s** over 2 attempt(s)" in report.to_markdown()


def test_a_run_without_generation_records_sums_to_zero(tmp_path: Path) -> None:
    assert generation_time_over_attempts(Store(str(tmp_path)), RunLayout("r-1")) == (0.0, 0)
