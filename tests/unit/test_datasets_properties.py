"""Property tests: normalisers never raise and account for every row; streaming and ids are exact."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datagen.prompts.datasets import FORMATS, REJECTION_REASONS, NormalisedPrompt, Rejection, normalise_row
from datagen.prompts.datasets.identity import prompt_id_for
from datagen.prompts.datasets.jsonstream import iter_json_array
from datagen.records import Message

PROPERTY_SETTINGS = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
ROLE_NAMES = [
    "human",
    "gpt",
    "system",
    "tool",
    "user",
    "assistant",
    "function",
    "function_call",
    "observation",
    "x",
]
MARKUP = st.sampled_from(
    [
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
        "<tool_call>\n{'name': 'f', 'arguments': {'a': True}}\n</tool_call>",
        "<tool_call>{broken</tool_call>",
        '<tool_response>\n{"r": 1}\n</tool_response>',
        "<tools>[{'name': 'f', 'parameters': {}}]</tools> be helpful",
        "<tools>[{broken</tools>",
        "",
        "   ",
    ]
)
texts = st.text(max_size=30) | MARKUP
turn_values = texts | json_values
sharegpt_turns = st.lists(
    st.fixed_dictionaries({"from": st.sampled_from(ROLE_NAMES), "value": turn_values})
    | st.dictionaries(st.sampled_from(["from", "value", "loss"]), turn_values, max_size=3),
    max_size=6,
)
tool_calls = st.lists(
    st.fixed_dictionaries(
        {
            "id": st.text(max_size=4),
            "function": st.fixed_dictionaries({"name": texts, "arguments": turn_values}),
        }
    )
    | json_values,
    max_size=2,
)
openai_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(ROLE_NAMES), "content": turn_values},
        optional={
            "tool_calls": tool_calls,
            "function_call": st.fixed_dictionaries({"name": texts, "arguments": turn_values}),
            "tool_call_id": json_values,
            "name": json_values,
            "reasoning_content": turn_values,
        },
    ),
    max_size=6,
)
tools_values = (
    json_values
    | st.lists(st.fixed_dictionaries({"name": texts, "parameters": json_values}), max_size=2)
    | st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": json_values}), max_size=2)
)
field_values = (
    turn_values
    | sharegpt_turns
    | openai_messages
    | openai_messages.map(json.dumps)
    | tools_values
    | tools_values.map(json.dumps)
    | st.fixed_dictionaries({"mcp_servers": st.lists(json_values, max_size=2)}).map(json.dumps)
)
FIELDS = [
    "id", "conversations", "messages", "tools", "metadata", "question", "query", "answer", "response",
    "langdetect", "label", "source", "system", "language", "type", "uuid", "category",
]  # fmt: skip
rows = st.dictionaries(st.sampled_from(FIELDS), field_values, max_size=5) | json_values


def check_result(result: list[NormalisedPrompt] | Rejection, index: int) -> None:
    if isinstance(result, Rejection):
        assert result.reason in REJECTION_REASONS
        assert result.source_index == index
        return
    assert result, "a row must give at least one prompt or a rejection"
    for prompt in result:
        assert prompt.messages[-1].role in ("user", "tool")
        assert any(message.role == "user" for message in prompt.messages)
        assert prompt.source_index == index
        json.dumps(prompt.model_dump(mode="json"))  # serialisable as a PromptRecord line


@pytest.mark.parametrize("format", FORMATS)
@PROPERTY_SETTINGS
@given(row=rows, index=st.integers(min_value=0, max_value=10**9), every_turn=st.booleans())
def test_normaliser_never_raises_and_yields_prompts_or_a_counted_rejection(
    format: str, row: Any, index: int, every_turn: bool
) -> None:
    check_result(normalise_row(format, row, index, "every_turn" if every_turn else "last_turn"), index)


@PROPERTY_SETTINGS
@given(elements=st.lists(json_values, max_size=20), indent=st.sampled_from([None, 0, 1, 4]))
def test_json_array_stream_yields_exactly_the_elements(elements: list[Any], indent: int | None) -> None:
    data = json.dumps(elements, indent=indent, ensure_ascii=bool(indent)).encode()
    assert list(iter_json_array(io.BytesIO(data), "test.json")) == elements


words = st.lists(st.text(alphabet="abcXYZ 123", min_size=1, max_size=8), min_size=1, max_size=6)


@PROPERTY_SETTINGS
@given(parts=words, spaces=st.lists(st.sampled_from([" ", "  ", "\n", "\t "]), min_size=6, max_size=6))
def test_prompt_id_ignores_whitespace_and_case_but_not_words(parts: list[str], spaces: list[str]) -> None:
    text = " ".join(parts)
    respaced = spaces[0] + "".join(part + spaces[i % len(spaces)] for i, part in enumerate(parts))
    original = [Message(role="user", content=text)]
    variant = [Message(role="user", content=respaced.upper())]
    assert prompt_id_for(original, None) == prompt_id_for(variant, None)
    changed = [Message(role="user", content=text + " extra")]
    assert prompt_id_for(original, None) != prompt_id_for(changed, None)
    assert prompt_id_for(original, None) != prompt_id_for(
        original, [{"type": "function", "function": {"name": "f"}}]
    )
