"""The `expand` flow: halt training, serve the target on every GPU, generate, land, tokenize, report.

The DAG (see docs/architecture.md)::

    preflight -> open-run -> prepare-prompts (per dataset, CPU only) -> check-prompts
              -> halt-training -> probe-environment -> plan-servers -> start-fleet
              -> generate-shard (per dataset x shard, a rolling window, one shared dispatcher)
              -> stop-fleet (always) -> merge-and-tokenize -> report -> manifest (last)

This module only orchestrates and decides the final state; every stage's work is in ``datagen``.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any, cast
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.client.schemas.objects import FlowRun, State
from prefect.context import FlowRunContext
from prefect.futures import PrefectFuture, wait
from prefect.logging.loggers import flow_run_logger
from prefect.runtime import flow_run as runtime_flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from datagen.config import RunConfig
from datagen.errors import ShardsFailedError
from datagen.generation.dispatcher import Dispatcher
from datagen.host.fleet import Fleet
from datagen.host.fleet_registry import fleet_pidfile, stop_fleet_from_pidfile
from datagen.output.layout import RunLayout
from datagen.output.manifest import read_manifest
from datagen.output.report import GenerationWindow, RunReport, RunSummary, record_generation_window
from datagen.output.runs import make_run_id, open_store
from datagen.records import PreparedDataset, PromptShardRef, ShardSummary
from datagen.settings import get_settings
from tasks.credentials import configure_s3_credentials
from tasks.data import SHARD_PROGRESS, generate_shard, merge_and_tokenize, prepare_prompts
from tasks.host import (
    halt_training,
    plan_servers,
    probe_environment,
    restart_training,
    start_fleet,
    stop_fleet,
)
from tasks.run import (
    check_prompts,
    finalize_manifest,
    open_run,
    preflight,
    write_attempt_record,
    write_report,
)

# Threads for concurrently running tasks: prepare tasks plus the rolling window of shard tasks. Each shard
# task mostly waits on the dispatcher, so threads are cheap; the window below bounds what is submitted.
FLOW_TASK_WORKERS = 64
# How often the flow refreshes the progress bar and the terminal progress line.
PROGRESS_INTERVAL_S = 5.0
# Seconds between checks that restart a server whose process died mid-run.
FLEET_MONITOR_INTERVAL_S = 5.0


def _flow_run_name() -> str:
    parameters = runtime_flow_run.parameters or {}
    config = parameters.get("config")
    # The parameter arrives as a RunConfig (in-process call) or as plain data (deployment runs).
    run_id = config.get("run_id") if isinstance(config, dict) else getattr(config, "run_id", None)
    return f"expand-{run_id}" if run_id else "expand-new-run"


def _fleets_root() -> Path:
    """Host-local folder holding one subfolder per flow run's servers."""
    return Path(get_settings().state_dir).expanduser() / "fleets"


def _fleet_state_dir(flow_run_id: str) -> Path:
    """Host-local folder of one flow run's servers (pidfile, logs), known to the hooks too."""
    return _fleets_root() / flow_run_id


def _stop_servers_hook(flow: Any, flow_run: FlowRun, state: State[Any]) -> None:
    """Cancellation/crash hook: may run in another process, so it stops servers through the pidfile."""
    stopped = stop_fleet_from_pidfile(fleet_pidfile(_fleet_state_dir(str(flow_run.id))))
    flow_run_logger(flow_run, flow).warning("stopped servers after %s count=%d", state.type.value, stopped)


