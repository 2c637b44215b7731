"""Data tasks: prepare prompts per dataset, generate per shard, merge and tokenize."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.context import TaskRunContext
from prefect.futures import PrefectFuture

import datagen.dataset.merge
import datagen.generation.shard
import datagen.generation.shard_assembly
import datagen.prompts.datasets.corpus
import datagen.prompts.ledger
import datagen.prompts.prepare
from datagen.config import RunConfig
from datagen.generation.dispatcher import Dispatcher
from datagen.output.runs import RunHandle
from datagen.output.store import Store
from datagen.prompts.parallel import DatasetScans
from datagen.records import PreparedDataset, PromptShardRef, ShardSummary
from datagen.settings import get_settings
from tasks.common import TRANSIENT_RETRIES, stage_cache_key
from tasks.context import RunContext


class CorpusIds:
    """The prompt ids no dataset of one flow run may take: read once, by the first prepare task that asks.

    The flow makes one per run and hands it to every dataset's prepare task (the ids of a large corpus are
    read once, not once per dataset); a plain object, so Prefect passes it without looking inside.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: frozenset[str] | None = None

    def get(self, context: RunContext) -> frozenset[str]:
        """The existing corpus's prompt ids plus those earlier runs of the run's series took.

        s3:// corpus sources are read with the run's store's credentials.
        """
        with self._lock:
            if self._ids is None:
                self._ids = _load_corpus_ids(context.config, context.run, context.store)
            return self._ids


def _load_corpus_ids(config: RunConfig, run: RunHandle, store: Store) -> frozenset[str]:
    ids = set(datagen.prompts.datasets.corpus.load_corpus_ids(config.existing_corpus, store.credentials))
    entry = datagen.prompts.ledger.read_series_entry(store, run.run_id) if config.series else None
    if entry is not None:
        ids |= datagen.prompts.ledger.taken_prompt_ids(store, entry)
    return frozenset(ids)


def _series_held(config: RunConfig, run: RunHandle, store: Store) -> dict[str, int] | None:
    """Prompts per category the run's series held before it (None: not a series run)."""
    entry = datagen.prompts.ledger.read_series_entry(store, run.run_id) if config.series else None
    return datagen.prompts.ledger.held_by_category(store, entry) if entry is not None else None


class ShardProgress:
    """Requests answered and conversations over so far per running shard (stored ones included), for the scheduler.

    The flow's scheduler makes one and hands it to every shard task it starts. A shard appears here once its
    requests are registered with the dispatcher (``done`` may still be 0). It also holds the results shard
    attempts could not store (``held``), for the shard's next attempt (a task retry) to store first.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[tuple[str, str, int], tuple[int, int]] = {}
        self.held = datagen.generation.shard.HeldResults()

    def update(
        self, run_id: str, dataset: str, shard_index: int, done: int, conversations_done: int | None = None
    ) -> None:
        """Record that ``done`` requests of one shard have a result, ``conversations_done`` conversations are over."""
        with self._lock:
            self._done[(run_id, dataset, shard_index)] = (done, conversations_done or 0)

    def done(self, run_id: str, dataset: str, shard_index: int) -> int:
        """Requests of one shard with a result so far (0 before its task started)."""
        with self._lock:
            return self._done.get((run_id, dataset, shard_index), (0, 0))[0]

    def conversations_done(self, run_id: str, dataset: str, shard_index: int) -> int:
        """On-policy conversations of one shard that are over so far (0 before its task started, or none)."""
        with self._lock:
            return self._done.get((run_id, dataset, shard_index), (0, 0))[1]

    def registered(self, run_id: str, dataset: str, shard_index: int) -> bool:
        """Whether the shard's task has handed its requests to the dispatcher (or finished)."""
        with self._lock:
            return (run_id, dataset, shard_index) in self._done


def _dataset_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    run: RunHandle = parameters["context"].run
    return stage_cache_key("prepare", run.run_id, run.incarnation, run.config_hash, parameters["dataset"])


def _shard_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    run: RunHandle = parameters["context"].run
    shard: PromptShardRef = parameters["shard"]
    # A retry of failures runs again in every flow run that asks for one (storage says what is left to do).
    retry = [str(context.task_run.flow_run_id)] if parameters.get("retry_failed") else []
    return stage_cache_key(
        "generate", run.run_id, run.incarnation, run.config_hash, shard.dataset, shard.shard_index, *retry
    )


@contextlib.contextmanager
def prompt_scans(context: RunContext) -> Iterator[DatasetScans]:
    """Scan every dataset not prepared yet in worker processes (spools under the state dir) while in use."""
    work_dir = Path(get_settings().state_dir).expanduser() / "prompt-scans"
    with datagen.prompts.prepare.start_dataset_scans(
        context.store, context.layout, context.config, work_dir
    ) as scans:
        yield scans


