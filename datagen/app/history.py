"""The box's own history: one small record per finished run and per ``datagen tune``, kept on the host.

The cost preview (:mod:`datagen.app.preview`) learns from it what this box measured before: the output rate of
a model on an engine and plan, the mean answer length of a model on a dataset, and how long halting training,
starting the fleet, stopping it and restarting training took. Each record is its own file, created exclusively
under ``<state_dir>/history/`` with a unique name, so concurrent runs append without a lock and a record, once
written, never changes (a half-written file never appears: the record is written aside and linked in).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError

from datagen.engines.tune_result import TuneResult
from datagen.records import Record, utc_now

logger = logging.getLogger(__name__)

HISTORY_DIR_NAME = "history"
RECORD_SUFFIX = ".json"

HistoryKind = Literal["run", "tune"]


class DatasetAnswers(Record):
    """What one dataset's answers measured in one run."""

    completions: int = Field(ge=0)
    output_tokens: int = Field(ge=0)
    max_tokens: int | None = Field(default=None, description="The dataset's max_tokens in that run.")

    @property
    def mean_tokens(self) -> float | None:
        """Mean output tokens per answer (None without answers)."""
        return self.output_tokens / self.completions if self.completions else None


class BoxRecord(Record):
    """One run or tune of this box, as the preview reads it back."""

    schema_version: Literal[1] = 1
    kind: HistoryKind
    recorded_at: dt.datetime = Field(default_factory=utc_now)
    run_id: str | None = None
    model: str = Field(description="The model as the config names it (`model.path`).")
    engine: str
    plan: str = Field(description="The fleet's shape, e.g. `dp 8 x tp 1` (:func:`plan_key`).")
    gpus: int = Field(default=0, ge=0, description="GPUs the fleet held (0: a CPU fleet).")
    output_tokens: int = Field(default=0, ge=0)
    generation_wall_s: float = Field(default=0.0, ge=0)
    output_tokens_per_s: float = Field(
        ge=0, description="Output tokens over generation wall time, whole fleet."
    )
    answers: dict[str, DatasetAnswers] = Field(
        default_factory=dict, description="Per dataset name: answers and their output tokens."
    )
    training_halt_s: float | None = Field(default=None, ge=0, description="Halting training took this long.")
    fleet_start_s: float | None = Field(default=None, ge=0, description="Starting the fleet until ready.")
    fleet_stop_s: float | None = Field(default=None, ge=0, description="Stopping every server.")
    training_restart_s: float | None = Field(default=None, ge=0, description="Handing the GPUs back.")
    training_paused_s: float | None = Field(
        default=None, ge=0, description="Training stopped (halt to restart), when training was halted."
    )
    estimated_hours_paused: float | None = Field(
        default=None, ge=0, description="What the preview estimated before the run, for comparison."
    )


def plan_key(mode: str, servers: int, tensor_parallel: int) -> str:
    """The fleet's shape as the history keys rates by: the same model on another shape runs at another rate."""
    return f"{mode} {servers} x tp {tensor_parallel}"


def history_dir(state_dir: str | Path) -> Path:
    """Where this box keeps its history (host-local, beside the fleets' folders)."""
    return Path(state_dir).expanduser() / HISTORY_DIR_NAME


def append_record(state_dir: str | Path, record: BoxRecord) -> Path:
    """Add ``record`` to the box's history, safely beside concurrent writers.

    The record is written to a private temporary file, then hard-linked under its final, unique name (which
    fails rather than replaces when the name exists), so a reader never sees a partial record.

    Returns:
        The record's file.
    """
    folder = history_dir(state_dir)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = record.recorded_at.strftime("%Y%m%dT%H%M%S%fZ")
    name = f"{stamp}-{record.kind}-{uuid.uuid4().hex[:12]}{RECORD_SUFFIX}"
    final = folder / name
    temporary = folder / f".{name}.tmp"
    temporary.write_text(record.model_dump_json(), encoding="utf-8")
    try:
        os.link(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)
    logger.info("box history appended kind=%s model=%s path=%s", record.kind, record.model, final)
    return final


def read_history(state_dir: str | Path) -> list[BoxRecord]:
    """Every readable record of the box, oldest first (a record of another schema is skipped, with a warning)."""
    folder = history_dir(state_dir)
    if not folder.is_dir():
        return []
    records: list[BoxRecord] = []
    for path in sorted(folder.glob(f"*{RECORD_SUFFIX}")):
        if path.name.startswith("."):
            continue
        try:
            records.append(BoxRecord.model_validate_json(path.read_text(encoding="utf-8")))
        except (OSError, ValidationError) as error:
            logger.warning("box history record skipped path=%s error=%s", path, error)
    return sorted(records, key=lambda record: record.recorded_at)


def tune_record(result: TuneResult, model: str) -> BoxRecord:
    """The history record of a ``datagen tune``: its best rate over the servers it measured."""
    best = next(
        (point for point in result.curve if point.inflight_per_server == result.best_inflight_per_server),
        None,
    )
    return BoxRecord(
        kind="tune",
        model=model,
        engine=result.engine,
        plan=f"tune {len(result.urls)} server(s)",
        output_tokens=best.output_tokens if best else 0,
        generation_wall_s=best.wall_s if best else 0.0,
        output_tokens_per_s=result.best_output_tokens_per_s,
    )


def matching(records: Iterable[BoxRecord], model: str | set[str], engine: str) -> list[BoxRecord]:
    """The records of ``model`` (a name or any of several: a path and a served name) on ``engine``, oldest first."""
    names = {model} if isinstance(model, str) else model
    return [record for record in records if record.model in names and record.engine == engine]
