"""SGLang /generate bodies and answers (exact-token mode), with the tiny model's real tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from datagen.config import SamplingParams
from datagen.dataset.tokenize import TokenizedRow, tokenize_completion
from datagen.dataset.tokenizer import TokenizerSpec, load_tokenizer
from datagen.generation.openai_chat import (
    BadToolArgumentsError,
    GenerationRequest,
    PromptTokens,
    UnusableResponseError,
)
from datagen.generation.sglang_generate import (
    PromptEncoder,
    attach_prompt_tokens,
    build_generate_payload,
    generate_field_names,
    parse_generate_completion,
    parse_generate_response,
    render_prompt_ids,
    shared_head,
)
from datagen.records import (
    AssistantCompletion,
    CompletionRecord,
    FunctionCall,
    Message,
    PromptRecord,
    TokenUsage,
    ToolCall,
)
from tests.support.on_policy import SCRIPTS, converse
from tests.support.qwen import build_qwen_tokenizer_dir, tokenizer_with_template

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(str(tiny_model_dir))


def _request(**sampling: Any) -> GenerationRequest:
    prompt = PromptRecord(prompt_id="p1", dataset="demo", messages=[Message(role="user", content="Say hi")])
    return GenerationRequest(prompt=prompt, sampling=SamplingParams(**sampling), dataset="demo")


def test_generate_body_carries_ids_and_every_set_sampling_field_with_sglang_names() -> None:
    body = build_generate_payload(
        [1, 2, 3], _request(top_k=20, min_p=0.05, seed=9, max_tokens=64), rid="p1/0"
    )

    assert body["input_ids"] == [1, 2, 3]
    assert body["rid"] == "p1/0"
    assert body["sampling_params"] == {
        "temperature": 0.7,
        "top_p": 0.95,
        "max_new_tokens": 64,
        "skip_special_tokens": False,
        "top_k": 20,
        "min_p": 0.05,
        "sampling_seed": 9,
    }
    assert "top_k" not in build_generate_payload([1], _request())["sampling_params"]


def test_answer_keeps_output_ids_meta_info_and_maps_the_finish_reason() -> None:
    meta = {
        "id": "x",
        "finish_reason": {"type": "length", "length": 8},
        "prompt_tokens": 5,
        "completion_tokens": 8,
    }

    result = parse_generate_response({"text": "hello", "output_ids": list(range(8)), "meta_info": meta})

    assert result.output_ids == list(range(8))
    assert result.finish_reason == "length"
    assert result.usage == TokenUsage(prompt_tokens=5, completion_tokens=8)
    assert result.meta_info == meta
    with pytest.raises(UnusableResponseError, match="output_ids"):
        parse_generate_response({"text": "hello", "meta_info": meta})


def test_served_prompt_ids_and_output_ids_are_the_training_row_verbatim(tokenizer: Any) -> None:
    request = _request(enable_thinking=False)
    prompt_ids = render_prompt_ids(tokenizer, request)
    output_ids = tokenizer("Hi there!<|im_end|>", add_special_tokens=False)["input_ids"]
    answer = parse_generate_response(
        {
            "text": "Hi there!",
            "output_ids": output_ids,
            "meta_info": {"finish_reason": {"type": "stop"}, "prompt_tokens": len(prompt_ids)},
        }
    )
    record = CompletionRecord(
        prompt_id="p1",
        dataset="demo",
        messages=request.prompt.messages,
        completion=AssistantCompletion(content=answer.text, output_token_ids=answer.output_ids),
        finish_reason=answer.finish_reason,
        usage=answer.usage,
        model="tiny",
        engine="sglang",
        server="http://127.0.0.1:1",
        sampling=request.sampling,
        latency_s=0.1,
    )

    row = tokenize_completion(tokenizer, record, max_length_tokens=None)

    assert isinstance(row, TokenizedRow)
    assert row.input_ids == prompt_ids + output_ids
    assert [token for token, bit in zip(row.input_ids, row.loss_mask, strict=True) if bit] == output_ids


def _answer(text: str, output_ids: list[int], finish: Any, **meta: Any) -> dict[str, Any]:
    return {"text": text, "output_ids": output_ids, "meta_info": {"finish_reason": finish, **meta}}


def _tokenized(request: GenerationRequest, *, opens_reasoning: bool = False) -> GenerationRequest:
    return request.model_copy(
        update={"prompt_tokens": PromptTokens(input_ids=[1, 2, 3], opens_reasoning=opens_reasoning)}
    )


@pytest.mark.parametrize(
    ("finish", "expected"),
    [
        ({"type": "stop", "matched": 2}, "stop"),
        ({"type": "stop", "matched": "</answer>"}, "stop"),
        ({"type": "length", "length": 4}, "length"),
        (None, "unknown"),
        ({"type": "surprise"}, "unknown"),
    ],
)
def test_finish_reasons_map_onto_datagens(finish: Any, expected: str) -> None:
    completion, finish_reason, usage = parse_generate_completion(
        _answer("hi", [7, 8, 2], finish, prompt_tokens=3, completion_tokens=3), _tokenized(_request())
    )

    assert finish_reason == expected
    assert completion.output_token_ids == [7, 8, 2]
    assert usage == TokenUsage(prompt_tokens=3, completion_tokens=3)


def test_a_stopped_answer_with_tool_calls_finishes_with_tool_calls_as_sglang_reports_it_for_chat() -> None:
    request = _tokenized(_request()).model_copy(
        update={
            "prompt": PromptRecord(
                prompt_id="p1",
                dataset="demo",
                messages=[Message(role="user", content="?")],
                tools=[WEATHER_TOOL],
            )
        }
    )
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    text = f"<think>\ncheck</think>\n\nLooking.\n\n<tool_call>\n{call}\n</tool_call>"

    completion, finish_reason, _ = parse_generate_completion(
        _answer(text, [5, 6, 2], {"type": "stop", "matched": 2}), request
    )

    assert finish_reason == "tool_calls"
    assert completion.reasoning_content == "\ncheck"
    assert completion.content == "Looking."
    assert completion.tool_calls == [
        ToolCall(id="call_0", function=FunctionCall(name="get_weather", arguments={"city": "Oslo"}))
    ]


def test_an_answer_inside_an_open_think_block_is_reasoning_until_it_closes() -> None:
    completion, finish_reason, usage = parse_generate_completion(
        _answer("still thinking", [5, 6], {"type": "length", "length": 2}),
        _tokenized(_request(), opens_reasoning=True),
    )

    assert (completion.reasoning_content, completion.content) == ("still thinking", "")
    assert finish_reason == "length"
    # Counts missing from meta_info come from the ids themselves.
    assert usage == TokenUsage(prompt_tokens=3, completion_tokens=2)


def test_an_aborted_generation_is_transient_not_a_completion() -> None:
    body = _answer("", [5], {"type": "abort", "message": "Abort in waiting queue"})

    with pytest.raises(UnusableResponseError, match="aborted the generation: Abort in waiting queue"):
        parse_generate_completion(body, _tokenized(_request()))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("not an object", "expected a JSON object"),
        ({"text": "x", "meta_info": {}}, "no output_ids"),
        ({"text": "x", "output_ids": [1, "2"], "meta_info": {}}, "no output_ids"),
        ({"text": "x", "output_ids": [1, True], "meta_info": {}}, "no output_ids"),
        ({"text": "x", "output_ids": [1]}, "no meta_info"),
        ({"text": "x", "output_ids": [1], "meta_info": {"prompt_tokens": "many"}}, "not a token count"),
    ],
)
def test_malformed_bodies_are_unusable_responses_as_on_the_chat_path(body: Any, message: str) -> None:
    # UnusableResponseError is what the dispatcher retries (transient), for both paths.
    with pytest.raises(UnusableResponseError, match=message):
        parse_generate_completion(body, _tokenized(_request()))


def test_tool_calls_are_read_only_for_prompts_that_offer_tools_and_bad_arguments_are_final() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": ["Oslo"]}\n</tool_call>'
    body = _answer(text, [5], {"type": "stop"})
    with_tools = _tokenized(_request()).model_copy(
        update={
            "prompt": PromptRecord(
                prompt_id="p1",
                dataset="demo",
                messages=[Message(role="user", content="?")],
                tools=[WEATHER_TOOL],
            )
        }
    )

    completion, finish_reason, _ = parse_generate_completion(body, _tokenized(_request()))
    assert (completion.content, completion.tool_calls, finish_reason) == (text, None, "stop")
    with pytest.raises(BadToolArgumentsError, match="not a JSON object"):
        parse_generate_completion(body, with_tools)


def test_sampling_field_rules_are_translated_to_generate_names() -> None:
    assert generate_field_names({"top_k", "min_p", "seed", "max_tokens"}) == {
        "top_k",
        "min_p",
        "sampling_seed",
        "max_new_tokens",
    }


def test_each_prompt_is_rendered_once_for_all_its_samples_and_an_unrenderable_one_fails_unsent(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tokenizer = load_tokenizer(str(tokenizer_with_template(tiny_model_dir, tmp_path / "qwen3.6", "qwen3.6")))
    good = PromptRecord(prompt_id="good", dataset="demo", messages=[Message(role="user", content="Hi")])
    # The Qwen3.6 template refuses a conversation without a user query.
    bad = PromptRecord(prompt_id="bad", dataset="demo", messages=[Message(role="assistant", content="Hi")])
    requests = [
        GenerationRequest(prompt=prompt, sample_index=index, sampling=SamplingParams(), dataset="demo")
        for prompt in (good, bad)
        for index in range(2)
    ]

    ready, failures = attach_prompt_tokens(requests, encoder=PromptEncoder.from_tokenizer(tokenizer))

    assert [request.key for request in ready] == ["good/0", "good/1"]
    assert ready[0].prompt_tokens is ready[1].prompt_tokens  # one render, shared by the samples
    assert ready[0].prompt_tokens is not None and ready[0].prompt_tokens.opens_reasoning
    assert ready[0].prompt_tokens.input_ids == render_prompt_ids(tokenizer, requests[0])
    assert [(failure.key, failure.error_type, failure.attempts) for failure in failures] == [
        ("bad/0", "unrenderable_prompt", 0),
        ("bad/1", "unrenderable_prompt", 0),
    ]
    assert "No user query found" in failures[0].reason


@pytest.mark.parametrize("template", ["qwen3", "qwen3.6"])
def test_a_later_turn_tokenized_after_its_previous_turn_has_the_ids_of_a_whole_render(
    tmp_path: Path, template: str
) -> None:
    # A conversation's later turn takes the ids of the history it shares with the turn before (up to an added
    # token) and tokenizes only the rest: the ids must be exactly those of tokenizing its whole render, also
    # where the template re-renders earlier turns (Qwen3 drops their reasoning) or splices tool results.
    encoder = PromptEncoder(TokenizerSpec.load(str(build_qwen_tokenizer_dir(tmp_path / "tok", template))))
    reused = 0
    for name in sorted(SCRIPTS):
        records = converse(name)
        before: PromptTokens | None = None
        for record in records:
            prompt = PromptRecord(
                prompt_id=record.prompt_id, dataset="d", messages=record.messages, tools=record.tools
            )
            (whole,) = encoder.encode([(prompt, record.sampling.enable_thinking)], [None])
            (after,) = encoder.encode([(prompt, record.sampling.enable_thinking)], [before])
            assert isinstance(whole, PromptTokens) and isinstance(after, PromptTokens)
            assert after.input_ids == whole.input_ids, f"{name} turn {record.turn}"
            assert after.cuts == whole.cuts and after.opens_reasoning == whole.opens_reasoning
            (plain,) = encoder.encode([(prompt, record.sampling.enable_thinking)])
            assert isinstance(plain, PromptTokens) and plain.input_ids == whole.input_ids
            assert not plain.text and not plain.cuts, "a prompt no turn follows keeps nothing"
            if before is not None:
                reused += shared_head(before, after.text)[1]
            before = after
    assert reused > 0, "later turns reuse the history's ids"
