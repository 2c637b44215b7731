"""Run-level tasks: preflight, opening the run, the report and the manifest."""

from __future__ import annotations

import contextlib
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

import datagen.app.accounting
import datagen.app.history
import datagen.app.preflight
import datagen.app.preview
import datagen.dataset.report
import datagen.output.manifest
import datagen.output.runs
import datagen.prompts.mix
from datagen.app.preflight import Check, PreflightReport
from datagen.config import RunConfig
from datagen.dataset.report import RunReport
from datagen.errors import OutputExistsError
from datagen.host.training import HaltRecord, RestartRecord
from datagen.output.layout import RunLayout
from datagen.output.manifest import RunManifest
from datagen.output.runs import RunHandle, RunOrigin
from datagen.output.store import Store
from datagen.records import PreparedDataset, ShardSummary
from datagen.settings import get_settings
from tasks.common import TRANSIENT_RETRIES
from tasks.context import RunContext


@task(name="preflight", task_run_name="preflight-{config.run_id}", cache_policy=NO_CACHE)
def preflight(config: RunConfig, store: Store) -> PreflightReport:
    """Check everything that needs no GPU before training is stopped; fail with every problem listed.

    The output and s3:// datasets are checked with the run's store's credentials.
    """
    report = datagen.app.preflight.run_preflight(config, credentials=store.credentials)
    try:
        report.preview = datagen.app.preview.preview_on_this_box(config, count_unbounded=True)
    except Exception as error:  # an estimate never refuses a run
        get_run_logger().warning("cost preview unavailable error=%r", error)
    for line in report.preview.lines() if report.preview else []:
        get_run_logger().info("preview %s", line)
    create_markdown_artifact(
        report.to_markdown(), key="preflight", description="Checks run before halting training"
    )
    get_run_logger().info("preflight passed checks=%d", len(report.checks))
    return report


@task(name="check-prompts", task_run_name="check-prompts-{context.run_id}", cache_policy=NO_CACHE)
def check_prompts(context: RunContext, prepared: list[PreparedDataset], unprepared: dict[str, str]) -> Check:
    """Refuse the run, before training is halted, when a dataset yields fewer prompts than its minimum."""
    check = datagen.app.preflight.check_prompts(context.config, prepared, unprepared)
    get_run_logger().info("prompts checked %s", check.detail)
    return check


@task(
    name="open-run",
    task_run_name="open-run-{config.run_id}",
    cache_policy=NO_CACHE,
    **TRANSIENT_RETRIES,
)
def open_run(config: RunConfig, store: Store, origin: RunOrigin | None = None) -> RunHandle:
    """Write the run's config.json first, with what a deployment's run was made from (or check it on a rerun)."""
    run = datagen.output.runs.open_run(store, config, origin)
    get_run_logger().info(
        "run run_id=%s resumed=%s config_hash=%s output=%s",
        run.run_id,
        run.resumed,
        run.config_hash,
        run.output,
    )
    return run


# The attempt records of the training job's halt and restart (written by flows/serving.py, and a restart by
# flows/generation.py for a halt a killed attempt left; through write_attempt_record).
TRAINING_RECORD = "training.json"
TRAINING_RESTART_RECORD = "training-restart.json"


@task(name="write-attempt-record", task_run_name="record-{name}", cache_policy=NO_CACHE)
def write_attempt_record(context: RunContext, name: str, value: Any) -> str:
    """Store one record of this flow attempt (training, env, plan) under attempts/<attempt_id>/."""
    key = context.layout.attempt_object(context.attempt_id, f"{name}.json")
    return context.store.write_json(key, value).url


def _training_notes_over_attempts(store: Store, layout: RunLayout) -> list[str]:
    """The notes of every attempt's halt (``training.json``) and restart (``training-restart.json``), once each."""
    notes: list[str] = []
    # One level (attempts/<attempt>/), whole keys only: nothing nested deeper is read as an attempt's record.
    for folder in store.list_level(layout.attempts_prefix).folders:
        halt, restart = f"{folder}/{TRAINING_RECORD}", f"{folder}/{TRAINING_RESTART_RECORD}"
        if store.exists(halt):
            notes += HaltRecord.model_validate(store.read_json(halt)).notes
        if store.exists(restart):
            notes += RestartRecord.model_validate(store.read_json(restart)).notes
    return list(dict.fromkeys(notes))


