"""Series tasks: fix a run's place in its expansion series, and record the prompts it took."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

import datagen.prompts.ledger
from datagen.prompts.ledger import SeriesEntry
from datagen.records import PreparedDataset
from tasks.common import TRANSIENT_RETRIES
from tasks.context import RunContext


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
