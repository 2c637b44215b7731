"""Reasoning and Qwen tool calls split from a raw /generate text, the way SGLang's parsers split them for chat."""

from __future__ import annotations

import pytest

from datagen.generation.openai_chat import BadToolArgumentsError
from datagen.generation.qwen_markup import (
    opens_reasoning,
    split_reasoning,
    split_tool_calls,
    strip_end_of_text,
)
from datagen.records import FunctionCall, ToolCall

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            },
        },
    }
]


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n", True),  # Qwen3.5/3.6 thinking
        (
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
            False,
        ),  # no thinking
        ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False),  # Qwen3: the model opens it
        # An earlier turn's open think block does not count: only the turn the template just opened.
        ("<|im_start|>user\n<think>\n<|im_end|>\n<|im_start|>assistant\n", False),
    ],
)
def test_a_prompt_opens_reasoning_only_when_its_last_turn_has_an_unclosed_think(
    prompt: str, expected: bool
) -> None:
    assert opens_reasoning(prompt) is expected


@pytest.mark.parametrize(
    ("text", "reasoning_open", "expected"),
    [
        ("<think>\nplan</think>\n\nanswer", False, ("\nplan", "\n\nanswer")),
        ("plan</think>\n\nanswer", True, ("plan", "\n\nanswer")),
        ("just an answer", False, (None, "just an answer")),
        ("<think>\ncut off mid-thought", False, ("\ncut off mid-thought", "")),
        ("cut off mid-thought", True, ("cut off mid-thought", "")),
        # Qwen3.5 sometimes calls a tool without closing its reasoning: the call is not reasoning.
        ("plan<tool_call>\n{}", True, ("plan", "<tool_call>\n{}")),
    ],
)
def test_reasoning_is_split_like_sglangs_qwen3_parser(
    text: str, reasoning_open: bool, expected: tuple[str | None, str]
) -> None:
    assert split_reasoning(text, reasoning_open=reasoning_open) == expected


def test_a_stop_token_left_in_the_text_is_not_content() -> None:
    assert strip_end_of_text("answer<|im_end|>") == "answer"
    assert strip_end_of_text("answer<|endoftext|>") == "answer"
    assert strip_end_of_text("answer") == "answer"


def test_json_tool_calls_become_structured_calls_and_the_content_is_the_text_before_them() -> None:
    text = (
        ' Let me look.\n\n<tool_call>\n{"name": "search", "arguments": {"query": "drafter", "limit": 3}}\n'
        '</tool_call>\n<tool_call>\n{"name": "search", "parameters": {"query": "target"}}\n</tool_call>'
    )

    content, calls = split_tool_calls(text, TOOLS)

    assert content == "Let me look."
    assert calls == [
        ToolCall(
            id="call_0", function=FunctionCall(name="search", arguments={"query": "drafter", "limit": 3})
        ),
        ToolCall(id="call_1", function=FunctionCall(name="search", arguments={"query": "target"})),
    ]


def test_xml_tool_calls_of_qwen36_are_typed_by_the_tool_schema() -> None:
    text = (
        "Looking.\n<tool_call>\n<function=search>\n<parameter=query>\n42\n</parameter>\n"
        '<parameter=limit>\n5\n</parameter>\n<parameter=filters>\n{"lang": "en"}\n</parameter>\n'
        "</function>\n</tool_call>"
    )

    content, calls = split_tool_calls(text, TOOLS)

    assert content == "Looking.\n"  # qwen3_coder keeps the text before the call as it is
    assert calls == [
        ToolCall(
            id="call_0",
            # `query` is a string in the schema, `limit` an integer; `filters` is not declared: kept as text.
            function=FunctionCall(
                name="search", arguments={"query": "42", "limit": 5, "filters": '{"lang": "en"}'}
            ),
        )
    ]


def test_a_truncated_answer_keeps_its_text_before_an_unclosed_call() -> None:
    json_text = 'Calling.\n<tool_call>\n{"name": "search", "argu'
    xml_text = "Calling.\n<tool_call>\n<function=search>\n<parameter=query>\nabc"

    assert split_tool_calls(json_text, TOOLS) == ("Calling.", [])
    # qwen3_coder reads a function a truncated answer left open.
    content, calls = split_tool_calls(xml_text, TOOLS)
    assert content == "Calling.\n"
    assert calls == [ToolCall(id="call_0", function=FunctionCall(name="search", arguments={"query": "abc"}))]


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "search", "arguments": {"query": drafter}}',  # not JSON
        '{"arguments": {"query": "x"}}',  # no name
        '{"name": "fly", "arguments": {}}',  # a tool the prompt does not offer
        "search(query='x')",
    ],
)
def test_a_json_call_sglang_cannot_read_is_left_out_and_the_answer_stays_a_completion(body: str) -> None:
    assert split_tool_calls(f"Text.\n<tool_call>\n{body}\n</tool_call>", TOOLS) == ("Text.", [])


@pytest.mark.parametrize(
    "body", ['{"name": "search", "arguments": ["x"]}', '{"name": "search", "arguments": "{\\"query\\": 1}"}']
)
def test_arguments_that_are_not_an_object_are_final_as_on_the_chat_path(body: str) -> None:
    with pytest.raises(BadToolArgumentsError, match="not a JSON object"):
        split_tool_calls(f"<tool_call>\n{body}\n</tool_call>", TOOLS)
