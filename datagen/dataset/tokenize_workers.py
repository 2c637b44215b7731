"""Tokenize completion shards in worker processes, in order, with bounded memory.

Each task is one finished completions shard, read by the parent (so workers need no storage credentials) and
sent as bytes: a worker splits its JSON lines, validates them, drops what must not be trained on (counting
why), tokenizes the rest in batches (:class:`~datagen.dataset.tokenize.RowTokenizer`; with
``tokenize.conversation_rows: per_conversation``, an on-policy conversation's turns become one row,
:mod:`~datagen.dataset.conversation_rows`) and returns the rows in columnar form (flat ``int32`` token ids, an
``int8`` mask, row lengths), which the parent turns into Arrow without touching Python ints. The parent
consumes results in shard order, with at most ``2 x workers`` shards in flight, so the output order is
deterministic and memory does not grow with the number of rows. Workers are started with ``spawn`` (safe next
to the threads of a Prefect task run) and rebuild the Rust tokenizer from its serialized form rather than
importing ``AutoTokenizer``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from datagen.dataset.conversation_rows import (
    PER_CONVERSATION,
    PER_TURN,
    ConversationGrouper,
    ConversationRows,
    RowSource,
)
from datagen.dataset.tokenize import AnswerRender, EncodedRow, RejectedRow, RowTokenizer
from datagen.dataset.tokenizer import TokenizerSpec
from datagen.errors import TokenizeError
from datagen.output.objects import size_text
from datagen.output.store import Store
from datagen.processes import usable_cores
from datagen.records import CompletionRecord

logger = logging.getLogger(__name__)

DROP_TRUNCATED = "truncated"
DROP_EMPTY = "empty_completion"
DROP_INVALID = "invalid_record"
DROP_TEMPLATE = "template_mismatch"
# Completions per tokenizer call: large enough to amortize the per-call cost, small enough (~1 MB of text)
# that a batch never dominates a worker's memory.
BATCH_COMPLETIONS = 256
# Shards in flight per worker: one being tokenized, one queued, so no worker waits on the parent.
IN_FLIGHT_PER_WORKER = 2
# Unless tokenize.workers says otherwise, completions under this many bytes are tokenized in this process:
# workers save wall time only once the work outweighs their start-up (spawn, imports, the tokenizer rebuilt),
# and every worker started for less burns that CPU for nothing (figures: docs/performance.md, "Thresholds in
# the code").
IN_PROCESS_BELOW_BYTES = 16 << 20


@dataclass(frozen=True)
class TokenizeJob:
    """Everything a worker needs, sent once when it starts.

    Attributes:
        spec: The target tokenizer (:class:`TokenizerSpec`).
        max_length_tokens: Longer rows are dropped as ``too_long``.
        include_truncated: Keep completions that hit max_tokens.
        answer_render: See :class:`~datagen.dataset.tokenize.RowTokenizer`.
        conversation_rows: ``per_turn`` (a row per stored turn) or ``per_conversation`` (a row per on-policy
            conversation, :mod:`~datagen.dataset.conversation_rows`).

    """

    spec: TokenizerSpec
    max_length_tokens: int | None
    include_truncated: bool
    answer_render: AnswerRender = "auto"
    conversation_rows: ConversationRows = PER_TURN


@dataclass
class ShardRows:
    """The rows of one completions shard, columnar, plus what was read and dropped.

    Attributes:
        key: The shard's key.
        completions_read: JSON lines read.
        dropped: Completions not kept, by reason.
        turns_in_conversation_rows: On-policy turns held as history by a later turn's per-conversation row
            (neither rows of their own nor dropped).
        lines: Source line (0-based) of each row, for the resume check.
        lengths: Tokens per row.
        input_ids: Every row's ids, concatenated.
        loss_mask: Every row's mask, concatenated (0/1 bytes).

    """

    key: str
    completions_read: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    turns_in_conversation_rows: int = 0
    lines: list[int] = field(default_factory=list)
    prompt_ids: list[str] = field(default_factory=list)
    sample_indices: list[int] = field(default_factory=list)
    datasets: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    tokenized_from: list[str] = field(default_factory=list)
    lengths: array[int] = field(default_factory=lambda: array("i"))
    loss_tokens: array[int] = field(default_factory=lambda: array("i"))
    input_ids: array[int] = field(default_factory=lambda: array("i"))
    loss_mask: bytearray = field(default_factory=bytearray)

    @property
    def rows(self) -> int:
        """Rows kept."""
        return len(self.lines)

    def add(self, line: int, record: CompletionRecord, row: EncodedRow) -> None:
        """Append one row."""
        size = len(row.input_ids)
        self.lines.append(line)
        self.prompt_ids.append(record.prompt_id)
        self.sample_indices.append(record.sample_index)
        self.datasets.append(record.dataset)
        self.finish_reasons.append(record.finish_reason)
        self.tokenized_from.append(row.tokenized_from)
        self.lengths.append(size)
        self.loss_tokens.append(row.loss_tokens)
        self.input_ids.extend(row.input_ids)
        done = 0
        for start, end in row.spans:
            self.loss_mask += bytes(start - done)
            self.loss_mask += b"\x01" * (end - start)
            done = end
        self.loss_mask += bytes(size - done)


class ShardTokenizer:
    """Tokenizes whole shards with one :class:`RowTokenizer` (one per process)."""

    def __init__(self, job: TokenizeJob) -> None:
        self.job = job
        self.rows = RowTokenizer(
            job.spec, max_length_tokens=job.max_length_tokens, answer_render=job.answer_render
        )

    def tokenize_shard(self, key: str, data: bytes) -> ShardRows:
        """Screen and tokenize one shard's JSON lines (see the module docstring)."""
        result = ShardRows(key)
        batch: list[RowSource] = []
        grouper = ConversationGrouper() if self.job.conversation_rows == PER_CONVERSATION else None
        for line, raw in enumerate(data.splitlines()):
            if not raw.strip():
                continue
            result.completions_read += 1
            record = self._parse(key, line, raw, result)
            if record is None:
                continue
            if grouper is not None and record.turn is not None:
                # The screen decides which turn the conversation's row ends on (conversation_rows.py).
                finished = grouper.add(line, record, self._drop_reason(record))
                if finished is not None:
                    batch.append(finished)
            else:
                if grouper is not None:
                    # Rows keep the shard's order: a conversation before this record ends here.
                    finished = grouper.close()
                    if finished is not None:
                        batch.append(finished)
                reason = self._drop_reason(record)
                if reason is not None:
                    result.dropped[reason] += 1
                    continue
                batch.append(RowSource(line, record, 0))
            if len(batch) >= BATCH_COMPLETIONS:
                self._tokenize_batch(batch, result)
                batch = []
        if grouper is not None:
            last = grouper.close()
            if last is not None:
                batch.append(last)
            result.dropped.update(grouper.dropped)
        if batch:
            self._tokenize_batch(batch, result)
        return result

    def _parse(self, key: str, line: int, raw: bytes, result: ShardRows) -> CompletionRecord | None:
        try:
            return CompletionRecord.model_validate_json(raw)
        except ValidationError as error:
            result.dropped[DROP_INVALID] += 1
            logger.warning("invalid completion record key=%s line=%d error=%s", key, line, error)
            return None

    def _drop_reason(self, record: CompletionRecord) -> str | None:
        """Why a completion is not trained on (truncated, empty), or None when it is kept."""
        if record.finish_reason == "length" and not self.job.include_truncated:
            return DROP_TRUNCATED
        completion = record.completion
        has_text = bool(completion.content and completion.content.strip()) or bool(completion.tool_calls)
        if not has_text and not completion.output_token_ids:
            return DROP_EMPTY
        return None

    def _tokenize_batch(self, batch: list[RowSource], result: ShardRows) -> None:
        whole = (
            [item.first_turn for item in batch] if self.job.conversation_rows == PER_CONVERSATION else None
        )
        encoded = self.rows.encode([item.record for item in batch], whole_conversations=whole)
        for item, row in zip(batch, encoded, strict=True):
            # A refused conversation row takes the turns it would have held with it, under the same reason.
            turns = 1 + item.history_turns
            if isinstance(row, TokenizeError):
                # One odd record must not sink the merge; a systematic mismatch shows as a large count.
                result.dropped[DROP_TEMPLATE] += turns
                logger.warning("completion not renderable key=%s error=%s", item.record.key, row)
            elif isinstance(row, RejectedRow):
                result.dropped[row.reason] += turns
            else:
                result.add(item.line, item.record, row)
                result.turns_in_conversation_rows += item.history_turns


