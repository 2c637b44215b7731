"""What recorded failures decide: which are sent again by --retry-failed, and when a run may not publish."""

from __future__ import annotations

from pathlib import Path

import pytest

from datagen.errors import PreflightError, ShardsFailedError, TooManyFailuresError
from datagen.generation.failures import FailureKind, Fate, check_failed_share, error_type, fate, is_retryable
from datagen.output.layout import RunLayout
from datagen.output.store import Store
from datagen.records import FailureRecord, ShardSummary
from tasks.runtime import DeploymentResume

LAYOUT = RunLayout("failures")


def _failure(error_type: str, reason: str = "", status: int | None = None, key: int = 0) -> FailureRecord:
    return FailureRecord(
        prompt_id=f"p{key}", dataset="d", reason=reason, error_type=error_type, attempts=1, last_status=status
    )


@pytest.mark.parametrize(
    ("failure", "retryable"),
    [
        (_failure("retries_exhausted", "retries exhausted after 5 attempts; last error: reset"), True),
        (_failure("repeated_internal_error", "HTTP 500 from 2 server(s)"), True),
        (_failure("http_503", "HTTP 503: busy", 503), True),
        (_failure("http_429", "HTTP 429: slow down", 429), True),
        (_failure("http_404", "HTTP 404: The model `qwen` does not exist.", 404), True),
        (_failure("http_400", 'HTTP 400: {"detail":"Server is pinned to \'other-model\'"}', 400), True),
        (_failure("http_400", "HTTP 400: model 'x' not found", 400), True),
        (_failure("http_400", "HTTP 400: maximum context length is 4096 tokens", 400), False),
        (_failure("http_422", "HTTP 422: invalid request", 422), False),
        (_failure("invalid_tool_arguments", "arguments are not JSON"), False),
        (_failure("unrenderable_prompt", "template refused it"), False),
        (_failure("conversation_ended", "turn 0 failed: retries_exhausted"), False),
    ],
)
def test_only_failures_whose_reason_is_not_the_prompts_own_are_sent_again(
    failure: FailureRecord, retryable: bool
) -> None:
    assert is_retryable(failure) is retryable


# The values records have stored since their first version: a renamed value would misread every old run.
STORED_VALUES = {
    FailureKind.HTTP_STATUS: "http_400",
    FailureKind.RETRIES_EXHAUSTED: "retries_exhausted",
    FailureKind.REPEATED_INTERNAL_ERROR: "repeated_internal_error",
    FailureKind.INVALID_TOOL_ARGUMENTS: "invalid_tool_arguments",
    FailureKind.UNRENDERABLE_PROMPT: "unrenderable_prompt",
    FailureKind.NO_LIVE_SERVERS: "no_live_servers",
    FailureKind.DISPATCHER_CLOSED: "dispatcher_closed",
    FailureKind.ADMISSION_STOPPED: "admission_stopped",
    FailureKind.CONVERSATION_ENDED: "conversation_ended",
    FailureKind.TOOL_CALL_DIVERGED: "tool_call_diverged",
}


def test_every_failure_kind_keeps_its_stored_value_and_has_one_fate() -> None:
    assert set(STORED_VALUES) == set(FailureKind)
    assert {kind: error_type(kind, 400) for kind in FailureKind} == STORED_VALUES
    fates = {
        kind: fate(stored, status=400, reason="HTTP 400: too long") for kind, stored in STORED_VALUES.items()
    }
    assert fates == {
        FailureKind.HTTP_STATUS: Fate.GIVE_UP,
        FailureKind.RETRIES_EXHAUSTED: Fate.SEND_AGAIN,
        FailureKind.REPEATED_INTERNAL_ERROR: Fate.SEND_AGAIN,
        FailureKind.INVALID_TOOL_ARGUMENTS: Fate.GIVE_UP,
        FailureKind.UNRENDERABLE_PROMPT: Fate.GIVE_UP,
        FailureKind.NO_LIVE_SERVERS: Fate.UNFINISHED,
        FailureKind.DISPATCHER_CLOSED: Fate.UNFINISHED,
        FailureKind.ADMISSION_STOPPED: Fate.UNFINISHED,
        FailureKind.CONVERSATION_ENDED: Fate.GIVE_UP,
        FailureKind.TOOL_CALL_DIVERGED: Fate.GIVE_UP,
    }
    # A value no version of datagen wrote is not the prompt's fault: sent again rather than dropped.
    assert fate("something_new") is Fate.SEND_AGAIN


