"""SGLang /generate bodies and answers (exact-token mode), with the tiny model's real tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from datagen.config import SamplingParams
from datagen.generation.generate_api import (
    build_generate_payload,
    parse_generate_response,
    render_prompt_ids,
)
from datagen.generation.wire import GenerationRequest, UnusableResponseError
from datagen.output.tokenize import TokenizedRow, load_tokenizer, tokenize_completion
from datagen.records import AssistantCompletion, CompletionRecord, Message, PromptRecord, TokenUsage


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
