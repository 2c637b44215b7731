"""Series tasks: fix a run's place in its expansion series, and record the prompts it took."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

import datagen.output.runs
import datagen.prompts.ledger
from datagen.config import RunConfig
from datagen.output.runs import RunHandle
from datagen.output.s3_client import S3Credentials
from datagen.prompts.ledger import SeriesEntry
from datagen.records import PreparedDataset
from tasks.common import TRANSIENT_RETRIES


@task(
    name="open-series-entry",
    task_run_name="open-series-entry-{config.series}",
    cache_policy=NO_CACHE,
    **TRANSIENT_RETRIES,
)
def open_series_entry(
    config: RunConfig, run: RunHandle, *, credentials: S3Credentials | None = None
) -> SeriesEntry:
    """Record once which earlier runs of the series this run excludes and which version it extends."""
    store = datagen.output.runs.open_store(config, credentials)
    entry = datagen.prompts.ledger.open_series_entry(store, config)
    get_run_logger().info(
        "series=%s run_id=%s earlier_runs=%s base_version=%s",
        entry.series,
        run.run_id,
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
def write_ledger(
    config: RunConfig,
    run: RunHandle,
    entry: SeriesEntry,
    prepared: list[PreparedDataset],
    *,
    credentials: S3Credentials | None = None,
) -> str:
    """Write the run's prompt ledger once, before any GPU work; refuse an overlap with a parallel run."""
    store = datagen.output.runs.open_store(config, credentials)
    url = datagen.prompts.ledger.write_ledger(store, config, entry, prepared)
    get_run_logger().info("series ledger run_id=%s url=%s", run.run_id, url)
    return url
