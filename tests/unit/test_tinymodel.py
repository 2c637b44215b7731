"""The tiny model: Qwen3-format chat template, fast deterministic build, demo-friendly sampling."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import pytest

from datagen.app.tinymodel import EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, build_tiny_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
SAMPLES = 16
WEATHER_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Berlin"}}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text


def test_template_renders_system_and_user_with_generation_prompt(tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render(tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_without_generation_prompt_ends_after_last_turn(tokenizer: Any) -> None:
    assert render(tokenizer, [{"role": "user", "content": "Hi"}]) == "<|im_start|>user\nHi<|im_end|>\n"


def test_disabled_thinking_prefills_an_empty_think_block(tokenizer: Any) -> None:
    text = render(
        tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=True, enable_thinking=False
    )
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_enabled_thinking_leaves_the_generation_prompt_open(tokenizer: Any) -> None:
    text = render(
        tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=True, enable_thinking=True
    )
    assert text.endswith("<|im_start|>assistant\n")


def test_final_assistant_turn_always_gets_a_think_block(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert render(tokenizer, messages) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n"
    )


def test_reasoning_before_the_last_user_query_is_dropped(tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "greet back"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye!", "reasoning_content": "\nsay bye\n"},
    ]
    assert render(tokenizer, messages) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nsay bye\n</think>\n\nBye!<|im_end|>\n"
    )


def test_think_tags_inside_content_are_split_into_reasoning(tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello"},
    ]
    assert render(tokenizer, messages).endswith(
        "<|im_start|>assistant\n<think>\nhmm\n</think>\n\nHello<|im_end|>\n"
    )


def test_tools_go_into_the_system_turn_after_the_system_prompt(tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    assert render(tokenizer, messages, tools=TOOLS) == (
        "<|im_start|>system\nBe brief.\n\n" + TOOLS_BLOCK + "<|im_start|>user\nWeather?<|im_end|>\n"
    )


def test_tools_without_system_prompt_open_their_own_system_turn(tokenizer: Any) -> None:
    assert render(tokenizer, [{"role": "user", "content": "Weather?"}], tools=TOOLS).startswith(
        "<|im_start|>system\n" + TOOLS_BLOCK + "<|im_start|>user\n"
    )


def test_tool_calls_and_merged_tool_responses_follow_qwen3(tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "Weather in Berlin and Paris?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "two cities",
            "tool_calls": [
                WEATHER_CALL,
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "Berlin is sunny, Paris rainy."},
    ]
    assert render(tokenizer, messages, add_generation_prompt=False) == (
        "<|im_start|>user\nWeather in Berlin and Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\ntwo cities\n</think>\n\nLet me check.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nBerlin is sunny, Paris rainy.<|im_end|>\n"
    )


def test_tool_call_without_content_starts_right_after_the_turn_opener(tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "content": "sunny"},
    ]
    assert render(tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_reasoning_of_tool_steps_after_the_last_query_is_kept(tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "call the tool",
            "tool_calls": [WEATHER_CALL],
        },
        {"role": "tool", "content": "sunny"},
    ]
    assert "<|im_start|>assistant\n<think>\ncall the tool\n</think>\n\n<tool_call>" in render(
        tokenizer, messages
    )


def test_tokenizer_holds_the_qwen_special_tokens_as_single_tokens(tokenizer: Any) -> None:
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.pad_token == PAD_TOKEN
    for token in SPECIAL_TOKENS:
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, token
        assert tokenizer.decode(ids) == token


def _digest(directory: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.iterdir())}


def test_build_is_fast_and_deterministic_for_a_seed(tiny_model_dir: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    again = build_tiny_model(tmp_path / "again", seed=0)
    assert time.monotonic() - started < 30
    assert _digest(again) == _digest(tiny_model_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(
        _digest(again)
    )


def test_sampled_answers_are_visible_text_and_some_stop_early(tiny_model_dir: Path, tokenizer: Any) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen3"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    prompt_length = prompt["input_ids"].shape[1]
    max_new_tokens = 64
    torch.manual_seed(0)
    output = model.generate(
        input_ids=prompt["input_ids"].repeat(SAMPLES, 1),
        attention_mask=prompt["attention_mask"].repeat(SAMPLES, 1),
        max_new_tokens=max_new_tokens,
        temperature=0.7,
        top_p=0.95,
    )
    stopped = 0
    for sequence in output[:, prompt_length:].tolist():
        ended = tokenizer.eos_token_id in sequence
        stopped += ended
        text = tokenizer.decode(sequence, skip_special_tokens=True)
        assert text.strip()
        assert all(" " <= char <= "~" or char in "\n\t" for char in text)
        special = set(tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)) - {tokenizer.eos_token_id}
        assert not special & set(sequence[: sequence.index(tokenizer.eos_token_id)] if ended else sequence)
    assert 0 < stopped < SAMPLES
