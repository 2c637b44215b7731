"""What a run cost the training job, from its attempts' records, and the box history record it leaves.

Each attempt that served records, beside its halt and restart records, when the GPUs were taken from
training and when they were handed back, and how long each step between took (:class:`ServingTimes`).
:func:`account_run` sums them over every attempt into the report's :class:`RunAccounting` (GPU-hours,
training paused, the share in which the GPUs generated), beside the preview's estimate stored with the first
attempt's preflight. :func:`history_record` turns the finished run into the box's history record, so the next
preview of the same model on this box starts from what was measured here.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from datagen.app.history import BoxRecord, DatasetAnswers, plan_key
from datagen.app.preview import SECONDS_PER_HOUR, CostPreview
from datagen.config import RunConfig
from datagen.dataset.report import GENERATION_RECORD, GenerationWindow, RunAccounting, RunReport
from datagen.host.plan import ServerPlan
from datagen.output.layout import RunLayout
from datagen.output.store import Store
from datagen.records import utc_now

logger = logging.getLogger(__name__)

# The attempt records this module reads (written by the serving sequence and the flow, by these names).
SERVING_TIMES_RECORD = "serving-times.json"
PLAN_RECORD = "plan.json"
PREFLIGHT_RECORD = "preflight.json"


class ServingTimes(BaseModel):
    """When one attempt took the GPUs from training and gave them back, and what each step took."""

    model_config = ConfigDict(extra="forbid")

    halted_at: dt.datetime = Field(description="The halt of training began (UTC).")
    handed_back_at: dt.datetime | None = Field(
        default=None, description="Training restarted, or the GPUs freed."
    )
    training_halt_s: float | None = Field(default=None, ge=0)
    fleet_start_s: float | None = Field(default=None, ge=0)
    fleet_stop_s: float | None = Field(default=None, ge=0)
    training_restart_s: float | None = Field(default=None, ge=0)
    training_halted: bool = Field(default=True, description="False: no training job was configured.")

    @property
    def held_s(self) -> float:
        """How long the attempt held the GPUs (until now while it still holds them)."""
        end = self.handed_back_at or utc_now()
        return max(0.0, (end - self.halted_at).total_seconds())


def _attempt_records(store: Store, layout: RunLayout, name: str) -> dict[str, Any]:
    """Each attempt's record ``name``, by attempt id, oldest attempt first."""
    records: dict[str, Any] = {}
    # One level (attempts/<attempt>/), whole keys only: nothing nested deeper is read as an attempt's record.
    for folder in sorted(store.list_level(layout.attempts_prefix).folders):
        key = f"{folder}/{name}"
        if store.exists(key):
            records[folder.rstrip("/").rsplit("/", 1)[-1]] = store.read_json(key)
    return records


def stored_preview(store: Store, layout: RunLayout) -> CostPreview | None:
    """The preview stored with the run's first attempt's preflight (None before previews were stored)."""
    for value in _attempt_records(store, layout, PREFLIGHT_RECORD).values():
        preview = value.get("preview") if isinstance(value, dict) else None
        if preview:
            try:
                return CostPreview.model_validate(preview)
            except ValidationError as error:
                logger.warning("stored preview unreadable error=%s", error)
    return None


# A multi-host run's boxes record under the parent attempt's folder as ``host-<host>-<record>`` (flows/host_part.py).
HOST_RECORD_PREFIX = "host-"


@dataclass(frozen=True)
class _Served:
    """One box's serving in one attempt: its times and the GPUs its plan held (0: no plan recorded)."""

    attempt: str
    host: str
    times: ServingTimes
    gpus: int


def _plan_gpus(value: Any) -> int:
    return sum(len(server.gpu_ids) for server in ServerPlan.model_validate(value).servers)


def _served(store: Store, layout: RunLayout) -> list[_Served]:
    """Every box's serving times in every attempt, each with the GPUs of its plan.

    ``serving-times.json`` of a run on one box; each host's ``host-<host>-serving-times.json`` on several.
    """
    found: list[_Served] = []
    # One level (attempts/<attempt>/), whole keys only: nothing nested deeper is read as an attempt's record.
    for folder in sorted(store.list_level(layout.attempts_prefix).folders):
        attempt = folder.rsplit("/", 1)[-1]
        names = {key.rsplit("/", 1)[-1] for key in store.list_level(folder).objects}
        for name in sorted(names):
            if name == SERVING_TIMES_RECORD:
                host = ""
            elif name.startswith(HOST_RECORD_PREFIX) and name.endswith(f"-{SERVING_TIMES_RECORD}"):
                host = name[len(HOST_RECORD_PREFIX) : -len(f"-{SERVING_TIMES_RECORD}")]
            else:
                continue
            plan = f"{HOST_RECORD_PREFIX}{host}-{PLAN_RECORD}" if host else PLAN_RECORD
            times = ServingTimes.model_validate(store.read_json(f"{folder}/{name}"))
            gpus = _plan_gpus(store.read_json(f"{folder}/{plan}")) if plan in names else 0
            found.append(_Served(attempt=attempt, host=host, times=times, gpus=gpus))
    # A box that halted training and failed before its plan was recorded still held its GPUs: count them as
    # the most that box's plans held in other attempts.
    most = {item.host: max(other.gpus for other in found if other.host == item.host) for item in found}
    return [item if item.gpus else replace(item, gpus=most[item.host]) for item in found]