def _shard(
    store: Store, dataset: str, index: int, requests: int, failures: list[FailureRecord]
) -> ShardSummary:
    path = LAYOUT.failures(dataset, index)
    store.write_jsonl(path, failures)
    reasons: dict[str, int] = {}
    for failure in failures:
        reasons[failure.error_type] = reasons.get(failure.error_type, 0) + 1
    return ShardSummary(
        dataset=dataset,
        shard_index=index,
        requests=requests,
        completions=requests - len(failures),
        failures=len(failures),
        generation_s=1.0,
        completions_path=LAYOUT.completions(dataset, index),
        failures_path=path,
        failure_reasons=reasons,
    )


def test_a_run_within_the_failed_share_publishes_one_past_it_fails_naming_the_dominant_reason(
    tmp_path: Path,
) -> None:
    store = Store(str(tmp_path / "out"))
    healthy = [_shard(store, "d", 0, 1000, [_failure("http_503", "HTTP 503: busy", 503)])]
    check_failed_share(store, healthy, 0.01)  # 0.1%: publishes

    pinned = "HTTP 400: Server is pinned to 'other'"
    broken = [
        _shard(store, "e", 0, 100, [_failure("http_400", pinned, 400, key=i) for i in range(3)]),
        _shard(store, "e", 1, 100, [_failure("retries_exhausted", "reset", key=9)]),
    ]
    with pytest.raises(TooManyFailuresError) as refused:
        check_failed_share(store, broken, 0.01)
    message = str(refused.value)
    assert message.startswith("4 of 200 requests failed (2.0% > generation.max_failed_share 1.0%)")
    assert "most: http_400 x3 (HTTP 400: Server is pinned to 'other')" in message
    assert "--retry-failed" in message and "the 4 failed requests" in message
    assert refused.value.retryable == 4


def test_turns_an_ended_conversation_never_sent_are_not_counted_as_failed_requests(tmp_path: Path) -> None:
    # On-policy: 200 turns planned; conversations ended at answers cut at max_tokens (20 turns never sent) and at
    # diverged tool calls (10): outcomes of the conversations, not a broken fleet. One turn failed: 1 of 170.
    store = Store(str(tmp_path / "out"))
    ended = [_failure("conversation_ended", "turn 0 was cut at max_tokens", None, key=i) for i in range(20)]
    ended += [
        _failure("tool_call_diverged", "called x where the dataset called y", None, key=20 + i)
        for i in range(10)
    ]
    flaky = [_failure("retries_exhausted", "reset", key=40 + i) for i in range(3)]
    check_failed_share(store, [_shard(store, "chat", 0, 200, [*ended, flaky[0]])], 0.01)
    with pytest.raises(TooManyFailuresError) as refused:
        check_failed_share(store, [_shard(store, "chat", 1, 200, [*ended, *flaky])], 0.01)
    assert str(refused.value).startswith("3 of 170 requests failed (1.8% > generation.max_failed_share 1.0%)")


def test_a_dataset_without_one_answer_fails_the_run_whatever_the_share(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "out"))
    shards = [
        _shard(store, "big", 0, 10_000, []),
        _shard(
            store, "tiny", 0, 2, [_failure("http_400", "HTTP 400: too long", 400, key=i) for i in range(2)]
        ),
    ]
    with pytest.raises(TooManyFailuresError) as refused:
        check_failed_share(store, shards, 0.01)
    assert str(refused.value).startswith("every request of dataset(s) tiny failed")
    assert "None of them is worth sending again" in str(refused.value)


def test_a_failed_deployed_run_names_its_one_resume_once_its_run_id_is_known() -> None:
    resume = DeploymentResume()
    assert (
        resume(ShardsFailedError("2 shard(s) failed", run_id="r-1", failed_shards=2)) is None
    )  # not resolved
    resume.config, resume.run_id = "nightly", "r-1"
    assert resume(ShardsFailedError("2 shard(s) failed", run_id="r-1", failed_shards=2)) == (
        "run the deployment again with config=nightly run_id=r-1"
    )
    assert resume(TooManyFailuresError("12 of 12 failed", retryable=12)) == (
        "run the deployment again with config=nightly run_id=r-1 retry_failed=true"
    )
    assert resume(TooManyFailuresError("every request of tiny failed", retryable=0)).endswith("run_id=r-1")
    assert resume(PreflightError(["dataset 'junk' yields 0 prompt(s)"])) is None  # a refusal resumes nothing
