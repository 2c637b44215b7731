"""Why a request ended without an answer, and what that leads to: the one failure vocabulary and its rules.

Every failure has a :class:`FailureKind`; ``FailureRecord.error_type`` stores its value (an HTTP answer no
retry cures stores its status as well: ``http_<status>``), and those values never change, so every run ever
written still reads. :func:`fate` is the one decision of what a resolved failure leads to:

- :attr:`Fate.UNFINISHED`: not a result of the request (no server could take it, the dispatcher closed, or a
  storage fault stopped admission): never stored or counted as failed; the shard's next attempt sends it.
- :attr:`Fate.SEND_AGAIN`: counted and stored as failed, and ``--retry-failed`` sends it again: retries
  exhausted (resets, timeouts, 5xx), repeated internal errors, 4xx about the server's state (another model
  pinned, the model not found, a wrong key, too many requests).
- :attr:`Fate.GIVE_UP`: counted and stored as failed, and never sent again: the prompt's own (a 4xx about the
  request, a prompt the chat template cannot render, tool arguments that are not JSON).

Before a request resolves, each try is judged by :class:`datagen.generation.retry.RetryPolicy` (retry, on
another server where there is one, or give up with a kind). A run whose requests mostly failed must not end
"complete" with an empty dataset version: past ``generation.max_failed_share`` of failed requests, or when
every request of a dataset failed, :func:`check_failed_share` raises before the merge, naming the dominant
failure (its type, count and one example reason) and the fix. The share is of requests sent: the turns an
ended on-policy conversation never sent are left out of both counts.
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from collections.abc import Iterable, Sequence

from datagen.errors import TooManyFailuresError
from datagen.output.store import Store
from datagen.records import FailureRecord, ShardSummary

HTTP_PREFIX = "http_"


class FailureKind(enum.StrEnum):
    """Why a request ended without an answer; the value is what ``FailureRecord.error_type`` stores."""

    HTTP_STATUS = "http"
    """An HTTP answer no retry cures; stored with its status (``http_400``: :func:`error_type`)."""
    RETRIES_EXHAUSTED = "retries_exhausted"
    """Every attempt ended in a transient error (reset, timeout, 5xx, unusable answer)."""
    REPEATED_INTERNAL_ERROR = "repeated_internal_error"
    """HTTP 500s or resets from several servers: the request crashes whatever serves it."""
    INVALID_TOOL_ARGUMENTS = "invalid_tool_arguments"
    """The answer's tool call arguments are not a JSON object."""
    UNRENDERABLE_PROMPT = "unrenderable_prompt"
    """The chat template cannot render the prompt (exact-token mode: it is never sent)."""
    NO_LIVE_SERVERS = "no_live_servers"
    """No server was up for ``generation.no_live_server_timeout_s``."""
    DISPATCHER_CLOSED = "dispatcher_closed"
    """The dispatcher closed before the request finished."""
    ADMISSION_STOPPED = "admission_stopped"
    """A storage fault no retry cures stopped admission before the request was sent."""
    CONVERSATION_ENDED = "conversation_ended"
    """An on-policy conversation's turn never sent: an earlier turn failed, or its answer was cut short
    (``max_tokens``, aborted); the reason names the turn and why."""
    TOOL_CALL_DIVERGED = "tool_call_diverged"
    """An on-policy conversation's turn never sent: the target's tool calls at an earlier turn were not the ones
    the dataset recorded results for (other tools or arguments, none, or a call where the dataset answered)."""


class Fate(enum.StrEnum):
    """What a resolved failure leads to (module docstring)."""

    UNFINISHED = "unfinished"
    SEND_AGAIN = "send_again"
    GIVE_UP = "give_up"


# Kinds that say nothing about the request, only that it was never served: never stored, sent again.
UNFINISHED_KINDS = frozenset(
    {FailureKind.NO_LIVE_SERVERS, FailureKind.DISPATCHER_CLOSED, FailureKind.ADMISSION_STOPPED}
)
# Kinds that are the prompt's own whatever the server: sending them again gives the same answer. A turn after a
# conversation ended has no history to be sent with until the turn that ended it is generated again.
PROMPT_KINDS = frozenset(
    {
        FailureKind.UNRENDERABLE_PROMPT,
        FailureKind.INVALID_TOOL_ARGUMENTS,
        FailureKind.CONVERSATION_ENDED,
        FailureKind.TOOL_CALL_DIVERGED,
    }
)
# Kinds of on-policy turns never sent because their conversation ended before them (an earlier turn failed, was
# cut at max_tokens, or called other tools than the dataset): outcomes of the conversation, not requests that
# failed, so the failed share leaves them out (the turn that ended it counts, when it failed).
ENDED_CONVERSATION_KINDS = frozenset({FailureKind.CONVERSATION_ENDED, FailureKind.TOOL_CALL_DIVERGED})
# 4xx answers about the server rather than the request: auth, not found (the model), timeout, conflict, rate.
SERVER_STATE_4XX = frozenset({401, 403, 404, 408, 409, 429})
HTTP_SERVER_ERROR = 500
# What an engine says in a 4xx when the request was fine but the server serves something else.
SERVER_STATE_REASON = re.compile(
    r"pinned to|model\W.*\b(not found|does not exist|not loaded|not served|unknown)|no such model|unknown model",
    re.IGNORECASE,
)


