"""Merge a run's completions into tokenized Parquet parts and a new dataset version.

Reads every final completions shard whose done marker exists (sorted keys, so the row order is
deterministic), drops what must not be trained on (truncated, empty, too long, not renderable), counting
each drop by reason, tokenizes the rest with the target's tokenizer on ``tokenize.workers`` processes (when
unset: one per core, or this process alone for less than ``IN_PROCESS_BELOW_BYTES`` of completions;
:mod:`datagen.dataset.tokenize_workers`, results consumed in shard order), and writes write-once Parquet parts of
``tokenize.rows_per_part`` rows in row groups of ``tokenize.row_group_rows`` (:mod:`datagen.dataset.parts`),
holding at most one part and a few shards in memory.
Then it writes a dataset version manifest (``datasets/<name>/vNNNN.json``) listing the base version's
shards (referenced, never rewritten) plus the new parts, and finally the tokenize summary.

A run merges in rounds (:mod:`datagen.dataset.merge_rounds`): each round takes the finished files no earlier
round took, so a window-ended attempt publishes what it finished and the run's continuation the rest, as the
next version on top of it.

Resume: a round's summary is written last and checked first, so a finished round is never redone. Parts left
by an interrupted attempt are kept: their rows are recomputed for the counts but not written again, after
checking that they still end at the same completion (each part records its last source row).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from datagen.config import RunConfig, TokenizeConfig
from datagen.dataset.merge_rounds import (
    MergeRoundShards,
    TokenizeSummary,
    combine_rounds,
    finished_rounds,
    next_merge_round,
)
from datagen.dataset.parts import PART_LAST_SOURCE_KEY, PartWriter, RowTally, shard_table
from datagen.dataset.tokenize_workers import (
    IN_PROCESS_BELOW_BYTES,
    ShardRows,
    TokenizeJob,
    plan_workers,
    tokenize_shards,
)
from datagen.dataset.tokenizer import shared_spec
from datagen.dataset.versions import (
    JSONL_FORMAT,
    CompletionSourceRef,
    DatasetVersion,
    ExportRecord,
    TokenizedPartRef,
    claim_version,
    read_base_version,
)
from datagen.errors import NoTrainingRowsError, OutputExistsError, TokenizeError
from datagen.output.layout import RunLayout, dataset_versions_prefix, parse_dataset_version
from datagen.output.store import Store
from datagen.progress import WorkProgress, report_work

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _ExistingPart:
    key: str
    rows: int
    last_source: str


@dataclass
class PartsTally(RowTally):
    """Running counts of one tokenization into parts (rows written or not)."""

    shards_read: int = 0
    completions_read: int = 0
    rows_by_dataset: Counter[str] = field(default_factory=Counter)
    tokens_by_dataset: Counter[str] = field(default_factory=Counter)
    rows_by_file: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    turns_in_conversation_rows: int = 0

    def add(self, shard: ShardRows) -> None:
        """Count one tokenized shard."""
        self.shards_read += 1
        self.completions_read += shard.completions_read
        self.dropped.update(shard.dropped)
        self.turns_in_conversation_rows += shard.turns_in_conversation_rows
        self.count(shard.lengths, sum(shard.loss_tokens))
        self.rows_by_dataset.update(shard.datasets)
        self.rows_by_file[shard.key] += shard.rows
        for dataset, tokens in zip(shard.datasets, shard.lengths, strict=True):
            self.tokens_by_dataset[dataset] += tokens


def merge_and_tokenize(
    store: Store,
    layout: RunLayout,
    config: RunConfig,
    *,
    in_process_below: int = IN_PROCESS_BELOW_BYTES,
    window_part: bool = False,
) -> TokenizeSummary:
    """Merge every finished completion shard of a run not merged yet: Parquet parts and a new dataset version.

    Each call merges the files no earlier merge round took, as the run's next round (:mod:`merge_rounds`):
    a window-ended attempt publishes the shards finished in it, the run's continuation the rest, as the next
    version on top of it. An interrupted round is finished first, with the files it fixed.

    Args:
        store: The run's output store.
        layout: The run's keys.
        config: The run configuration (``tokenize`` section, ``model.tokenizer``; ``tokenize.base_version`` is
            the base of the run's first round).
        in_process_below: Without ``tokenize.workers``, fewer bytes of completions than this are tokenized
            in this process (see :func:`~datagen.dataset.tokenize_workers.plan_workers`).
        window_part: A window-ended attempt's merge, not the run's last: a round whose every completion is
            dropped is finished without a version, so the continuation's files make the next round.

    Returns:
        The run's merge over all its rounds (:func:`combine_rounds`; one round: its stored summary, untouched).
        Its ``dataset_version`` is None only for a window part whose rounds all published nothing.

    Raises:
        ConfigError: The tokenizer or the base version cannot be read.
        TokenizeError: Parts of an interrupted round do not match the completions any more.
        NoTrainingRowsError: Not a window part, and the round (or every round of the run) made no row.

    """
    merged = 0
    while True:
        finished, incomplete = _finished_shards(store, layout)
        round_shards = next_merge_round(store, layout, list(finished), config.tokenize.base_version)
        if round_shards is None:
            break
        _merge_round(store, layout, config, round_shards, finished, incomplete, in_process_below, window_part)
        merged += 1
    if not merged:
        logger.info("merge already complete run_id=%s", layout.run_id)
    combined = combine_rounds(finished_rounds(store, layout))
    if not window_part and combined.dataset_version is None:
        # Every round was a window part that published nothing, and the run's end brought no file of its own.
        raise _no_rows(layout, combined.completions_read, combined.dropped_by_reason)
    return combined


def _no_rows(layout: RunLayout, completions: int, dropped: dict[str, int]) -> NoTrainingRowsError:
    reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(dropped.items()))
    return NoTrainingRowsError(
        f"run {layout.run_id}: every one of the {completions} completions merged was dropped ({reasons}), so no "
        "dataset version was published; every answer stays stored. Answers that hit max_tokens are kept only "
        "with tokenize.include_truncated: true; a new run id with a larger sampling.max_tokens or that setting "
        "makes training rows.",
        run_id=layout.run_id,
    )


def _merge_round(
    store: Store,
    layout: RunLayout,
    config: RunConfig,
    round_shards: MergeRoundShards,
    finished: dict[str, int],
    incomplete: list[str],
    in_process_below: int,
    window_part: bool,
) -> TokenizeSummary:
    """Tokenize one merge round's files into its parts, publish its version, write its summary last.

    A round without a row publishes no version (one would read as done): a window part's round is finished
    without one (:func:`merge_and_tokenize`), any other is refused and stays open.
    """
    settings = config.tokenize
    number = round_shards.merge_round
    missing = [key for key in round_shards.shards if key not in finished]
    if missing:
        raise TokenizeError(
            f"run {layout.run_id}: merge round {number} lists {missing[0]}, which has no done marker now; the "
            "run's completions changed since. Start a new run id.",
            run_id=layout.run_id,
        )
    base = read_base_version(store, round_shards.base_version) if round_shards.base_version else None
    logger.info("merging run_id=%s round=%d shards=%d", layout.run_id, number, len(round_shards.shards))
    parts, tally, resumed = write_tokenized_parts(
        store,
        layout,
        store,
        round_shards.shards,
        tokenizer=config.model.tokenizer,
        settings=settings,
        shard_bytes=sum(finished[key] for key in round_shards.shards),
        in_process_below=in_process_below,
        merge_round=number,
    )
    empty = bool(tally.completions_read) and not tally.rows
    if empty and not window_part:
        # A version without a row would read as done; the answers stay stored for a run that keeps them.
        raise _no_rows(layout, tally.completions_read, dict(tally.dropped))
    version_key: str | None = None
    version_url: str | None = None
    version_rows = base[1].rows if base else 0
    exports: list[ExportRecord] = []
    if not empty:
        version_key, version = _write_dataset_version(store, layout, config, parts, base, number)
        version_url, version_rows, exports = store.url(version_key), version.rows, version.exports
    summary = TokenizeSummary(
        run_id=layout.run_id,
        tokenizer=config.model.tokenizer,
        shards_read=tally.shards_read,
        shards_incomplete=incomplete,
        completions_read=tally.completions_read,
        rows=tally.rows,
        total_tokens=tally.tokens,
        loss_tokens=tally.loss_tokens,
        rows_by_dataset=dict(sorted(tally.rows_by_dataset.items())),
        tokens_by_dataset=dict(sorted(tally.tokens_by_dataset.items())),
        dropped_by_reason=dict(sorted(tally.dropped.items())),
        turns_in_conversation_rows=tally.turns_in_conversation_rows,
        parts=parts,
        resumed_parts=resumed,
        dataset_name=settings.dataset_name,
        dataset_version=version_key,
        dataset_version_url=version_url,
        dataset_version_rows=version_rows,
        base_version=round_shards.base_version,
        exports=exports,
        merge_round=number,
        shards_merged=round_shards.shards,
    )
    try:
        store.write_json(layout.merge_summary(number), summary)
    except OutputExistsError:
        # Another process on the same run finished the round first; its summary describes the same parts.
        logger.info(
            "tokenize summary already written by another attempt; adopting it run_id=%s round=%d",
            layout.run_id,
            number,
        )
        return TokenizeSummary.model_validate(store.read_json(layout.merge_summary(number)))
    logger.info(
        "merged run_id=%s round=%d rows=%d loss_tokens=%d parts=%d dropped=%s version=%s",
        layout.run_id,
        number,
        summary.rows,
        summary.loss_tokens,
        len(parts),
        summary.dropped_by_reason,
        version_key,
    )
    return summary


def write_tokenized_parts(
    store: Store,
    layout: RunLayout,
    source: Store,
    keys: list[str],
    *,
    tokenizer: str,
    settings: TokenizeConfig,
    shard_bytes: int,
    in_process_below: int = IN_PROCESS_BELOW_BYTES,
    merge_round: int = 0,
) -> tuple[list[TokenizedPartRef], PartsTally, int]:
    """Tokenize completions files into the write-once Parquet parts of ``layout``, resuming an earlier attempt.

    Parts an interrupted attempt left are kept (their rows are recomputed for the counts, not written again)
    after checking that each still ends at the same completion.

    Args:
        store: Where the parts go.
        layout: Whose ``tokenized/part-*.parquet`` keys they get.
        source: Where the completions files are (read only).
        keys: The completions files, in output order.
        tokenizer: The target's tokenizer folder.
        settings: Workers, part and row-group sizes, filters.
        shard_bytes: Bytes of the completions files (from the listing): with ``settings.workers`` unset, less
            than ``in_process_below`` is tokenized in this process (:func:`plan_workers`).
        in_process_below: See ``shard_bytes``.
        merge_round: The run's merge round whose parts these are (their keys).

    Returns:
        Every part (kept and new, in order), the counts, and how many parts were kept.

    Raises:
        TokenizeError: Kept parts do not match the completions any more.

    """
    existing = _existing_parts(store, layout, settings.rows_per_part, merge_round)
    tally = PartsTally()
    parts: list[TokenizedPartRef] = [
        TokenizedPartRef(key=part.key, url=store.url(part.key), rows=part.rows, source=layout.run_id)
        for part in existing
    ]
    skip_rows = sum(part.rows for part in existing)
    boundaries = _cumulative_boundaries(existing)
    writer = PartWriter(
        store,
        layout,
        rows_per_part=settings.rows_per_part,
        row_group_rows=settings.row_group_rows,
        first_index=len(existing),
        on_part=lambda key, url, rows: parts.append(
            TokenizedPartRef(key=key, url=url, rows=rows, source=layout.run_id)
        ),
        merge_round=merge_round,
    )

    def make_job() -> TokenizeJob:
        return TokenizeJob(
            spec=shared_spec(tokenizer),
            max_length_tokens=settings.max_length_tokens,
            include_truncated=settings.include_truncated,
            answer_render=settings.answer_render,
            conversation_rows=settings.conversation_rows,
        )

    plan = plan_workers(settings.workers, len(keys), shard_bytes, in_process_below=in_process_below)
    logger.info("%s", plan.reason)
    report_work(WorkProgress(what="tokenize", done=0, total=len(keys), unit="files"))
    for shard in tokenize_shards(make_job, source, keys, plan.workers):
        first_row = tally.rows
        tally.add(shard)
        report_work(
            WorkProgress(
                what="tokenize",
                done=tally.shards_read,
                total=len(keys),
                unit="files",
                detail=f"{tally.rows} rows",
            )
        )
        sources = [f"{shard.key}#{line}" for line in shard.lines]
        for end in boundaries:
            if first_row < end <= tally.rows:
                _check_resumed_boundary(boundaries, end, sources[end - first_row - 1])
        skip = min(shard.rows, max(0, skip_rows - first_row))
        if skip < shard.rows:
            writer.add(shard_table(shard).slice(skip), sources[skip:])
    if tally.rows < skip_rows:
        raise TokenizeError(
            f"Run {layout.run_id}: an earlier attempt wrote {skip_rows} tokenized rows but the completions "
            f"now yield only {tally.rows}. The completions changed since; start a new run id.",
            run_id=layout.run_id,
        )
    writer.close()
    return parts, tally, len(existing)


def _finished_shards(store: Store, layout: RunLayout) -> tuple[dict[str, int], list[str]]:
    """Completion files whose done marker exists, with their sizes, and those without one.

    A retry round's completions file (``shard-N.retry-R.jsonl``, answers of requests that had failed) counts
    once its round's marker exists; every request is in exactly one counted file. First generations come
    first (sorted), then each retry round's files: rows an earlier merge attempt tokenized keep their place.
    """
    found: list[tuple[int, str, int]] = []
    incomplete: list[str] = []
    # One level at a time, whole keys only: a folder nested below a dataset's shards is never read.
    for folder in store.list_level(layout.completions_prefix).folders:
        for key, size in store.list_level(folder).objects.items():
            shard = layout.parse_completions(key)
            if shard is None:
                continue
            dataset, index, retry_round = shard
            if store.exists(layout.shard_done(dataset, index, retry_round)):
                found.append((retry_round, key, size))
            else:
                incomplete.append(key)
    finished = {key: size for _, key, size in sorted(found)}
    if incomplete:
        logger.warning(
            "completion shards without done marker skipped count=%d first=%s", len(incomplete), incomplete[0]
        )
    return finished, incomplete


def _existing_parts(
    store: Store, layout: RunLayout, rows_per_part: int, merge_round: int = 0
) -> list[_ExistingPart]:
    """Parts a merge round's interrupted attempt left, checked to be contiguous and full (the last may be short)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    level = store.list_level(layout.tokenized_prefix(merge_round)).objects
    keys = [key for key in level if layout.parse_tokenized_part(key, merge_round) is not None]
    parts: list[_ExistingPart] = []
    for position, key in enumerate(keys):
        if key != layout.tokenized_part(position, merge_round):
            raise TokenizeError(
                f"Tokenized parts of run {layout.run_id} are not contiguous ({key} where "
                f"{layout.tokenized_part(position, merge_round)} was expected); start a new run id.",
                run_id=layout.run_id,
            )
        metadata = pq.read_metadata(pa.BufferReader(store.read_bytes(key)))
        extra = metadata.metadata or {}
        parts.append(_ExistingPart(key, metadata.num_rows, extra.get(PART_LAST_SOURCE_KEY, b"").decode()))
    for part in parts[:-1]:
        if part.rows != rows_per_part:
            raise TokenizeError(
                f"Tokenized part {part.key} holds {part.rows} rows, not rows_per_part={rows_per_part}; "
                "it was written with another configuration. Start a new run id.",
                run_id=layout.run_id,
            )
    if parts:
        logger.info("resuming merge run_id=%s existing_parts=%d", layout.run_id, len(parts))
    return parts


def _cumulative_boundaries(parts: list[_ExistingPart]) -> dict[int, _ExistingPart]:
    """Map the row count at the end of each existing part to that part."""
    boundaries: dict[int, _ExistingPart] = {}
    total = 0
    for part in parts:
        total += part.rows
        boundaries[total] = part
    return boundaries


def _check_resumed_boundary(boundaries: dict[int, _ExistingPart], row_count: int, source: str) -> None:
    part = boundaries.get(row_count)
    if part is not None and part.last_source != source:
        raise TokenizeError(
            f"Tokenized part {part.key} ends at completion {part.last_source or '(unknown)'} but the same "
            f"row is now {source}: the completions or the filters changed since it was written. "
            "Start a new run id.",
            key=part.key,
        )


def _write_dataset_version(
    store: Store,
    layout: RunLayout,
    config: RunConfig,
    parts: list[TokenizedPartRef],
    base: tuple[str, DatasetVersion] | None,
    merge_round: int,
) -> tuple[str, DatasetVersion]:
    """Write the next free version of the dataset (or return this merge round's version from an earlier attempt)."""
    name = config.tokenize.dataset_name
    numbers: list[int] = []
    for key in store.list_level(dataset_versions_prefix(name)).objects:
        number = parse_dataset_version(name, key)
        if number is None:
            continue
        numbers.append(number)
        stored = store.read_json(key)
        if (
            isinstance(stored, dict)
            and stored.get("run_id") == layout.run_id
            and stored.get("merge_round", 0) == merge_round
        ):
            # An interrupted attempt of this round already published its version: reuse it, never add a second.
            return key, DatasetVersion.model_validate(stored)
    inherited: list[TokenizedPartRef] = []
    inherited_sources: list[CompletionSourceRef] = []
    base_url: str | None = None
    if base is not None:
        base_url, base_version = base
        inherited = [
            shard.model_copy(
                update={
                    "source": shard.source
                    if shard.source.startswith(("base:", "adopted:"))
                    else f"base:{base_url}"
                }
            )
            for shard in base_version.shards
        ]
        inherited_sources = list(base_version.completion_sources)
    shards = [*inherited, *parts]
    exports: list[ExportRecord] = []
    if JSONL_FORMAT in config.tokenize.formats:
        # Written before the manifest (its keys depend only on the parts), so the manifest can list it.
        from datagen.dataset.export import write_export

        exports.append(write_export(store, name, shards))
    key, version = claim_version(
        store,
        numbers,
        TokenizeError,
        DatasetVersion(
            name=name,
            version=1,
            run_id=layout.run_id,
            base_version=base_url,
            rows=sum(shard.rows for shard in shards),
            shards=shards,
            completion_sources=inherited_sources,
            exports=exports,
            merge_round=merge_round,
        ),
    )
    logger.info("wrote dataset version key=%s rows=%d shards=%d", key, version.rows, len(shards))
    return key, version
