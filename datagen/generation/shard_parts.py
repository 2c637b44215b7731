"""A shard's checkpoint parts: reading what they hold, and writing new ones write-once.

This module owns the parts under ``parts/<dataset>/shard-NNNNN/`` (``{completions,failures}-NNNNN.jsonl``, one
folder per retry round): :func:`read_parts` gathers what every part of a round holds (how an interrupted shard
resumes, and what its final files are assembled from), :class:`CheckpointWriter` stores results as new parts at the
next free index, patiently while storage fails transiently (:data:`STORAGE_PATIENCE_S`).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from datagen.errors import OutputExistsError, is_transient, unfixable_storage_error
from datagen.output.layout import RunLayout
from datagen.output.store import Store
from datagen.records import CompletionRecord, FailureRecord

logger = logging.getLogger(__name__)

PART_NAME = re.compile(r"(completions|failures)-(\d+)\.jsonl")

# How long the shard's last flush keeps trying a storage that fails transiently (S3 refusing connections, 5xx)
# before the shard gives up (its results stay held for the next attempt): an outage of minutes costs nothing.
STORAGE_PATIENCE_S = 300.0
STORAGE_RETRY_MAX_S = 10.0


@dataclass
class ShardParts:
    """What the checkpoint parts of a shard hold, first occurrence of each request key kept.

    Attributes:
        completions: Completion per request key, in part order.
        failures: Failure per request key, in part order.
        part_count: How many part objects exist.
        next_completions_part: The first completions part index above every existing one.
        next_failures_part: The first failures part index above every existing one.

    """

    completions: dict[str, CompletionRecord] = field(default_factory=dict)
    failures: dict[str, FailureRecord] = field(default_factory=dict)
    part_count: int = 0
    next_completions_part: int = 0
    next_failures_part: int = 0

    def keys(self) -> set[str]:
        """Request keys with any result."""
        return set(self.completions) | set(self.failures)


def read_parts(
    store: Store,
    layout: RunLayout,
    dataset: str,
    index: int,
    known: dict[str, list[CompletionRecord] | list[FailureRecord]] | None = None,
    retry_round: int = 0,
) -> ShardParts:
    """Read every checkpoint part of one shard (of one retry round: round 0 ignores the rounds' folders).

    Args:
        store: The run's store.
        layout: The run's keys.
        dataset: The dataset name.
        index: The shard index.
        known: Records of parts this process wrote itself, by key: used instead of reading them back
            (write-once: a part never changes after it is written).
        retry_round: The round whose parts to read.

    Returns:
        The parts' content.

    """
    parts = ShardParts()
    located = []
    prefix = layout.shard_parts_prefix(dataset, index, retry_round)
    # One level (a retry round's folder below this round's parts is not this round's), whole names only.
    for key in store.list_level(prefix).objects:
        match = PART_NAME.fullmatch(key.removeprefix(f"{prefix}/"))
        if match:
            located.append((int(match.group(2)), match.group(1), key))
    known = known or {}
    for number, kind, key in sorted(located):
        parts.part_count += 1
        cached = known.get(key)
        if kind == "completions":
            parts.next_completions_part = max(parts.next_completions_part, number + 1)
            completions = cached if cached is not None else _read_records(store, key, CompletionRecord)
            for completion in completions:
                assert isinstance(completion, CompletionRecord)
                parts.completions.setdefault(completion.key, completion)
        else:
            parts.next_failures_part = max(parts.next_failures_part, number + 1)
            failures = cached if cached is not None else _read_records(store, key, FailureRecord)
            for failure in failures:
                assert isinstance(failure, FailureRecord)
                parts.failures.setdefault(failure.key, failure)
    return parts


def _read_records(
    store: Store, key: str, model: type[CompletionRecord] | type[FailureRecord]
) -> list[CompletionRecord] | list[FailureRecord]:
    return [model.model_validate_json(line) for line in store.iter_lines(key)]  # type: ignore[return-value]


@dataclass
class CheckpointWriter:
    """Writes checkpoint parts at the next free index, stepping over indices another writer took.

    The shard's run (:mod:`~datagen.generation.shard`) flushes its buffered results through one per attempt;
    each flush is a new write-once part, so results stored are never sent again after an interruption.

    Attributes:
        store: The run's store.
        layout: The run's keys.
        dataset: The dataset name.
        index: The shard index.
        next_completions: The next completions part index to try.
        next_failures: The next failures part index to try.
        retry_round: The retry round the parts belong to.
        written: What this writer stored, by key.

    """

    store: Store
    layout: RunLayout
    dataset: str
    index: int
    next_completions: int
    next_failures: int
    retry_round: int = 0
    # What this writer stored, by key: the shard's final assembly reuses it instead of reading it back.
    written: dict[str, list[CompletionRecord] | list[FailureRecord]] = field(default_factory=dict)

    def flush(self, completions: list[CompletionRecord], failures: list[FailureRecord]) -> None:
        """Store both lists as parts, emptying each once it is stored (what raises stays in its list).

        Raises:
            UnfixableStorageError: The write failed for a reason retrying cannot fix.
        """
        try:
            if completions:
                self.next_completions = self._write(
                    self.layout.completions_part, self.next_completions, list(completions)
                )
                completions.clear()
            if failures:
                self.next_failures = self._write(
                    self.layout.failures_part, self.next_failures, list(failures)
                )
                failures.clear()
        except Exception as error:
            unfixable = unfixable_storage_error(
                error,
                self.store.url(self.layout.shard_parts_prefix(self.dataset, self.index, self.retry_round)),
            )
            if unfixable is not None:
                raise unfixable from error
            raise

    def flush_patiently(self, completions: list[CompletionRecord], failures: list[FailureRecord]) -> None:
        """:meth:`flush`, trying again for up to :data:`STORAGE_PATIENCE_S` while storage fails transiently."""
        deadline = time.monotonic() + STORAGE_PATIENCE_S
        delay = 0.5
        while True:
            try:
                self.flush(completions, failures)
                return
            except Exception as error:
                if not is_transient(error) or time.monotonic() + delay > deadline:
                    raise
                logger.warning(
                    "storage write failed, results kept and tried again dataset=%s shard=%d results=%d "
                    "retry_in_s=%.1f error=%s",
                    self.dataset,
                    self.index,
                    len(completions) + len(failures),
                    delay,
                    error,
                )
            time.sleep(delay)
            delay = min(delay * 2, STORAGE_RETRY_MAX_S)

    def _write(self, key_of: Callable[[str, int, int, int], str], part: int, records: list[Any]) -> int:
        while True:
            key = key_of(self.dataset, self.index, part, self.retry_round)
            try:
                self.store.write_jsonl(key, records)
            except OutputExistsError:
                # Another attempt of this shard is writing too; its parts are as good as ours.
                part += 1
                continue
            logger.debug("wrote part key=%s records=%d", key, len(records))
            self.written[key] = records
            return part + 1