def error_type(kind: FailureKind, status: int | None = None) -> str:
    """The stored ``error_type`` of a failure: the kind's value, ``http_<status>`` for an HTTP answer."""
    if kind is FailureKind.HTTP_STATUS:
        return f"{HTTP_PREFIX}{status or 0}"
    return kind.value


def kind_of(stored: str) -> FailureKind | None:
    """The kind of a stored ``error_type``; None for a value this vocabulary does not know."""
    if stored.startswith(HTTP_PREFIX):
        return FailureKind.HTTP_STATUS
    try:
        return FailureKind(stored)
    except ValueError:
        return None


def fate(stored: str, *, status: int | None = None, reason: str = "") -> Fate:
    """What a failure of ``error_type`` ``stored`` leads to (module docstring).

    Args:
        stored: The failure's ``error_type``.
        status: Its last HTTP status, when it had one.
        reason: Its reason (a 4xx naming another model is about the server, not the prompt).

    Returns:
        Unfinished, send again, or give up. A kind this vocabulary does not know is sent again: nothing says
        it is the prompt's own.

    """
    kind = kind_of(stored)
    if kind in UNFINISHED_KINDS:
        return Fate.UNFINISHED
    if kind in PROMPT_KINDS:
        return Fate.GIVE_UP
    if kind is not FailureKind.HTTP_STATUS:
        return Fate.SEND_AGAIN
    code = status or int(stored.removeprefix(HTTP_PREFIX) or 0)
    if code >= HTTP_SERVER_ERROR or code in SERVER_STATE_4XX or SERVER_STATE_REASON.search(reason):
        return Fate.SEND_AGAIN
    return Fate.GIVE_UP


def is_unfinished(failure: FailureRecord) -> bool:
    """Whether a failure is no result of its request (never stored; its shard sends it again)."""
    return fate(failure.error_type) is Fate.UNFINISHED


def is_retryable(failure: FailureRecord) -> bool:
    """Whether a recorded failure may succeed when sent again (its reason is not the prompt's own)."""
    return fate(failure.error_type, status=failure.last_status, reason=failure.reason) is Fate.SEND_AGAIN


def retried_keys(standing: Iterable[FailureRecord]) -> set[str]:
    """The request keys ``--retry-failed`` sends again, of the failures a shard's latest round left standing.

    A plain request is sent again when its failure may succeed (:func:`is_retryable`). An on-policy conversation
    ends at its first failed turn, so its standing failures are that turn's own and the turns it ended
    (``conversation_ended``): when the first may succeed, all of them are sent again, that turn first and the
    others as the conversation goes on; when it is the prompt's own (a 400 about the request, diverged tool
    calls, an answer cut at ``max_tokens``), the conversation stays as it is.

    Args:
        standing: The standing failures of one shard.

    Returns:
        The keys of the requests (turns) to send again.

    """
    again: set[str] = set()
    conversations: dict[tuple[str, int], list[FailureRecord]] = {}
    for failure in standing:
        if failure.turn is None:
            if is_retryable(failure):
                again.add(failure.key)
        else:
            conversations.setdefault((failure.prompt_id, failure.sample_index), []).append(failure)
    for failures in conversations.values():
        first = min(failures, key=lambda failure: failure.turn or 0)
        if is_retryable(first):
            again.update(failure.key for failure in failures)
    return again


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
    # Turns an ended conversation never sent are neither requests nor failures of the fleet (see above).
    unsent = sum(
        count
        for summary in summaries
        for stored, count in summary.failure_reasons.items()
        if kind_of(stored) in ENDED_CONVERSATION_KINDS
    )
    requests = sum(s.requests for s in summaries) - unsent
    failures = sum(s.failures for s in summaries) - unsent
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
            count += len(retried_keys(FailureRecord.model_validate(row) for row in rows))
    return count
