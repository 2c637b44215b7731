"""What a run's recorded failures say: whether the run may publish, which failures may be sent again.

A run whose requests mostly failed (a wrong server answering, a model that is not loaded) must not end
"complete" with an empty dataset version: past ``generation.max_failed_share`` of failed requests, or when
every request of a dataset failed, :func:`check_failed_share` raises before the merge, naming the dominant
failure (its type, count and one example reason) and the fix.

A failure is *retryable* (:func:`is_retryable`, sent again by ``--retry-failed``) unless its reason is the
prompt's own: a 4xx about the request (too long, malformed), a prompt the chat template cannot render, tool
arguments that are not JSON. Server errors, resets, timeouts, and 4xx about the server's state (another
model pinned, the model not found, a wrong key, too many requests) say nothing about the prompt.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

from datagen.errors import TooManyFailuresError
from datagen.generation.sglang_generate import UNRENDERABLE_PROMPT
from datagen.output.store import Store
from datagen.records import FailureRecord, ShardSummary

# Failure types that are the prompt's own whatever the server: sending them again gives the same answer.
PROMPT_FAILURE_TYPES = frozenset({UNRENDERABLE_PROMPT, "invalid_tool_arguments"})
# 4xx answers about the server rather than the request: auth, not found (the model), timeout, conflict, rate.
SERVER_STATE_4XX = frozenset({401, 403, 404, 408, 409, 429})
HTTP_SERVER_ERROR = 500
# What an engine says in a 4xx when the request was fine but the server serves something else.
SERVER_STATE_REASON = re.compile(
    r"pinned to|model\W.*\b(not found|does not exist|not loaded|not served|unknown)|no such model|unknown model",
    re.IGNORECASE,
)


def is_retryable(failure: FailureRecord) -> bool:
    """Whether a recorded failure may succeed when sent again (its reason is not the prompt's own)."""
    if failure.error_type in PROMPT_FAILURE_TYPES:
        return False
    if not failure.error_type.startswith("http_"):
        return True  # retries exhausted (resets, timeouts, 5xx), repeated internal errors
    status = failure.last_status or int(failure.error_type.removeprefix("http_") or 0)
    if status >= HTTP_SERVER_ERROR or status in SERVER_STATE_4XX:
        return True
    return bool(SERVER_STATE_REASON.search(failure.reason))


def dominant_failure(summaries: Sequence[ShardSummary]) -> tuple[str, int]:
    """The failure type most requests ended with, and how many (``("", 0)`` without failures)."""
    reasons: Counter[str] = Counter()
    for summary in summaries:
        reasons.update(summary.failure_reasons)
    if not reasons:
        return "", 0
    return reasons.most_common(1)[0]


def _example_reason(store: Store, summaries: Sequence[ShardSummary], error_type: str) -> str:
    """One recorded reason of ``error_type`` (the first shard that has one), for the message."""
    for summary in summaries:
        if summary.failure_reasons.get(error_type):
            for row in store.iter_jsonl(summary.failures_path):
                failure = FailureRecord.model_validate(row)
                if failure.error_type == error_type:
                    return failure.reason
    return ""


def check_failed_share(store: Store, summaries: Sequence[ShardSummary], max_failed_share: float) -> None:
    """Refuse to publish a run with too many failed requests.

    Args:
        store: The run's store (to quote one failure's reason).
        summaries: Every shard's summary.
        max_failed_share: ``generation.max_failed_share``.

    Raises:
        TooManyFailuresError: The share of failed requests is above ``max_failed_share``, or every request
            of some dataset failed.
    """
    requests = sum(s.requests for s in summaries)
    failures = sum(s.failures for s in summaries)
    if not requests or not failures:
        return
    by_dataset: dict[str, list[int]] = {}
    for summary in summaries:
        counts = by_dataset.setdefault(summary.dataset, [0, 0])
        counts[0] += summary.requests
        counts[1] += summary.completions
    lost = sorted(name for name, (asked, answered) in by_dataset.items() if asked and not answered)
    share = failures / requests
    if share <= max_failed_share and not lost:
        return
    error_type, count = dominant_failure(summaries)
    example = _example_reason(store, summaries, error_type)
    why = (
        f"every request of dataset(s) {', '.join(lost)} failed"
        if lost and share <= max_failed_share
        else f"{failures} of {requests} requests failed ({share:.1%} > generation.max_failed_share "
        f"{max_failed_share:.1%})"
    )
    again = retryable_failures(store, summaries)
    fix = (
        f"Fix the servers or the model they serve, then send the {again} failed requests worth sending "
        "again with --retry-failed (a deployment's retry_failed)"
        if again
        else "None of them is worth sending again (their reasons are the prompts' own): read the failures "
        "files of the run and fix the prompts or the sampling in a new run"
    )
    raise TooManyFailuresError(
        f"{why}; most: {error_type} x{count}"
        + (f" ({example})" if example else "")
        + f". No dataset version was published; every result is stored. {fix}",
        retryable=again,
        failures=failures,
        requests=requests,
        error_type=error_type,
    )


def retryable_failures(store: Store, summaries: Sequence[ShardSummary]) -> int:
    """How many standing failures of these shards (their latest rounds) ``--retry-failed`` would send again."""
    count = 0
    for summary in summaries:
        if summary.failures:
            rows = store.iter_jsonl(summary.failures_path)
            count += sum(is_retryable(FailureRecord.model_validate(row)) for row in rows)
    return count