_worker: ShardTokenizer | None = None
_worker_error: BaseException | None = None


def _start_worker(jobs: Any) -> None:
    global _worker, _worker_error
    # One process per core already: the tokenizer's own thread pool would only oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        # The imports above ran while the parent loaded the tokenizer; now wait for what it loaded.
        _worker = ShardTokenizer(jobs.get())
    except Exception as error:
        # An initializer that raises breaks the whole executor without the reason: keep it for the first task.
        _worker_error = error


def _tokenize_in_worker(key: str, data: bytes) -> ShardRows:
    if _worker is None:
        raise _worker_error or RuntimeError("tokenizer worker used before it started")
    return _worker.tokenize_shard(key, data)


@dataclass(frozen=True)
class WorkerPlan:
    """How many tokenizer processes a merge uses, and why (the log line).

    Attributes:
        workers: Processes for :func:`tokenize_shards` (1: this process).
        reason: Which path was taken and why, for the log.

    """

    workers: int
    reason: str


def plan_workers(
    requested: int | None,
    shards: int,
    shard_bytes: int,
    *,
    cores: int | None = None,
    in_process_below: int = IN_PROCESS_BELOW_BYTES,
) -> WorkerPlan:
    """Choose the tokenizer processes: ``tokenize.workers`` when set, else one per core unless the work is small.

    Args:
        requested: ``tokenize.workers`` (None: choose).
        shards: Completions files to tokenize.
        shard_bytes: Their bytes (from the store's listing).
        cores: Cores to use when choosing (default: :func:`~datagen.processes.usable_cores`).
        in_process_below: When choosing, fewer bytes than this are tokenized in this process
            (:data:`IN_PROCESS_BELOW_BYTES`).

    Returns:
        The workers and the reason.

    """
    work = f"{shards} shard{'s' if shards != 1 else ''}, {size_text(shard_bytes)}"
    if requested is not None:
        workers = min(requested, shards)
        if workers > 1:
            return WorkerPlan(
                workers, f"tokenizing in {workers} worker processes (tokenize.workers={requested}): {work}"
            )
        return WorkerPlan(1, f"tokenizing in this process (tokenize.workers={requested}): {work}")
    cores = cores or usable_cores()
    if shard_bytes < in_process_below:
        return WorkerPlan(1, f"tokenizing in this process: {work} (< {size_text(in_process_below)})")
    workers = min(cores, shards)
    if workers <= 1:
        why = "one core" if cores <= 1 else "one shard"
        return WorkerPlan(1, f"tokenizing in this process: {work} ({why})")
    return WorkerPlan(
        workers,
        f"tokenizing in {workers} worker processes: {work} (>= {size_text(in_process_below)}, {cores} cores)",
    )


