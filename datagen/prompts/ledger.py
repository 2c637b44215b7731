"""The prompt ledger of an expansion series: which prompts each run of the series took, written once per run.

A *series* (``RunConfig.series``, e.g. ``nightly``) is a chain of runs that grows one dataset: every run
takes prompts no earlier run of the series took, and publishes dataset version N+1 on top of version N.
Keys, relative to the output root::

    runs/<run_id>/series.json                 SeriesEntry: the earlier runs this run excludes and the base
                                              version it extends; written once, before any prompt is chosen
    series/<series>/ledger/<run_id>.jsonl     one LedgerLine per prompt the run took; written once, after
                                              the run's prompts are prepared and before any GPU work

Why this cannot lose or double-count prompts across crashes: the entry fixes the run's inputs before
preparation, so a resumed run recomputes exactly the same prompts (and the same ledger bytes, which the
write-once store then accepts as its own); the ledger is written before generation, so a later run never
takes prompts of a run that crashed mid-generation (resume that run by its id to finish them). Two runs of
one series running at once on different hosts would both miss each other's ledger: :func:`write_ledger`
detects the overlap and stops the later one before it generates anything.

A run of the series is *open* from its ledger until its manifest exists: it took prompts it has not published
yet (a window ended, it was interrupted, or it failed). :func:`find_open_series_run` names the oldest one, which
the series' next run continues (resumes by its run id) instead of taking new prompts.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections import Counter
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

from datagen.config import RunConfig
from datagen.dataset.merge_rounds import finished_rounds
from datagen.errors import OutputExistsError, SeriesConflictError
from datagen.output.layout import RunLayout, parse_series_ledger, series_ledger, series_ledger_prefix
from datagen.output.store import Store
from datagen.records import PreparedDataset, utc_now

logger = logging.getLogger(__name__)

LEDGER_SCHEMA_VERSION = 1


def series_entry_key(run_id: str) -> str:
    """Where a run records its place in its series."""
    return RunLayout(run_id).series_entry


def ledger_prefix(series: str) -> str:
    """The folder of a series' ledger files."""
    return series_ledger_prefix(series)


def ledger_key(series: str, run_id: str) -> str:
    """The ledger file of one run of a series."""
    return series_ledger(series, run_id)


class SeriesEntry(BaseModel):
    """A run's place in its series, fixed before its prompts are chosen (``runs/<run_id>/series.json``)."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = LEDGER_SCHEMA_VERSION
    series: str
    run_id: str
    earlier_runs: list[str] = Field(description="Runs of the series whose ledgers this run excludes.")
    base_version: str | None = Field(
        description="Dataset version this run's version extends: the series' last one, or the config's "
        "tokenize.base_version for the first run."
    )
    created_at: dt.datetime = Field(default_factory=utc_now)


class LedgerLine(BaseModel):
    """One prompt a run of a series took."""

    model_config = ConfigDict(extra="forbid")

    prompt_id: str
    dataset: str
    category: str


def _ledger_runs(store: Store, series: str) -> list[str]:
    # One level, whole keys only: nothing nested below the ledger folder counts as a run of the series.
    found = (parse_series_ledger(series, key) for key in store.list_level(ledger_prefix(series)).objects)
    return [run_id for run_id in found if run_id is not None]


def _published_version(store: Store, run_id: str) -> tuple[dt.datetime, str] | None:
    """When and under which key a run published its last dataset version (None: it published none yet).

    A run merged in rounds (a window ended it, its continuation published the rest) published one version per
    round, each on top of the one before: the last one holds all of them. A round whose every answer was dropped
    published none.
    """
    published = [summary for summary in finished_rounds(store, RunLayout(run_id)) if summary.dataset_version]
    if not published:
        return None
    return published[-1].created_at, str(published[-1].dataset_version)


def open_series_entry(store: Store, config: RunConfig) -> SeriesEntry:
    """Record (once) which earlier runs of the series this run excludes and which version it extends.

    Args:
        store: The run's output store.
        config: The run config; ``series`` and ``run_id`` must be set.

    Returns:
        The entry; the stored one when the run is resumed.
    """
    assert config.series is not None and config.run_id is not None, "series runs need a series and run id"
    key = series_entry_key(config.run_id)
    if store.exists(key):
        return SeriesEntry.model_validate(store.read_json(key))
    earlier = sorted(run for run in _ledger_runs(store, config.series) if run != config.run_id)
    published = [found for run in earlier if (found := _published_version(store, run)) is not None]
    base = max(published)[1] if published else config.tokenize.base_version
    entry = SeriesEntry(series=config.series, run_id=config.run_id, earlier_runs=earlier, base_version=base)
    try:
        store.write_json(key, entry)
    except OutputExistsError:
        return SeriesEntry.model_validate(store.read_json(key))
    logger.info(
        "series entry series=%s run_id=%s earlier_runs=%d base_version=%s",
        entry.series,
        entry.run_id,
        len(earlier),
        base,
    )
    return entry


def find_open_series_run(store: Store, series: str) -> str | None:
    """The series' oldest run that took prompts and has not published them yet (None: every run is complete).

    A run is open from its ledger (written before any GPU work) until its manifest (written last): a window
    that ended, an interruption or a failure left some of its prompts without a published answer. The series'
    next run continues it (the same run id, resumed: stored answers are not sent again) before any run takes
    new prompts, so the ledger, the category caps and the chain of versions stay those of one run after the
    other. The oldest first, by the time its series entry was opened.

    Args:
        store: The store of the series' output root.
        series: The series' name.
    """
    opened: list[tuple[dt.datetime, str]] = []
    for run_id in _ledger_runs(store, series):
        if store.exists(RunLayout(run_id).manifest):
            continue
        entry = read_series_entry(store, run_id)
        # A ledger without its entry is no run this code wrote (the entry is written first): never continued.
        if entry is not None and entry.series == series:
            opened.append((entry.created_at, run_id))
    if not opened:
        return None
    run_id = min(opened)[1]
    logger.info("series run open series=%s run_id=%s open_runs=%d", series, run_id, len(opened))
    return run_id


def read_series_entry(store: Store, run_id: str) -> SeriesEntry | None:
    """The stored entry of a run (None: the run is not part of a series, or has not opened it yet)."""
    key = series_entry_key(run_id)
    return SeriesEntry.model_validate(store.read_json(key)) if store.exists(key) else None


def _iter_ledger(store: Store, series: str, run_ids: Iterable[str]) -> Iterable[LedgerLine]:
    for run_id in run_ids:
        for line in store.iter_jsonl(ledger_key(series, run_id)):
            yield LedgerLine.model_validate(line)


def taken_prompt_ids(store: Store, entry: SeriesEntry) -> set[str]:
    """Every prompt id the earlier runs of the entry's series took."""
    return {line.prompt_id for line in _iter_ledger(store, entry.series, entry.earlier_runs)}


