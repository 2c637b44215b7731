"""The generation side of a run: its prompts prepared and checked, then its shards generated on this box.

Several boxes generate through :mod:`flows.multihost`; both end in a :class:`tasks.shard_scheduler.Generated`.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import get_run_logger
from prefect.futures import PrefectFuture
from pydantic import BaseModel

from datagen.generation.dispatcher import Dispatcher
from datagen.generation.failures import retryable_failures
from datagen.progress import Stage, enter_stage
from datagen.prompts.ledger import SeriesEntry
from datagen.records import PreparedDataset
from flows.serving import fleet_state_dir, serve_on_this_box
from tasks.context import RunContext
from tasks.data import CorpusIds, prepare_prompts, prepared_outcomes, prompt_scans, stored_shard_summaries
from tasks.progress import ServingCost
from tasks.run import check_prompts, record_generation_time, write_attempt_record
from tasks.runtime import HostGpus, hand_back_if_gpus_free
from tasks.series import write_ledger
from tasks.shard_scheduler import Generated, generate_all
from tasks.window import watch_window, window_policy


def prepare_datasets(
    context: RunContext, series_entry: SeriesEntry | None
) -> list[PrefectFuture[PreparedDataset]]:
    """Prepare every dataset's prompts, and check them all before training is halted.

    Every dataset is read at once in worker processes; each prepare task dedupes against the datasets before
    it, in config order.
    """
    enter_stage(get_run_logger(), Stage.PREPARE_PROMPTS, datasets=len(context.config.datasets))
    futures: list[PrefectFuture[PreparedDataset]] = []
    corpus = CorpusIds()
    with prompt_scans(context) as scans:
        for dataset in context.config.datasets:
            earlier: Any = list(futures)
            futures.append(prepare_prompts.submit(context, dataset.name, earlier, corpus, scans))
        # A dataset that yields too few prompts refuses the run while training still runs; the shards written
        # here are the ones the run generates from.
        check_prompts(context, *prepared_outcomes(context.config, futures))
    if series_entry is not None:
        # Recorded before any GPU work: a later run of the series never takes these prompts again.
        write_ledger(context, series_entry, [future.result() for future in futures])
    return futures


def already_generated(
    context: RunContext, prepared_futures: list[PrefectFuture[PreparedDataset]], retry_failed: bool
) -> Generated | None:
    """A resumed run whose every shard is stored (and, to retry failures, has none to retry): nothing to serve."""
    if not context.run.resumed:
        return None
    prepared = [future.result() for future in prepared_futures]
    summaries = stored_shard_summaries(context, prepared)
    if summaries is None:
        return None
    logger = get_run_logger()
    if retry_failed:
        retryable = retryable_failures(context.store, summaries)
        logger.info("failures to send again: %d", retryable)
        if retryable:
            return None
    logger.info("every shard is already generated: training is not halted, no server is started")
    if not context.config.hosts:
        # An attempt killed while stopping its fleet stored every shard but never handed training back; the
        # next holder of the GPUs would adopt its halt, but this run takes none, so it hands training back.
        restarted = hand_back_if_gpus_free()
        if restarted is not None:
            logger.info("training restarted, left halted by a killed attempt pid=%d", restarted.pid)
            write_attempt_record(context, "training-restart", restarted)
    return Generated(prepared=prepared, summaries=summaries)


def generate_on_this_box(
    context: RunContext,
    prepared_futures: list[PrefectFuture[PreparedDataset]],
    gpus: HostGpus,
    flow_run_id: str,
    retry_failed: bool,
) -> Generated:
    """Halt training, serve on this box's GPUs, generate every shard.

    The servers stop and training is handed back however this ends.
    """
    config = context.config

    def record(name: str, value: BaseModel) -> str:
        return write_attempt_record(context, name, value)

    state_dir = fleet_state_dir(flow_run_id)
    with serve_on_this_box(config, gpus, context.run.run_id, state_dir, record) as serving:
        servers = len(serving.plan.servers)
        window = window_policy(config, serving.halted_at)
        enter_stage(get_run_logger(), Stage.GENERATE)
        with (
            Dispatcher.for_run(
                config,
                serving.urls,
                model=serving.plan.served_model_name,
                max_inflight_per_server=serving.plan.dispatcher_inflight,
                liveness=serving.fleet.is_alive,
                on_answer=window.observe_answer if window else None,
            ) as dispatcher,
            watch_window(window, dispatcher),
        ):
            serving.fleet.on_server_moved(dispatcher.move_server)
            started = time.monotonic()
            finished = False
            try:
                cost = ServingCost(
                    gpus=sum(len(server.gpu_ids) for server in serving.plan.servers),
                    halted_at=serving.halted_at if config.training.kind != "none" else None,
                    window_ends_at=config.window.deadline(serving.halted_at),
                    window=window,
                )
                generated = generate_all(context, prepared_futures, dispatcher, retry_failed, started, cost)
                finished = True
            finally:
                wall_s = time.monotonic() - started
                record_generation_time(context, wall_s, servers, finished)
    generated.servers, generated.wall_s, generated.held_back = servers, wall_s, serving.held_back
    return generated