def tokenize_shards(
    make_job: Callable[[], TokenizeJob], store: Store, keys: list[str], workers: int
) -> Iterator[ShardRows]:
    """Tokenize shards on ``workers`` processes (in this process when 1), yielding results in ``keys`` order.

    The worker processes start (and import) while ``make_job`` loads the tokenizer here, then receive it.

    Args:
        make_job: Builds what to tokenize with (loads the tokenizer); called once, here.
        store: Where the shards are (read here, in the parent).
        keys: Shard keys, in output order.
        workers: Worker processes.

    Yields:
        One :class:`ShardRows` per key, in order.

    """
    if workers <= 1 or len(keys) <= 1:
        local = ShardTokenizer(make_job())
        for key in keys:
            yield local.tokenize_shard(key, store.read_bytes(key))
        return
    context = multiprocessing.get_context("spawn")
    processes = min(workers, len(keys))
    jobs = context.Queue()
    # An executor, not a Pool: a worker that dies (killed, out of memory) breaks it loudly instead of leaving
    # its task waiting forever.
    with ProcessPoolExecutor(
        processes, mp_context=context, initializer=_start_worker, initargs=(jobs,)
    ) as executor:
        job = make_job()
        for _ in range(processes):
            jobs.put(job)
        pending: deque[Future[ShardRows]] = deque()
        queued = iter(keys)
        limit = workers * IN_FLIGHT_PER_WORKER
        for key in queued:
            pending.append(executor.submit(_tokenize_in_worker, key, store.read_bytes(key)))
            if len(pending) >= limit:
                break
        while pending:
            try:
                result = pending.popleft().result()
            except BrokenProcessPool as error:
                raise TokenizeError(
                    f"A tokenizer worker process died ({error}); if it ran out of memory, lower "
                    "tokenize.workers. Rerun the same run id to resume."
                ) from error
            next_key = next(queued, None)
            if next_key is not None:
                pending.append(executor.submit(_tokenize_in_worker, next_key, store.read_bytes(next_key)))
            yield result
