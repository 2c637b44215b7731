"""Series tasks: continue a series' open run, fix a run's place in its series, and record the prompts it took."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

import datagen.app.run_request
import datagen.prompts.ledger
from datagen.app.run_request import ResolvedRun, RunRequest
from datagen.output.store import Store
from datagen.prompts.ledger import SeriesEntry
from datagen.records import PreparedDataset
from tasks.common import TRANSIENT_RETRIES
from tasks.context import RunContext


@task(
    name="continue-open-series-run",
    task_run_name="continue-open-series-run-{run.config.series}",
    cache_policy=NO_CACHE,
    **TRANSIENT_RETRIES,
)
def continue_open_series_run(
    run: ResolvedRun, request: RunRequest, folder: Path, store: Store
) -> ResolvedRun:
    """A series' new run made the continuation of the series' unfinished run, when the series has one."""
    continued = datagen.app.run_request.continue_open_series_run(run, request, folder, store)
    if continued.continues_series is not None:
        get_run_logger().info(
            "series=%s has an open run: continuing run_id=%s instead of taking new prompts (new run id %s unused)",
            continued.continues_series,
            continued.run_id,
            run.run_id,
        )
    return continued


@task(
    name="open-series-entry",
    task_run_name="open-series-entry-{context.config.series}",
    cache_policy=NO_CACHE,
    **TRANSIENT_RETRIES,
)
def open_series_entry(context: RunContext) -> SeriesEntry:
    """Record once which earlier runs of the series this run excludes and which version it extends."""
    entry = datagen.prompts.ledger.open_series_entry(context.store, context.config)
    get_run_logger().info(
        "series=%s run_id=%s earlier_runs=%s base_version=%s",
        entry.series,
        context.run_id,
        ",".join(entry.earlier_runs) or "none",
        entry.base_version,
    )
    return entry


@task(
    name="write-ledger",
    task_run_name="write-ledger-{entry.series}",
    cache_policy=NO_CACHE,
    **TRANSIENT_RETRIES,
)
def write_ledger(context: RunContext, entry: SeriesEntry, prepared: list[PreparedDataset]) -> str:
    """Write the run's prompt ledger once, before any GPU work; refuse an overlap with a parallel run."""
    url = datagen.prompts.ledger.write_ledger(context.store, context.config, entry, prepared)
    get_run_logger().info("series ledger run_id=%s url=%s", context.run_id, url)
    return url