def held_by_category(store: Store, entry: SeriesEntry) -> dict[str, int]:
    """Prompts per mix category the series held before this run (what the category caps count)."""
    return dict(Counter(line.category for line in _iter_ledger(store, entry.series, entry.earlier_runs)))


def write_ledger(
    store: Store, config: RunConfig, entry: SeriesEntry, prepared: Iterable[PreparedDataset]
) -> str:
    """Write the run's ledger once (byte-identical on a resume), then refuse an overlap with a parallel run.

    Args:
        store: The run's output store.
        config: The run config (dataset categories).
        entry: The run's series entry.
        prepared: Every prepared dataset of the run.

    Returns:
        The ledger's URL.

    Raises:
        SeriesConflictError: A run of the series that this run did not exclude took some of the same
            prompts (the two ran at once), or a stored ledger of this run differs from its prompts.
    """
    lines: list[LedgerLine] = []
    for item in prepared:
        category = config.dataset(item.dataset).mix_category
        for shard in item.shards:
            for record in store.iter_jsonl(shard.path):
                lines.append(
                    LedgerLine(prompt_id=str(record["prompt_id"]), dataset=item.dataset, category=category)
                )
    lines.sort(key=lambda line: (line.dataset, line.prompt_id))
    data = "".join(line.model_dump_json() + "\n" for line in lines).encode()
    key = ledger_key(entry.series, entry.run_id)
    try:
        store.write_bytes(key, data)
    except OutputExistsError:
        if store.read_bytes(key) != data:
            raise SeriesConflictError(
                f"The ledger {store.url(key)} of run {entry.run_id} lists other prompts than the run prepared; "
                "the run's prompt files were changed. Start a new run id.",
                run_id=entry.run_id,
            ) from None
    mine = {line.prompt_id for line in lines}
    others = [
        run
        for run in _ledger_runs(store, entry.series)
        if run != entry.run_id and run not in entry.earlier_runs
    ]
    for other in others:
        overlap = mine & {line.prompt_id for line in _iter_ledger(store, entry.series, [other])}
        if overlap:
            raise SeriesConflictError(
                f"Runs {entry.run_id} and {other} of series {entry.series!r} took {len(overlap)} of the same "
                f"prompts: they ran at the same time (runs of one series must not overlap; every GPU box "
                "takes one run at a time, but two boxes can share a series). Nothing was generated by this "
                "run: start it again under a new run id (it then excludes the other run's prompts), and keep "
                "one series on one GPU box or schedule its runs apart.",
                run_id=entry.run_id,
                other_run_id=other,
            )
    logger.info(
        "series ledger written series=%s run_id=%s prompts=%d", entry.series, entry.run_id, len(lines)
    )
    return store.url(key)
