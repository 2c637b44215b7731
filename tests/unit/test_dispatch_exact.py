"""The dispatcher in exact-token mode against a real SGLang-like /generate server (tests/support/generate_server.py).

The same transient/final split as the chat path: connection faults, 5xx, 429, empty or garbage bodies and
aborted generations are retried (each try with its own ``rid``); a 4xx and a malformed tool call are final.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from datagen.config import GenerationConfig
from datagen.dataset.tokenizer import load_tokenizer
from datagen.generation.dispatch_state import GenerationResult
from datagen.generation.dispatcher import Dispatcher
from datagen.generation.openai_chat import GenerationRequest, PromptTokens
from datagen.generation.sglang_generate import PromptEncoder, attach_prompt_tokens
from datagen.records import CompletionRecord, FailureRecord, Message, PromptRecord, SamplingParams
from tests.support.fault_server import FaultServer
from tests.support.generate_server import GenerateServer

FAST_RETRIES = GenerationConfig(
    backoff_initial_s=0.01,
    backoff_max_s=0.05,
    max_attempts=6,
    request_timeout_s=10,
    no_live_server_timeout_s=30,
)
RESULT_TIMEOUT_S = 60
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def encoder(tiny_model_dir: Path) -> PromptEncoder:
    return PromptEncoder.from_tokenizer(load_tokenizer(str(tiny_model_dir)))


@pytest.fixture()
def server(tiny_model_dir: Path) -> Iterator[GenerateServer]:
    with GenerateServer(tiny_model_dir) as generate_server:
        yield generate_server


def requests_for(
    encoder: PromptEncoder, contents: list[str], *, tools: bool = False, **sampling: Any
) -> list[GenerationRequest]:
    requests = []
    for content in contents:
        prompt = PromptRecord(
            prompt_id=f"id-{content}",
            dataset="unit",
            messages=[Message(role="user", content=content)],
            tools=[WEATHER_TOOL] if tools else None,
        )
        params = SamplingParams.model_validate({"max_tokens": 64, **sampling})
        requests.append(GenerationRequest(prompt=prompt, sampling=params, dataset="unit"))
    ready, failures = attach_prompt_tokens(requests, encoder=encoder)
    assert not failures
    return ready


def dispatcher_for(url: str, *, engine: str = "sglang") -> Dispatcher:
    return Dispatcher(
        [url],
        model="test-model",
        engine=engine,
        max_inflight_per_server=4,
        generation=FAST_RETRIES,
        exact_tokens=True,
    )


def run_all(dispatcher: Dispatcher, requests: list[GenerationRequest]) -> list[GenerationResult]:
    futures: list[Future[GenerationResult]] = [dispatcher.submit(request) for request in requests]
    return [future.result(RESULT_TIMEOUT_S) for future in futures]


def test_output_ids_reasoning_and_tool_calls_are_kept_from_generate(
    server: GenerateServer, encoder: PromptEncoder
) -> None:
    requests = requests_for(encoder, [f"Weather question {index}" for index in range(24)], tools=True)

    with dispatcher_for(server.url) as dispatcher:
        records = run_all(dispatcher, requests)

    served = server.answers_by_key()
    assert not server.chat_requests()
    for request, record in zip(requests, records, strict=True):
        assert isinstance(record, CompletionRecord)
        (answer,) = served[request.key]
        assert request.prompt_tokens is not None and answer.input_ids == request.prompt_tokens.input_ids
        assert answer.rid == f"{request.key}#1"
        assert record.completion.output_token_ids == answer.output_ids
        assert record.completion.reasoning_content == answer.reasoning
        if answer.tool_call is not None:
            assert record.finish_reason == "tool_calls"
            assert record.completion.tool_calls is not None
            (call,) = record.completion.tool_calls
            assert call.function.model_dump() == answer.tool_call
        else:
            assert record.finish_reason == answer.finish and not record.completion.tool_calls
        assert record.usage.prompt_tokens == len(answer.input_ids)
        assert record.usage.completion_tokens == len(answer.output_ids)
    finishes = {record.finish_reason for record in records if isinstance(record, CompletionRecord)}
    assert finishes == {"stop", "length", "tool_calls"}, "the server's mix of answers reached the records"
    assert any(answer.reasoning for (answer,) in served.values())


def test_transient_faults_and_aborts_are_retried_with_a_new_rid_each_try(
    server: GenerateServer, encoder: PromptEncoder
) -> None:
    (request,) = requests_for(encoder, ["[[500,reset,empty,abort,garbage]] hello"])

    with dispatcher_for(server.url) as dispatcher:
        (record,) = run_all(dispatcher, [request])

    assert isinstance(record, CompletionRecord)
    assert record.attempts == 6
    tries = server.generate_requests()
    assert [seen.fault for seen in tries] == ["500", "reset", "empty", "abort", "garbage", "ok"]
    assert [seen.body["rid"] for seen in tries if seen.body] == [f"{request.key}#{n}" for n in range(1, 7)]
    assert record.completion.output_token_ids == server.answers_by_key()[request.key][-1].output_ids


def test_a_bad_request_and_tool_arguments_that_are_not_an_object_are_final(
    server: GenerateServer, encoder: PromptEncoder
) -> None:
    requests = requests_for(encoder, ["[[400]] refused", "#badtool call it"], tools=True)

    with dispatcher_for(server.url) as dispatcher:
        refused, bad_tool = run_all(dispatcher, requests)

    assert isinstance(refused, FailureRecord) and refused.error_type == "http_400" and refused.attempts == 1
    assert isinstance(bad_tool, FailureRecord) and bad_tool.error_type == "invalid_tool_arguments"
    assert bad_tool.attempts == 1 and "not a JSON object" in bad_tool.reason


def test_a_tool_call_that_is_not_json_is_left_out_as_sglang_does_and_the_ids_are_kept(
    server: GenerateServer, encoder: PromptEncoder
) -> None:
    (request,) = requests_for(encoder, ["#brokentool call it"], tools=True)

    with dispatcher_for(server.url) as dispatcher:
        (record,) = run_all(dispatcher, [request])

    assert isinstance(record, CompletionRecord)
    assert record.finish_reason == "stop" and record.completion.tool_calls is None
    assert record.completion.output_token_ids == server.answers_by_key()[request.key][0].output_ids
    assert "<tool_call>" not in (record.completion.content or "")


def test_a_server_without_generate_fails_each_request_with_its_404() -> None:
    with FaultServer() as chat_only:
        request = GenerationRequest(
            prompt=PromptRecord(prompt_id="p", dataset="unit", messages=[Message(role="user", content="hi")]),
            sampling=SamplingParams(max_tokens=8),
            dataset="unit",
        ).model_copy(update={"prompt_tokens": PromptTokens(input_ids=[1, 2, 3])})
        with dispatcher_for(chat_only.url) as dispatcher:
            (record,) = run_all(dispatcher, [request])

    assert isinstance(record, FailureRecord) and record.error_type == "http_404"


def test_the_engines_sampling_field_rules_apply_to_the_generate_body(
    server: GenerateServer, encoder: PromptEncoder
) -> None:
    (request,) = requests_for(encoder, ["sampled"], top_k=20, min_p=0.05, seed=7)

    # transformers refuses top_k and min_p: the same rule drops them from sampling_params.
    with dispatcher_for(server.url, engine="transformers") as dispatcher:
        (record,) = run_all(dispatcher, [request])

    assert isinstance(record, CompletionRecord)
    (seen,) = server.generate_requests()
    assert seen.body is not None
    assert seen.body["sampling_params"] == {
        "temperature": 0.7,
        "top_p": 0.95,
        "max_new_tokens": 64,
        "skip_special_tokens": False,
        "sampling_seed": 7,
    }


def test_a_request_without_its_prompt_ids_is_refused_at_submission(server: GenerateServer) -> None:
    request = GenerationRequest(
        prompt=PromptRecord(prompt_id="p", dataset="unit", messages=[Message(role="user", content="hi")]),
        sampling=SamplingParams(),
        dataset="unit",
    )
    with dispatcher_for(server.url) as dispatcher, pytest.raises(ValueError, match="no prompt_tokens"):
        dispatcher.submit(request)
