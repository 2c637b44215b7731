"""What a run's recorded failures say: whether the run may publish, and the one line that explains why not.

A run whose requests mostly failed (a wrong server answering, a model that is not loaded) must not end
"complete" with an empty dataset version: past ``generation.max_failed_share`` of failed requests, or when
every request of a dataset failed, :func:`check_failed_share` raises before the merge, naming the dominant
failure (its type, count and one example reason) and the fix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from datagen.errors import TooManyFailuresError
from datagen.output.store import Store
from datagen.records import FailureRecord, ShardSummary


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
    raise TooManyFailuresError(
        f"{why}; most: {error_type} x{count}" + (f" ({example})" if example else "") + ". No dataset version "
        "was published; every result is stored. Fix the servers or the model they serve, then run again with "
        "the same run id and retry_failed (`datagen run ... --retry-failed`) to send the failed requests again",
        failures=failures,
        requests=requests,
        error_type=error_type,
    )
