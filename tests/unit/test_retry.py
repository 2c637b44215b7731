"""The generation retry policy (datagen/generation/retry.py): the one place the dispatcher asks what's next."""

from __future__ import annotations

import pytest

from datagen.config import GenerationConfig
from datagen.errors import is_transient_http_status
from datagen.generation.dispatch_state import Job, RequestStream, Transient
from datagen.generation.openai_chat import GenerationRequest
from datagen.generation.retry import GiveUp, Retry, RetryPolicy
from datagen.output.s3_client import is_transient_status
from datagen.records import Message, PromptRecord, SamplingParams


def _job(attempts: int) -> Job:
    prompt = PromptRecord(prompt_id="p", dataset="unit", messages=[Message(role="user", content="hi")])
    request = GenerationRequest(
        prompt=prompt, sample_index=0, sampling=SamplingParams(max_tokens=8), dataset="unit"
    )
    job = Job(request, RequestStream([request], lambda _request, _result: None, 1))
    job.attempts = attempts
    return job


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 504])
def test_the_same_statuses_are_transient_for_servers_and_storage(status: int) -> None:
    assert is_transient_http_status(status) and is_transient_status("", status)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
def test_other_4xx_answers_are_final(status: int) -> None:
    assert not is_transient_http_status(status)


def test_backoff_grows_with_jitter_up_to_the_ceiling() -> None:
    policy = RetryPolicy(GenerationConfig(backoff_initial_s=1.0, backoff_max_s=5.0))

    assert 0.5 <= policy.backoff_s(1) <= 1.0
    assert 2.0 <= policy.backoff_s(3) <= 4.0
    assert 2.5 <= policy.backoff_s(10) <= 5.0


def test_a_request_gives_up_after_max_attempts_and_an_interrupted_try_retries_at_once() -> None:
    policy = RetryPolicy(GenerationConfig(max_attempts=3))

    assert isinstance(policy.after(_job(2), Transient(reason="reset"), "http://a", 2), Retry)
    step = policy.after(_job(3), Transient(reason="reset"), "http://a", 2)
    assert isinstance(step, GiveUp) and step.error_type == "retries_exhausted"
    assert policy.after(_job(1), Transient(reason="gone", interrupted=True), "http://a", 2) == Retry(0.0)


def test_repeated_internal_errors_from_two_servers_end_the_request_early() -> None:
    policy = RetryPolicy(GenerationConfig(max_attempts=10, max_internal_error_attempts=2))
    job = _job(1)

    assert isinstance(policy.after(job, Transient(reason="boom", status=500), "http://a", 2), Retry)
    job.attempts = 2
    step = policy.after(job, Transient(reason="boom", status=500), "http://b", 2)

    assert isinstance(step, GiveUp) and step.error_type == "repeated_internal_error"


def test_a_removed_server_gives_the_attempt_back() -> None:
    job = _job(2)
    job.interrupted, job.refund = "server removed", True

    outcome = RetryPolicy.interrupted(job)

    assert outcome.interrupted and outcome.reason == "server removed"
    assert job.attempts == 1 and job.interrupted is None and not job.refund


def test_resets_from_two_servers_count_like_internal_errors() -> None:
    policy = RetryPolicy(GenerationConfig(max_attempts=10, max_internal_error_attempts=2))
    job = _job(1)

    assert isinstance(policy.after(job, Transient(reason="reset", reset=True), "http://a", 2), Retry)
    job.attempts = 2
    step = policy.after(job, Transient(reason="reset", reset=True), "http://b", 2)

    assert isinstance(step, GiveUp) and step.error_type == "repeated_internal_error"
