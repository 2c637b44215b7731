"""Prepare the prompts of one dataset: read, normalise, filter, deduplicate, sample, write shards.

Output of :func:`prepare_prompts` for dataset ``d`` (keys from :class:`~datagen.output.layout.RunLayout`)::

    runs/<run_id>/prompts/<d>/shard-00000.jsonl ...   PromptRecords, ``shard_size`` per shard, write-once
    runs/<run_id>/prompts/<d>/summary.json            PreparedDataset, written last

The output is a pure function of the dataset files and the config, so an interrupted attempt is resumed
by recomputing it: shards already written are compared byte for byte and skipped, the summary marks
completion and is checked first. Prompt ids hash the normalised content (see
:mod:`datagen.prompts.datasets.identity`), so the same prompt has the same id in every run.

Capping at the dataset's quota (``max_prompts``, or its ``share`` of the mix after category caps: see
:mod:`datagen.prompts.mix`) keeps the prompts with the smallest seeded hash priority (bottom-k sampling): a
uniform sample that uses memory for the quota only, does not depend on the order rows are read in, and
is the same in every run with the same seed. Prompts of the existing corpus
(``existing_corpus.dedupe_against``) are rejected as ``in_existing_corpus``.

The rows are read and normalised by :func:`datagen.prompts.scan.scan_dataset` (here, or beforehand in a
worker process: :func:`start_dataset_scans`, :mod:`datagen.prompts.parallel`); this module replays its
events through the rules in config order, so the output is the same either way.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

from datagen.config import DatasetConfig, RunConfig
from datagen.config.prompts import MAX_SHARD_SIZE
from datagen.conversation_turns import split_conversation
from datagen.dataset.tokenizer import shared_tokenizer
from datagen.errors import ConfigError, DatasetError, OutputExistsError
from datagen.output.layout import RunLayout
from datagen.output.objects import size_text
from datagen.output.store import Store
from datagen.processes import usable_cores
from datagen.prompts.datasets.corpus import load_corpus_ids
from datagen.prompts.datasets.inspect import InspectReport, inspect_dataset
from datagen.prompts.datasets.registry import get_normaliser
from datagen.prompts.datasets.tally import RejectionTally
from datagen.prompts.mix import quota_for
from datagen.prompts.parallel import (
    MIN_PART_BYTES,
    MIN_WORKER_BYTES,
    DatasetScans,
    is_remote,
    local_bytes,
    plan_parts,
)
from datagen.prompts.rules import Candidate, LengthRule, QuotaRule, first_rejection, prompt_rules
from datagen.prompts.scan import RowRejection, ScanEnd, ScanRequest, scan_dataset
from datagen.records import PreparedDataset, PromptRecord, PromptShardRef

logger = logging.getLogger(__name__)

__all__ = [
    "InspectReport",
    "inspect_dataset",
    "iter_prompt_shard",
    "load_prompt_ids",
    "prepare_prompts",
    "start_dataset_scans",
]


def _load_tokenizer(location: str) -> Any:
    # The one loader of the target's tokenizer (the merge's), once per process; a hub id may download here.
    try:
        return shared_tokenizer(location, download=True)
    except ConfigError as error:
        raise DatasetError(
            f"Cannot load the tokenizer {location} to count prompt tokens (max_prompt_tokens): {error}"
        ) from error


def _shard_size(store: Store, layout: RunLayout, dataset: DatasetConfig) -> int:
    """Prompts per shard: the dataset's ``shard_size``; unset, what an interrupted earlier attempt cut with.

    An attempt that stopped after writing shards and before the summary cut them with the default of its day:
    its first shard holds that many prompts (or all of them, being the only one), so the rest is cut the same
    way and the shards it wrote are found unchanged. A count out of the allowed range is not taken.
    """
    if dataset.shard_size is not None:
        return dataset.shard_size
    try:
        lines = store.iter_lines(layout.prompt_shard(dataset.name, 0))
        written = sum(1 for _ in itertools.islice(lines, MAX_SHARD_SIZE + 1))
    except FileNotFoundError:
        return dataset.prompts_per_shard
    if 0 < written <= MAX_SHARD_SIZE and written != dataset.prompts_per_shard:
        logger.info("prompt shards cut by an earlier attempt dataset=%s shard_size=%d", dataset.name, written)
        return written
    return dataset.prompts_per_shard


class _ShardWriter:
    """Cuts records into shards of ``shard_size`` and writes each one once (verifying earlier writes)."""

    def __init__(
        self, store: Store, layout: RunLayout, dataset: str, shard_size: int, *, on_policy: bool = False
    ) -> None:
        self.store = store
        self.layout = layout
        self.dataset = dataset
        self.shard_size = shard_size
        self.on_policy = on_policy
        self.buffer: list[str] = []
        self.turns = 0
        self.shards: list[PromptShardRef] = []

    def add(self, record_json: str) -> None:
        if self.on_policy:
            # Each turn of an on-policy conversation is a request: what the run's progress counts.
            self.turns += split_conversation(PromptRecord.model_validate_json(record_json).messages).turns
        self.buffer.append(record_json)
        if len(self.buffer) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        index = len(self.shards)
        key = self.layout.prompt_shard(self.dataset, index)
        data = "".join(line + "\n" for line in self.buffer).encode()
        try:
            self.store.write_bytes(key, data)
        except OutputExistsError:
            # An interrupted earlier attempt wrote it; the output is deterministic, so it must match.
            if self.store.read_bytes(key) != data:
                raise DatasetError(
                    f"Prompt shard {self.store.url(key)} exists with different content than this attempt "
                    f"computes for dataset {self.dataset!r}: its files or its config changed since the "
                    "shard was written. Restore them, or start a new run id.",
                    dataset=self.dataset,
                    key=key,
                ) from None
            logger.info("prompt shard already written dataset=%s shard=%d", self.dataset, index)
        turns = self.turns if self.on_policy else None
        self.shards.append(
            PromptShardRef(
                dataset=self.dataset, shard_index=index, path=key, prompts=len(self.buffer), turns=turns
            )
        )
        self.buffer = []
        self.turns = 0


def scan_request(config: RunConfig, dataset: DatasetConfig) -> ScanRequest:
    """What scanning ``dataset`` of the run needs (its files, format, policy; the run's seed)."""
    return ScanRequest(
        dataset=dataset.name,
        format=dataset.format,
        path=dataset.path,
        multi_turn=dataset.multi_turn,
        seed=config.seed,
    )


def start_dataset_scans(
    store: Store,
    layout: RunLayout,
    config: RunConfig,
    work_dir: Path,
    *,
    max_workers: int | None = None,
    min_part_bytes: int = MIN_PART_BYTES,
    min_worker_bytes: int = MIN_WORKER_BYTES,
) -> DatasetScans:
    """Start scanning, in worker processes, every dataset of the run not prepared yet.

    Pass the result to :func:`prepare_prompts` of each dataset (in config order, as always) and close it
    when they are done. A dataset whose local files are large is split into parts, one worker each, when
    there are more cores than datasets (:func:`~datagen.prompts.parallel.plan_parts`). With one core, one
    dataset too small to split, or local datasets of fewer than ``min_worker_bytes`` together, nothing
    starts: each dataset is then scanned by its own ``prepare_prompts``, as a worker would gain nothing.
    s3:// and Hub datasets cannot be weighed and are slow to read: with one of them, two or more datasets
    are always scanned in workers.

    Args:
        store: The run's output store (a dataset with a summary is prepared: not scanned); s3:// datasets
            are read with its credentials.
        layout: The run's layout.
        config: The run config.
        work_dir: A local folder for the workers' spools.
        max_workers: Cap on worker processes (default: one per usable core).
        min_part_bytes: Smallest part a dataset is split into (bytes of its files).
        min_worker_bytes: Local datasets of fewer bytes than this together are scanned in this process
            (:data:`~datagen.prompts.parallel.MIN_WORKER_BYTES`).

    Returns:
        The running scans (a context manager).

    """
    requests = [
        scan_request(config, dataset)
        for dataset in config.datasets
        if not store.exists(layout.prompts_summary(dataset.name))
    ]
    cores = max_workers or usable_cores()
    sizes = {request.dataset: local_bytes(request.path) for request in requests}
    parts = plan_parts(sizes, cores, min_part_bytes)
    workers = min(cores, sum(parts.values()))
    total = sum(sizes.values())
    remote = any(is_remote(request.path) for request in requests)
    if requests and not remote and total < min_worker_bytes:
        logger.info(
            "scanning datasets in this process: %d dataset%s, %s of files (< %s)",
            len(requests),
            "s" if len(requests) != 1 else "",
            size_text(total),
            size_text(min_worker_bytes),
        )
        requests, workers = [], 0
    elif workers < 2:
        requests, workers = [], 0
    return DatasetScans(requests, work_dir, workers, parts, credentials=store.credentials)


def prepare_prompts(
    store: Store,
    layout: RunLayout,
    config: RunConfig,
    dataset_name: str,
    *,
    exclude_prompt_ids: AbstractSet[str] | None = None,
    corpus_ids: AbstractSet[str] | None = None,
    earlier: Sequence[PreparedDataset] = (),
    tokenizer: Any | None = None,
    held_by_category: Mapping[str, int] | None = None,
    scans: DatasetScans | None = None,
) -> PreparedDataset:
    """Read one dataset and write its prompt shards and summary (write-once, resumable).

    Steps: stream rows, normalise (multi-turn policy), run each prompt through the chain of
    :mod:`datagen.prompts.rules` (language, existing corpus, duplicates of this dataset or of
    ``exclude_prompt_ids``, the seeded sample of the quota from :func:`datagen.prompts.mix.quota_for`,
    length under the target's chat template), write shards of ``shard_size``, then the summary.

    Args:
        store: The run's output store; s3:// datasets and corpus sources are read with its credentials.
        layout: The run's layout.
        config: The run config; the dataset is ``config.dataset(dataset_name)``.
        dataset_name: Which dataset.
        exclude_prompt_ids: Ids of prompts already taken by earlier datasets of the run.
        corpus_ids: Ids of the existing corpus's prompts; read from ``config.existing_corpus`` when
            not given and it names sources (pass them when preparing several datasets: read once).
        earlier: Summaries of the datasets prepared before this one (their shortfalls move to this
            dataset's quota under ``mix.rebalance``).
        tokenizer: The target's tokenizer for ``max_prompt_tokens``; loaded from ``config.model``
            when needed and not given.
        held_by_category: Prompts per category the run's expansion series already holds; the
            category caps then bound the series' mix (:func:`datagen.prompts.mix.plan_mix`).
        scans: Scans of the run's datasets started by :func:`start_dataset_scans`: the dataset's rows
            are then read back from its worker's scan instead of being read and normalised here.

    Returns:
        The summary; read back from storage without reading the dataset when it already exists.

    Raises:
        DatasetError: The dataset cannot be read, or a shard from an earlier attempt differs.
        ConfigError: No dataset is called ``dataset_name``, or ``earlier`` lacks a dataset the
            quota depends on.

    """
    dataset = config.dataset(dataset_name)
    summary_key = layout.prompts_summary(dataset.name)
    if store.exists(summary_key):
        logger.info("prompts already prepared dataset=%s", dataset.name)
        return PreparedDataset.model_validate(store.read_json(summary_key))
    get_normaliser(dataset.format)
    quota = quota_for(config, dataset, earlier, held_by_category)
    if corpus_ids is None:
        corpus_ids = load_corpus_ids(config.existing_corpus, store.credentials)
    if dataset.max_prompt_tokens is not None and tokenizer is None:
        tokenizer = _load_tokenizer(config.model.tokenizer)
    tally = RejectionTally()
    writer = _ShardWriter(
        store,
        layout,
        dataset.name,
        _shard_size(store, layout, dataset),
        on_policy=dataset.multi_turn == "on_policy",
    )
    sample = QuotaRule(quota) if quota is not None else None
    length = (
        LengthRule(tokenizer, dataset.max_prompt_tokens, config.sampling_for(dataset).enable_thinking)
        if dataset.max_prompt_tokens is not None
        else None
    )
    rules = prompt_rules(
        languages=dataset.languages,
        corpus_ids=corpus_ids,
        excluded=exclude_prompt_ids or set(),
        quota=sample,
        length=length,
    )
    request = scan_request(config, dataset)
    rows_read = 0
    events = (
        scans.events(request) if scans is not None else scan_dataset(request, credentials=store.credentials)
    )
    for event in events:
        if isinstance(event, RowRejection):
            tally.add(event.reason, event.detail, event.source_index, example_text=event.example)
            continue
        if isinstance(event, ScanEnd):
            rows_read = event.rows_read
            continue
        if not isinstance(event, Candidate):  # a block's end: only between the parts of a split scan
            continue
        rejection = first_rejection(rules, event)
        if rejection is not None:
            tally.add(rejection.reason, rejection.detail, event.source_index, rejection.example)
            continue
        if sample is None:
            writer.add(event.record_json)
            continue
        pushed_out = sample.take(event)
        if pushed_out is not None:
            tally.add("over_cap", sample.over_cap_detail, pushed_out.source_index)
    if sample is not None:
        for candidate in sample.drawn_in_source_order():
            writer.add(candidate.record_json)
    writer.flush()
    summary = PreparedDataset(
        dataset=dataset.name,
        rows_read=rows_read,
        prompts=sum(shard.prompts for shard in writer.shards),
        rejections=tally.as_dict(),
        rejection_samples=tally.samples,
        shards=writer.shards,
    )
    logger.info(
        "prepared prompts dataset=%s rows=%d prompts=%d quota=%s shards=%d rejected=%d",
        dataset.name,
        summary.rows_read,
        summary.prompts,
        quota,
        len(summary.shards),
        sum(summary.rejections.values()),
    )
    if quota is not None and summary.prompts < quota:
        logger.warning(
            "dataset short of its quota dataset=%s quota=%d prompts=%d shortfall=%d rebalance=%s",
            dataset.name,
            quota,
            summary.prompts,
            quota - summary.prompts,
            config.mix.rebalance,
        )
    try:
        store.write_json(summary_key, summary)
    except OutputExistsError:
        # A concurrent attempt finished first; its summary describes the same shards.
        return PreparedDataset.model_validate(store.read_json(summary_key))
    return summary


def iter_prompt_shard(store: Store, shard: PromptShardRef) -> Iterator[PromptRecord]:
    """Stream the prompt records of one shard."""
    for line in store.iter_jsonl(shard.path):
        yield PromptRecord.model_validate(line)


def load_prompt_ids(store: Store, prepared: PreparedDataset) -> set[str]:
    """The ids of every prompt a prepared dataset wrote (to exclude them from later datasets).

    Args:
        store: The run's output store.
        prepared: The dataset's summary.

    Returns:
        The prompt ids.

    """
    ids: set[str] = set()
    for shard in prepared.shards:
        for line in store.iter_jsonl(shard.path):
            ids.add(str(line["prompt_id"]))
    return ids
