"""The result of ``datagen tune`` (:mod:`datagen.app.tune`): a throughput curve and the best in-flight count.

It lives with the engines because the in-flight cap's owner (:mod:`datagen.engines.capacity`) reads it back
(``fleet.tune_result``).
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field

from datagen.records import Record

# A level losing more than this share of its requests is not a candidate: the server is overloaded or
# failing. Below it, failures are the engine's own noise (transformers serve answers HTTP 500 to a few
# random-weight outputs at any load) and must not hide a level that is much faster.
MAX_FAILED_SHARE = 0.01
# The best level is the largest one tried and beat the one before by more than this: the curve has not
# flattened, so larger levels may be faster still.
STILL_RISING_GAIN = 1.05


class TunePoint(Record):
    """One level of the sweep."""

    inflight_per_server: int
    setting: int | None = Field(default=None, description="Value of the restart sweep's flag, if any.")
    requests: int
    failed: int = 0
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    median_latency_s: float | None = None
    server_metrics: dict[str, float] = Field(
        default_factory=dict, description="Means over the level of the engine's gauges (sglang /metrics)."
    )

    @property
    def disqualified(self) -> bool:
        """Too many failed requests (over :data:`MAX_FAILED_SHARE`) to recommend this level."""
        return self.failed > MAX_FAILED_SHARE * max(self.requests, 1)


class TuneResult(Record):
    """The sweep and its recommendation; ``fleet.tune_result`` reads this file."""

    engine: str
    urls: list[str]
    max_tokens: int
    best_inflight_per_server: int
    best_output_tokens_per_s: float
    curve: list[TunePoint]
    measured_with: str = Field(description="'client' or 'client+/metrics'.")
    setting_flag: str | None = Field(
        default=None, description="Flag swept by restarting one server (e.g. --max-running-requests)."
    )
    best_setting: int | None = Field(default=None, description="Best value of setting_flag.")
    setting_curve: list[TunePoint] = Field(default_factory=list, description="One point per restart.")

    def to_table(self) -> str:
        """The curve as an aligned text table, best row marked."""
        header = f"{'in flight/server':>16} {'tok/s':>10} {'req':>5} {'fail':>4} {'p50 s':>7}  metrics"
        rows = [header]
        for point in self.curve:
            mark = " <- best" if point.inflight_per_server == self.best_inflight_per_server else ""
            if point.disqualified:
                mark = f" (not a candidate: {point.failed} of {point.requests} failed)"
            gauges = " ".join(f"{key}={value:.3g}" for key, value in sorted(point.server_metrics.items()))
            latency = f"{point.median_latency_s:7.2f}" if point.median_latency_s is not None else "      -"
            rows.append(
                f"{point.inflight_per_server:>16} {point.output_tokens_per_s:>10.1f} {point.requests:>5} "
                f"{point.failed:>4} {latency}  {gauges}{mark}"
            )
        for point in self.setting_curve:
            mark = " <- best" if point.setting == self.best_setting else ""
            if point.disqualified:
                mark = f" (not a candidate: {point.failed} of {point.requests} failed)"
            rows.append(
                f"{self.setting_flag} {point.setting}: {point.output_tokens_per_s:.1f} tok/s at "
                f"{point.inflight_per_server} in flight, {point.failed} failed{mark}"
            )
        return "\n".join(rows)

    @property
    def still_rising(self) -> bool:
        """The best level is the largest tried and clearly beat the one below it: try larger levels."""
        levels = sorted(self.curve, key=lambda point: point.inflight_per_server)
        if len(levels) < 2 or levels[-1].inflight_per_server != self.best_inflight_per_server:
            return False
        return levels[-1].output_tokens_per_s > STILL_RISING_GAIN * levels[-2].output_tokens_per_s


def load_tune_result(path: str | Path) -> TuneResult:
    """Read a ``datagen tune --output`` file (for ``fleet.tune_result``)."""
    return TuneResult.model_validate(json.loads(Path(path).read_text(encoding="utf-8")))
