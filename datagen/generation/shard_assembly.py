"""A shard's final files and done marker, assembled from its checkpoint parts once every request has a result.

This module owns the end of a shard's round: the final completions and failures files, built from all parts
(deduplicated by request key: the first occurrence wins and a completion beats a failure), each written once
or, when another attempt wrote it first, adopted or verified; the shard's summary (a retry round's adds to the
round before); the done marker; and reading a shard's outcome back (:func:`latest_shard_summary`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable
from typing import TypeVar

from datagen.errors import OutputExistsError, StorageError
from datagen.generation.shard_parts import read_parts
from datagen.output.layout import RunLayout
from datagen.output.store import Store
from datagen.records import CompletionRecord, FailureRecord, PromptShardRef, ShardSummary

logger = logging.getLogger(__name__)


def latest_shard_summary(store: Store, layout: RunLayout, dataset: str, index: int) -> ShardSummary | None:
    """The shard's outcome: the done marker of its highest retry round (None while it is not done).

    Rounds follow each other (round R starts only from round R - 1's marker), so the markers are probed in
    order: a shard never retried costs two existence checks.
    """
    if not store.exists(layout.shard_done(dataset, index)):
        return None
    retry_round = 0
    while store.exists(layout.shard_done(dataset, index, retry_round + 1)):
        retry_round += 1
    return ShardSummary.model_validate(store.read_json(layout.shard_done(dataset, index, retry_round)))


def earlier_answers(store: Store, previous: ShardSummary, keys: set[str]) -> dict[str, CompletionRecord]:
    """The answers of ``keys`` that earlier rounds of a shard stored (its first generation's and each retry round's).

    A retry round of on-policy conversations resumes each from these (the history of the turn it sends again).
    """
    answers: dict[str, CompletionRecord] = {}
    for path in [previous.completions_path, *previous.retried_completions_paths]:
        for line in store.iter_lines(path):
            record = CompletionRecord.model_validate_json(line)
            if record.key in keys:
                answers[record.key] = record
    return answers


def assemble(
    store: Store,
    layout: RunLayout,
    shard: PromptShardRef,
    keys: list[str],
    *,
    resent: int,
    started: float,
    known: dict[str, list[CompletionRecord] | list[FailureRecord]] | None = None,
    previous: ShardSummary | None = None,
    standing: list[FailureRecord] | None = None,
    conversations: list[list[str]] | None = None,
) -> ShardSummary:
    """Write the final files from all parts (or verify earlier ones), then the done marker.

    The shard's run (:func:`~datagen.generation.shard.generate_shard`) calls it once every request has a
    result in the parts: storage, not the attempt's memory, decides what the final files hold.

    For a retry round (``previous`` is the summary of the round before, ``standing`` its failures), the
    round's completions file holds the answers of its requests, its failures file every failure of the
    shard still standing (the earlier ones not retried, plus the retried ones that failed again), and its
    marker the shard's whole new summary.

    Args:
        store: The run's store.
        layout: The run's keys.
        shard: The prompt shard.
        keys: The request keys of this round, in request order.
        resent: Requests this attempt sent again after an earlier attempt (the summary's ``resent_requests``).
        started: When the attempt started (``time.monotonic()``), for ``generation_s``.
        known: Records of parts this process wrote itself, by key (read instead of the parts themselves).
        previous: The summary of the round before, for a retry round.
        standing: The failures the round before left standing, for a retry round.
        conversations: The turn keys of each conversation of the shard (on-policy shards, every conversation in a
            retry round too), for its counts.

    Returns:
        The shard's summary, as its done marker holds it (another attempt's, when that one finished first).

    Raises:
        StorageError: The parts do not cover every request, or a final file from another attempt disagrees
            with them.

    """
    dataset, index = shard.dataset, shard.shard_index
    retry_round = previous.retry_round + 1 if previous is not None else 0
    parts = read_parts(store, layout, dataset, index, known, retry_round)
    completions = [parts.completions[key] for key in keys if key in parts.completions]
    failures = [parts.failures[key] for key in keys if key not in parts.completions and key in parts.failures]
    missing = len(keys) - len(completions) - len(failures)
    if missing:
        raise StorageError(
            f"shard {dataset}/{index}: {missing} of {len(keys)} requests have no result in "
            f"{store.url(layout.shard_parts_prefix(dataset, index, retry_round))} after generation; rerun the "
            "shard (finished requests are not sent again)",
            dataset=dataset,
            shard=index,
        )
    foreign = len(parts.keys() - set(keys))
    if foreign:
        logger.warning(
            "parts hold requests not in the prompt shard dataset=%s shard=%d count=%d",
            dataset,
            index,
            foreign,
        )
    completions_key = layout.completions(dataset, index, retry_round)
    failures_key = layout.failures(dataset, index, retry_round)
    completions = _write_or_adopt_completions(store, completions_key, completions, set(keys))
    # The completions file decides; failures are exactly the other requests. When another attempt (a crash's
    # predecessor, or a second process on the same run) wrote the completions first, its decision stands
    # and the failures file is derived from it, so no request can land in both files.
    completed = {record.key for record in completions}
    failed_keys = [key for key in keys if key not in completed]
    if any(key not in parts.failures for key in failed_keys):
        parts = read_parts(store, layout, dataset, index, known, retry_round)
    failures = [parts.failures[key] for key in failed_keys if key in parts.failures]
    if len(failures) != len(failed_keys):
        raise StorageError(
            f"shard {dataset}/{index}: {len(failed_keys) - len(failures)} requests are neither in "
            f"{store.url(completions_key)} nor failed in the checkpoint parts; rerun the shard",
            dataset=dataset,
            shard=index,
        )
    retried = set(keys)
    kept = [failure for failure in standing or [] if failure.key not in retried]
    failures = _write_or_verify(store, failures_key, [*kept, *failures], FailureRecord)
    still_failing = _keys(failures)
    summary = ShardSummary(
        dataset=dataset,
        shard_index=index,
        requests=previous.requests if previous is not None else len(keys),
        completions=len(completions),
        failures=len(failures),
        prompt_tokens=sum(record.usage.prompt_tokens for record in completions),
        completion_tokens=sum(record.usage.completion_tokens for record in completions),
        resent_requests=resent,
        retried_attempts=sum(max(c.attempts - 1, 0) for c in completions)
        + sum(max(f.attempts - 1, 0) for f in failures),
        generation_s=time.monotonic() - started,
        completions_path=completions_key,
        failures_path=failures_key,
        finish_reasons=dict(Counter(record.finish_reason for record in completions)),
        failure_reasons=dict(Counter(record.error_type for record in failures)),
        sampling_settings=dict(
            Counter(record.sampling_setting for record in completions if record.sampling_setting is not None)
        ),
        conversations=len(conversations or []),
        # Every turn has one outcome over the rounds: a conversation is complete when none of its turns still fails.
        conversations_completed=sum(
            not any(key in still_failing for key in turns) for turns in conversations or []
        ),
        retry_round=retry_round,
    )
    if previous is not None:
        summary = _after_round(previous, summary, new_completions=completions, kept_failures=kept)
    done_key = layout.shard_done(dataset, index, retry_round)
    try:
        store.write_json(done_key, summary)
    except OutputExistsError:
        # Another attempt finished the same shard first; its marker describes the same files.
        return ShardSummary.model_validate(store.read_json(done_key))
    return summary


def _after_round(
    previous: ShardSummary,
    round_summary: ShardSummary,
    *,
    new_completions: list[CompletionRecord],
    kept_failures: list[FailureRecord],
) -> ShardSummary:
    """The shard's summary after a retry round: the round before plus this round's answers."""
    finish_reasons = Counter(previous.finish_reasons)
    finish_reasons.update(round_summary.finish_reasons)
    sampling_settings = Counter(previous.sampling_settings)
    sampling_settings.update(round_summary.sampling_settings)
    kept_retries = sum(max(f.attempts - 1, 0) for f in kept_failures)
    return round_summary.model_copy(
        update={
            "completions": previous.completions + len(new_completions),
            "prompt_tokens": previous.prompt_tokens + round_summary.prompt_tokens,
            "completion_tokens": previous.completion_tokens + round_summary.completion_tokens,
            "resent_requests": previous.resent_requests + round_summary.resent_requests,
            # The failures the round kept are in the round's count and already in the previous one.
            "retried_attempts": previous.retried_attempts + round_summary.retried_attempts - kept_retries,
            "generation_s": previous.generation_s + round_summary.generation_s,
            "completions_path": previous.completions_path,
            "retried_completions_paths": [
                *previous.retried_completions_paths,
                round_summary.completions_path,
            ],
            "finish_reasons": dict(finish_reasons),
            "sampling_settings": dict(sampling_settings),
        }
    )


RecordT = TypeVar("RecordT", CompletionRecord, FailureRecord)


def _write_or_adopt_completions(
    store: Store, key: str, records: list[CompletionRecord], shard_keys: set[str]
) -> list[CompletionRecord]:
    """Write the final completions once; if another attempt wrote them first, adopt its file.

    Raises:
        StorageError: The existing file holds requests that are not in this shard (its inputs changed).
    """
    try:
        store.write_jsonl(key, records)
        return records
    except OutputExistsError:
        existing = [CompletionRecord.model_validate(row) for row in store.iter_jsonl(key)]
    unknown = {record.key for record in existing} - shard_keys
    if unknown:
        raise StorageError(
            f"{store.url(key)} exists but holds {len(unknown)} requests that are not in this shard: the shard's "
            "inputs changed between attempts. Keep the existing file and investigate; datagen never overwrites it.",
            url=store.url(key),
        )
    logger.info(
        "final completions already written by another attempt; adopted key=%s records=%d", key, len(existing)
    )
    return existing


def _write_or_verify(store: Store, key: str, records: list[RecordT], model: type[RecordT]) -> list[RecordT]:
    """Write ``records`` once; if an earlier attempt wrote ``key``, check it holds the same requests.

    Returns:
        The records now in storage (the earlier file's, when one existed).

    """
    try:
        store.write_jsonl(key, records)
    except OutputExistsError:
        existing = [model.model_validate(row) for row in store.iter_jsonl(key)]
        if _keys(existing) != _keys(records):
            raise StorageError(
                f"{store.url(key)} exists from an earlier attempt but holds {len(existing)} requests "
                f"where the checkpoint parts give {len(records)}: the shard's inputs changed between "
                "attempts. Keep the existing file and investigate; datagen never overwrites it.",
                url=store.url(key),
            ) from None
        logger.info(
            "final file already written by an earlier attempt; verified key=%s records=%d", key, len(existing)
        )
        return existing
    return records


def _keys(records: Iterable[CompletionRecord | FailureRecord]) -> set[str]:
    return {record.key for record in records}