def _paused_s(served: list[_Served]) -> float:
    """How long training was stopped: per attempt, the time any of its boxes held the GPUs; summed over attempts.

    On one box this is each attempt's halt to restart. A multi-host attempt's boxes halt and hand back at
    about the same times: their overlapping holds count once (the union of the intervals), not once per box.
    """
    total = 0.0
    for attempt in sorted({item.attempt for item in served}):
        now = utc_now()
        spans = sorted(
            (item.times.halted_at, item.times.handed_back_at or now)
            for item in served
            if item.attempt == attempt
        )
        start, end = spans[0]
        for begin, finish in spans[1:]:
            if begin > end:
                total += max(0.0, (end - start).total_seconds())
                start, end = begin, finish
            else:
                end = max(end, finish)
        total += max(0.0, (end - start).total_seconds())
    return total


def account_run(store: Store, layout: RunLayout, output_tokens: int) -> RunAccounting | None:
    """The run's cost over every attempt and box (None when no box served: nothing was paused).

    GPU-hours sum each box's GPUs times the time it held them, over every attempt; ``gpus`` is the most GPUs the
    run held at once (every box of an attempt together); training paused counts the time any box held its
    GPUs once (:func:`_paused_s`).

    Args:
        store: The run's store.
        layout: The run's layout.
        output_tokens: Output tokens of every completion of the run.
    """
    served = _served(store, layout)
    if not served:
        return None
    per_attempt: dict[str, int] = {}
    for item in served:
        per_attempt[item.attempt] = per_attempt.get(item.attempt, 0) + item.gpus
    gpus = max(per_attempt.values())
    windows = [
        GenerationWindow.model_validate(value)
        for value in _attempt_records(store, layout, GENERATION_RECORD).values()
    ]
    held_s = _paused_s(served)
    generation_s = sum(window.wall_s for window in windows)
    gpu_hours = sum(item.gpus * item.times.held_s for item in served) / SECONDS_PER_HOUR
    preview = stored_preview(store, layout)
    return RunAccounting(
        gpus=gpus,
        gpu_hours=gpu_hours,
        training_paused_s=held_s,
        generation_wall_s=generation_s,
        generating_share=min(1.0, generation_s / held_s) if held_s > 0 else None,
        output_tokens_per_gpu_hour=output_tokens / gpu_hours if gpu_hours > 0 else None,
        estimated_training_paused_s=preview.training_paused_s if preview else None,
        estimated_gpu_hours=preview.gpu_hours if preview else None,
        estimated_output_tokens_per_s=preview.output_tokens_per_s if preview else None,
    )


def _median_of(values: list[float | None]) -> float | None:
    known = sorted(value for value in values if value is not None)
    return known[len(known) // 2] if known else None


def history_record(config: RunConfig, store: Store, layout: RunLayout, report: RunReport) -> BoxRecord | None:
    """The box's history record of a finished run (None when it generated nothing on this box).

    Args:
        config: The run's config (model, engine, each dataset's max_tokens).
        store: The run's store.
        layout: The run's layout.
        report: The run's report (its counts, generation time and accounting).
    """
    plans = [
        ServerPlan.model_validate(value) for value in _attempt_records(store, layout, PLAN_RECORD).values()
    ]
    if not plans or report.generation_wall_s <= 0 or report.totals.completions == 0:
        return None
    plan = plans[-1]
    times = [
        ServingTimes.model_validate(value)
        for value in _attempt_records(store, layout, SERVING_TIMES_RECORD).values()
    ]
    answers = {
        item.dataset: DatasetAnswers(
            completions=item.completions,
            output_tokens=item.completion_tokens,
            max_tokens=config.max_tokens_for(config.dataset(item.dataset)),
        )
        for item in report.datasets
        if item.completions
    }
    accounting = report.accounting
    return BoxRecord(
        kind="run",
        run_id=report.run_id,
        model=config.model.path,
        engine=config.fleet.engine,
        plan=plan_key(plan.mode, len(plan.servers), plan.tensor_parallel),
        gpus=sum(len(server.gpu_ids) for server in plan.servers),
        output_tokens=report.totals.completion_tokens,
        generation_wall_s=report.generation_wall_s,
        output_tokens_per_s=report.output_tokens_per_s,
        answers=answers,
        training_halt_s=_median_of([item.training_halt_s for item in times]),
        fleet_start_s=_median_of([item.fleet_start_s for item in times]),
        fleet_stop_s=_median_of([item.fleet_stop_s for item in times]),
        training_restart_s=_median_of([item.training_restart_s for item in times]),
        training_paused_s=accounting.training_paused_s if accounting else None,
        estimated_hours_paused=(
            accounting.estimated_training_paused_s / SECONDS_PER_HOUR
            if accounting and accounting.estimated_training_paused_s is not None
            else None
        ),
    )