def _shard_window(config: RunConfig, servers: int, shard_size: int) -> int:
    """Shard tasks to keep running so every server slot stays busy while one shard drains its tail."""
    if config.generation.max_concurrent_shards:
        return config.generation.max_concurrent_shards
    slots = servers * config.fleet.max_inflight_per_server
    return max(2, -(-slots // max(1, shard_size)) + 1)


def _summary_from_report(
    report: RunReport, config: RunConfig, layout: RunLayout, complete: bool
) -> RunSummary:
    store = open_store(config)
    return RunSummary(
        run_id=layout.run_id,
        run_url=store.url(layout.root),
        already_complete=complete,
        prompts=report.totals.prompts,
        requests=report.totals.requests,
        completions=report.totals.completions,
        failures=report.totals.failures,
        tokenized_rows=report.totals.tokenized_rows,
        output_tokens_per_s=report.output_tokens_per_s,
        dataset_version=report.tokenize.get("dataset_version"),
        report_url=store.url(layout.report_md),
        manifest_url=store.url(layout.manifest),
    )


def _prepared_outcomes(
    config: RunConfig, futures: list[PrefectFuture[PreparedDataset]]
) -> tuple[list[PreparedDataset], dict[str, str]]:
    """Wait for every dataset's preparation: the summaries, and why each failed dataset failed."""
    prepared: list[PreparedDataset] = []
    unprepared: dict[str, str] = {}
    for dataset, future in zip(config.datasets, futures, strict=True):
        try:
            prepared.append(future.result())
        except Exception as error:
            # A dataset after a failed one never starts (it dedupes against it): name the first cause only.
            if not unprepared:
                unprepared[dataset.name] = str(error)
    return prepared, unprepared


def _record_generation_window(
    config: RunConfig, layout: RunLayout, attempt_id: str, wall_s: float, servers: int, finished: bool
) -> None:
    window = GenerationWindow(attempt_id=attempt_id, wall_s=wall_s, servers=servers, interrupted=not finished)
    try:
        record_generation_window(open_store(config), layout, window)
    except Exception as error:  # never mask why generation ended
        get_run_logger().warning("generation time not recorded attempt=%s error=%s", attempt_id, error)


def _all_shards_done(config: RunConfig, layout: RunLayout, prepared: list[PreparedDataset]) -> bool:
    store = open_store(config)
    return all(store.exists(layout.shard_done(s.dataset, s.shard_index)) for p in prepared for s in p.shards)


def _generate_all(
    config: RunConfig,
    run: Any,
    prepared_futures: list[PrefectFuture[PreparedDataset]],
    dispatcher: Dispatcher,
    servers: int,
) -> tuple[list[PreparedDataset], list[ShardSummary], list[BaseException]]:
    """Run every shard through a rolling window of tasks, feeding shards as their datasets are prepared."""
    logger = get_run_logger()
    pending: deque[PromptShardRef] = deque()
    waiting_prepare = list(prepared_futures)
    prepared: list[PreparedDataset] = []
    running: dict[PrefectFuture[ShardSummary], PromptShardRef] = {}
    summaries: list[ShardSummary] = []
    errors: list[BaseException] = []
    total_requests = 0
    progress_id = cast(
        UUID, create_progress_artifact(0.0, key="generation-progress", description="Requests answered")
    )
    started = time.monotonic()

    def take_prepared(block: bool) -> None:
        nonlocal total_requests
        while waiting_prepare and (block or waiting_prepare[0].state.is_final()):
            item = waiting_prepare.pop(0).result()
            prepared.append(item)
            samples = config.sampling_for(config.dataset(item.dataset)).samples_per_prompt
            total_requests += item.prompts * samples
            pending.extend(item.shards)
            block = False

    while waiting_prepare or pending or running:
        take_prepared(block=not pending and not running)
        window = _shard_window(config, servers, max((shard.prompts for shard in pending), default=1))
        while pending and len(running) < window:
            shard = pending.popleft()
            running[generate_shard.submit(config, run, shard, dispatcher)] = shard
        if not running:
            continue
        done = wait(list(running), timeout=PROGRESS_INTERVAL_S).done
        for future in done:
            shard = running.pop(future)
            try:
                summaries.append(future.result())
            except BaseException as error:  # keep the other shards going; the run fails at the end
                logger.error(
                    "shard failed dataset=%s shard=%05d error=%s", shard.dataset, shard.shard_index, error
                )
                errors.append(error)
        stats = dispatcher.stats()
        # Finished shards count all their requests (stored by any attempt); running ones what they have so far.
        answered = sum(s.completions + s.failures for s in summaries) + sum(
            SHARD_PROGRESS.done(run.run_id, shard.dataset, shard.shard_index) for shard in running.values()
        )
        percent = min(100.0, 100.0 * answered / total_requests) if total_requests else 0.0
        update_progress_artifact(progress_id, percent)
        logger.info(
            "progress %.1f%% answered=%d/%d in_flight=%d queued=%d shards_done=%d/%d tok/s=%.1f elapsed_s=%.0f",
            percent,
            answered,
            total_requests,
            sum(stats.in_flight.values()),
            stats.queued,
            len(summaries),
            len(summaries) + len(running) + len(pending),
            stats.tokens_per_s,
            time.monotonic() - started,
        )
    update_progress_artifact(progress_id, 100.0)
    return prepared, summaries, errors


@flow(
    name="expand",
    flow_run_name=_flow_run_name,
    task_runner=ThreadPoolTaskRunner(max_workers=FLOW_TASK_WORKERS),  # type: ignore[arg-type]
    on_cancellation=[_stop_servers_hook],
    on_crashed=[_stop_servers_hook],
    validate_parameters=True,
)
def expand(config: RunConfig) -> RunSummary:
    """Expand the drafter's training data with completions of the target model.

    Args:
        config: The run configuration (validated; rendered as a form in the Prefect UI).

    Returns:
        Where the run landed and its headline counts.
    """
    logger = get_run_logger()
    configure_s3_credentials()
    context = FlowRunContext.get()
    flow_run_id = str(context.flow_run.id) if context and context.flow_run else "local"
    attempt_id = time.strftime("%Y%m%d-%H%M%S") + "-" + flow_run_id[:8]
    config = config.model_copy(update={"run_id": config.run_id or make_run_id(seed=flow_run_id)})
    state_dir = _fleet_state_dir(flow_run_id)

    preflight_report = preflight(config)
    run = open_run(config)
    layout = run.layout
    store = open_store(config)
    if read_manifest(store, layout) is not None:
        logger.info("run run_id=%s is already complete: nothing to do", run.run_id)
        report = RunReport.model_validate(store.read_json(layout.report_json))
        return _summary_from_report(report, config, layout, complete=True)
    write_attempt_record(config, run, attempt_id, "preflight", preflight_report)

    prepared_futures: list[PrefectFuture[PreparedDataset]] = []
    for dataset in config.datasets:
        # Passing the earlier futures makes each dataset wait for (and dedupe against) the ones before it.
        earlier: Any = list(prepared_futures)
        prepared_futures.append(prepare_prompts.submit(config, run, dataset.name, earlier))
    # Every dataset is prepared before training is halted: one that yields too few prompts refuses the run
    # while training still runs, and the shards written here are the ones the run generates from.
    check_prompts(config, run, *_prepared_outcomes(config, prepared_futures))

    if run.resumed and _all_shards_done(config, layout, [future.result() for future in prepared_futures]):
        logger.info("every shard is already generated: training is not halted, no server is started")
        prepared = [future.result() for future in prepared_futures]
        shard_summaries = [
            ShardSummary.model_validate(store.read_json(layout.shard_done(s.dataset, s.shard_index)))
            for p in prepared
            for s in p.shards
        ]
        servers, generation_wall_s = 0, 0.0
        errors: list[BaseException] = []
    else:
        halt = halt_training(config.training)
        write_attempt_record(config, run, attempt_id, "training", halt)
        env = probe_environment()
        write_attempt_record(config, run, attempt_id, "env", env)
        plan = plan_servers(env, config, state_dir)
        write_attempt_record(config, run, attempt_id, "plan", plan)
        servers = len(plan.servers)
        fleet = Fleet(
            plan,
            state_dir,
            ready_timeout_s=config.fleet.ready_timeout_s,
            max_restarts_per_server=config.fleet.max_restarts_per_server,
        )
        try:
            urls = start_fleet(fleet, _fleets_root())
            fleet.start_monitor(FLEET_MONITOR_INTERVAL_S)
            api_key = get_settings().server_api_key
            with Dispatcher(
                urls,
                model=plan.served_model_name,
                engine=config.fleet.engine,
                max_inflight_per_server=plan.inflight_per_client_url(config.fleet.max_inflight_per_server),
                generation=config.generation,
                liveness=fleet.is_alive,
                api_key=api_key.get_secret_value() if api_key else None,
            ) as dispatcher:
                generation_started = time.monotonic()
                finished = False
                try:
                    prepared, shard_summaries, errors = _generate_all(
                        config, run, prepared_futures, dispatcher, servers
                    )
                    finished = True
                finally:
                    # Recorded even when interrupted: the report's throughput counts every attempt's time.
                    generation_wall_s = time.monotonic() - generation_started
                    _record_generation_window(
                        config, layout, attempt_id, generation_wall_s, servers, finished
                    )
        finally:
            stop_fleet(fleet)
    if errors:
        raise ShardsFailedError(
            f"{len(errors)} shard(s) failed (first: {errors[0]}); everything else is stored. "
            f"Rerun with --run-id {run.run_id} to resume: finished shards are not generated again.",
            run_id=run.run_id,
            failed_shards=len(errors),
        ) from errors[0]
    tokenize_summary = merge_and_tokenize(config, run, shard_summaries)
    if config.training.restart_after_run:
        restarted = restart_training(config.training, state_dir / "training-restart.log")
        write_attempt_record(config, run, attempt_id, "training-restart", restarted)
    report = write_report(
        config, run, prepared, shard_summaries, tokenize_summary, servers, generation_wall_s
    )
    finalize_manifest(config, run, report)
    summary = _summary_from_report(report, config, layout, complete=False)
    logger.info(
        "run complete run_id=%s completions=%d failures=%d tokenized_rows=%d url=%s",
        summary.run_id,
        summary.completions,
        summary.failures,
        summary.tokenized_rows,
        summary.run_url,
    )
    return summary


if __name__ == "__main__":
    import sys

    from datagen.config import load_run_config

    expand(load_run_config(sys.argv[1]))