@task(name="report", task_run_name="report-{context.run_id}", cache_policy=NO_CACHE)
def write_report(
    context: RunContext,
    prepared: list[PreparedDataset],
    shards: list[ShardSummary],
    tokenize_summary: dict[str, Any],
    servers: int,
    generation_wall_s: float,
) -> RunReport:
    """Build the report, store it (JSON + markdown) once, and publish it as table and markdown artifacts."""
    config, run, store = context.config, context.run, context.store
    layout: RunLayout = run.layout
    rows_by_dataset: dict[str, int] = dict(tokenize_summary.get("rows_by_dataset") or {})
    # Every attempt's generation time (this one's was recorded as it ended): a resumed run's completions
    # come from all of them.
    wall_s, attempts = datagen.dataset.report.generation_time_over_attempts(store, layout)
    hosts, lost_hosts = datagen.dataset.report.hosts_over_attempts(store, layout)
    training_job = _training_notes_over_attempts(store, layout)
    report = datagen.dataset.report.build_report(
        run_id=run.run_id,
        config=config,
        prepared=prepared,
        shards=shards,
        tokenize_summary=tokenize_summary,
        servers=servers,
        generation_wall_s=wall_s if attempts else generation_wall_s,
        generation_attempts=attempts or 1,
        dataset_mix=datagen.prompts.mix.dataset_mix(config, prepared),
        mix_by_category=datagen.prompts.mix.mix_table(config, prepared, rows_by_dataset),
        hosts=hosts,
        lost_hosts=lost_hosts,
        training_job=training_job,
    )
    accounting = datagen.app.accounting.account_run(store, layout, report.totals.completion_tokens)
    report = report.model_copy(update={"accounting": accounting})
    try:
        store.write_json(layout.report_json, report)
    except OutputExistsError:
        # An earlier attempt (or a concurrent process on this run) reported first: its report stands.
        report = RunReport.model_validate(store.read_json(layout.report_json))
    else:
        _append_box_history(context, report)
    locations = datagen.dataset.report.run_locations(store, layout, report)
    with contextlib.suppress(OutputExistsError):
        store.write_text(layout.report_md, report.to_markdown(locations))
    create_table_artifact(
        report.table_rows(), key="datagen-counts", description=f"Counts of run {run.run_id}"
    )
    create_markdown_artifact(
        report.to_markdown(locations), key="datagen-report", description=f"Report of run {run.run_id}"
    )
    return report


def _append_box_history(context: RunContext, report: RunReport) -> None:
    """Add the run to this box's history (once: by the attempt that stored the report); never fails the run."""
    try:
        record = datagen.app.accounting.history_record(
            context.config, context.store, context.run.layout, report
        )
        if record is not None:
            datagen.app.history.append_record(get_settings().state_dir, record)
    except Exception as error:  # the next preview loses one measurement; the run's outcome must not change
        get_run_logger().warning("box history not appended error=%r", error)


@task(name="manifest", task_run_name="manifest-{context.run_id}", cache_policy=NO_CACHE)
def finalize_manifest(context: RunContext, report: RunReport) -> RunManifest:
    """Write manifest.json last: every object of the run with size and checksum."""
    run = context.run
    manifest = datagen.output.manifest.write_manifest(
        context.store,
        run.layout,
        config_hash=run.config_hash,
        counts=report.totals.model_dump(),
        dataset_version=report.tokenize.get("dataset_version"),
    )
    get_run_logger().info("manifest objects=%d run_id=%s", len(manifest.objects), run.run_id)
    return manifest


def record_generation_time(
    context: RunContext,
    wall_s: float,
    servers: int,
    finished: bool,
    hosts: list[str] | None = None,
    lost_hosts: dict[str, str] | None = None,
) -> None:
    """Record how long this attempt generated, also when interrupted (the report's throughput counts every attempt).

    A failure to record is logged, never raised over why generation ended.
    """
    window = datagen.dataset.report.GenerationWindow(
        attempt_id=context.attempt_id,
        wall_s=wall_s,
        servers=servers,
        interrupted=not finished,
        hosts=list(hosts or []),
        lost_hosts=dict(lost_hosts or {}),
    )
    try:
        datagen.dataset.report.record_generation_window(context.store, context.layout, window)
    except Exception as error:  # never mask why generation ended
        get_run_logger().warning(
            "generation time not recorded attempt=%s error=%s", context.attempt_id, error
        )