@task(
    name="prepare-prompts",
    task_run_name="prepare-{dataset}",
    cache_key_fn=_dataset_cache_key,
    **TRANSIENT_RETRIES,
)
def prepare_prompts(
    context: RunContext,
    dataset: str,
    earlier: list[PreparedDataset],
    corpus: CorpusIds,
    scans: DatasetScans | None = None,
) -> PreparedDataset:
    """Read, normalise, filter and dedupe one dataset (against the datasets before it) into prompt shards.

    The datasets before it also decide its quota when ``mix.rebalance`` moves their shortfalls on; ``corpus``
    holds the ids no dataset of the run may take (shared by the run's prepare tasks). ``scans`` (from
    :func:`prompt_scans`) has read and normalised it already, in a worker process. The store's credentials
    reach the s3:// inputs too.
    """
    config, run, store = context.config, context.run, context.store
    if store.exists(run.layout.prompts_summary(dataset)):
        # Prepared by an earlier attempt: the core returns the summary without reading anything.
        prepared = datagen.prompts.prepare.prepare_prompts(store, run.layout, config, dataset)
    else:
        exclude: set[str] = set()
        for previous in earlier:
            exclude |= datagen.prompts.prepare.load_prompt_ids(store, previous)
        prepared = datagen.prompts.prepare.prepare_prompts(
            store,
            run.layout,
            config,
            dataset,
            exclude_prompt_ids=exclude,
            corpus_ids=corpus.get(context),
            earlier=earlier,
            held_by_category=_series_held(config, run, store),
            scans=scans,
        )
    get_run_logger().info(
        "prepared dataset=%s rows_read=%d prompts=%d shards=%d rejected=%s",
        dataset,
        prepared.rows_read,
        prepared.prompts,
        len(prepared.shards),
        prepared.rejections,
    )
    return prepared


@task(
    name="generate-shard",
    task_run_name="generate-{shard.dataset}-{shard.shard_index:05d}",
    cache_key_fn=_shard_cache_key,
    **TRANSIENT_RETRIES,
)
def generate_shard(
    context: RunContext,
    shard: PromptShardRef,
    dispatcher: Dispatcher,
    progress: ShardProgress,
    *,
    retry_failed: bool = False,
) -> ShardSummary:
    """Generate every request of one prompt shard through the shared dispatcher; resumable, write-once.

    Its answered count goes to ``progress``, the scheduler's view of the running shards. With
    ``retry_failed``, a done shard's retryable failures are sent again (a new retry round).
    """
    run_id = context.run_id
    summary = datagen.generation.shard.generate_shard(
        context.store,
        context.layout,
        context.config,
        shard,
        dispatcher,
        progress=lambda done, _total, conversations: progress.update(
            run_id, shard.dataset, shard.shard_index, done, conversations
        ),
        held=progress.held,
        retry_failed=retry_failed,
    )
    get_run_logger().info(
        "shard dataset=%s shard=%05d skipped=%s completions=%d failures=%d resent=%d output_tokens=%d",
        summary.dataset,
        summary.shard_index,
        summary.skipped,
        summary.completions,
        summary.failures,
        summary.resent_requests,
        summary.completion_tokens,
    )
    return summary


def _merge_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    run: RunHandle = parameters["context"].run
    # The finished files decide what the merge publishes: a window-ended attempt's merge (its finished shards)
    # never stands for the continuation's, which merges the rest as the run's next round; nor does it stand for
    # the run's last merge of the same files, which refuses a run without a version where a window part does not.
    files = sorted(path for shard in parameters["shards"] for path in shard.all_completions_paths)
    part = ["window-part"] if parameters.get("window_part") else []
    return stage_cache_key(context.task.name, run.run_id, run.incarnation, run.config_hash, *part, *files)


@task(
    name="merge-and-tokenize",
    task_run_name="merge-and-tokenize-{context.run_id}",
    cache_key_fn=_merge_cache_key,
    **TRANSIENT_RETRIES,
)
def merge_and_tokenize(
    context: RunContext, shards: list[ShardSummary], window_part: bool = False
) -> dict[str, Any]:
    """Tokenize the finished completions not merged yet into Parquet and a dataset version (a merge round).

    ``window_part``: a window-ended attempt's merge (see :func:`datagen.dataset.merge.merge_and_tokenize`).
    Returns the run's merge over all its rounds.
    """
    summary = datagen.dataset.merge.merge_and_tokenize(
        context.store, context.layout, context.config, window_part=window_part
    )
    data: dict[str, Any] = summary.model_dump(mode="json")
    get_run_logger().info(
        "tokenized rows=%s loss_tokens=%s dataset_version=%s",
        data.get("rows"),
        data.get("loss_tokens"),
        data.get("dataset_version"),
    )
    return data


def prepared_outcomes(
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


def stored_shard_summaries(context: RunContext, prepared: list[PreparedDataset]) -> list[ShardSummary] | None:
    """Every shard's latest stored summary (its highest retry round), or None while any shard is not done."""
    store, layout = context.store, context.layout
    shards = [shard for item in prepared for shard in item.shards]
    if not all(store.exists(layout.shard_done(s.dataset, s.shard_index)) for s in shards):
        return None
    summaries = [
        datagen.generation.shard_assembly.latest_shard_summary(store, layout, s.dataset, s.shard_index)
        for s in shards
    ]
    assert all(summary is not None for summary in summaries), "a done shard has its summary"
    return [summary for summary in summaries if summary is not None]
