"""Every format's normaliser on fixture files in the real layouts, hostile rows included."""

from __future__ import annotations

from pathlib import Path

import pytest

from datagen.errors import DatasetError
from datagen.prompts.datasets import NormalisedPrompt, Rejection, iter_rows, normalise_row

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "datasets"

# Per fixture row: the number of prompts (last_turn) or the rejection reason. "unreadable" is a line the
# source could not parse at all.
EXPECTED: dict[str, list[int | str]] = {
    "infinity_instruct": [1, 1, "empty", "malformed", "malformed", "malformed", "unknown_role",
                          "no_user_turn", "empty", 1, "unreadable", "malformed", 1, "bad_turn_order"],
    "webinstruct": [1, "empty", "malformed", "malformed", 1],
    "codefeedback_filtered": [1, "malformed", 1, 1, "unreadable"],
    "code_feedback": [1, "unknown_role", "malformed", "malformed", 1],
    "metamath": [1, 1, "malformed", "malformed", "malformed", 1],
    "hermes_fc": [1, 1, 1, "unparseable_tools", "unparseable_tool_call", 1, 1, "unparseable_tools",
                  "unparseable_tools", "unparseable_tool_call", "malformed"],
    "agentinstruct": [1, "malformed", "malformed"],
    "toucan": [1, "malformed", "malformed", "unparseable_tools", "unparseable_tool_call", 1, "malformed"],
    "sharegpt": [1, 1, 1, "unparseable_tool_call", "malformed"],
    "openai_messages": [1, 1, "no_user_turn", 1, "unparseable_tool_call", "unparseable_tools"],
}  # fmt: skip


def fixture_path(format: str) -> str:
    matches = sorted(FIXTURES.glob(f"{format}_hostile.*"))
    assert len(matches) == 1, matches
    return str(matches[0])


def outcomes(format: str, policy: str = "last_turn") -> list[list[NormalisedPrompt] | Rejection | str]:
    results: list[list[NormalisedPrompt] | Rejection | str] = []
    for row in iter_rows(fixture_path(format)):
        if row.error is not None:
            results.append("unreadable")
        else:
            results.append(normalise_row(format, row.data, row.index, policy))  # type: ignore[arg-type]
    return results


def prompts_of(format: str, index: int, policy: str = "last_turn") -> list[NormalisedPrompt]:
    result = outcomes(format, policy)[index]
    assert isinstance(result, list), result
    return result


@pytest.mark.parametrize("format", sorted(EXPECTED))
def test_each_fixture_row_gives_prompts_or_the_expected_rejection(format: str) -> None:
    summary: list[int | str] = []
    for result in outcomes(format):
        if isinstance(result, str):
            summary.append(result)
        elif isinstance(result, Rejection):
            summary.append(result.reason)
        else:
            summary.append(len(result))
    assert summary == EXPECTED[format]


@pytest.mark.parametrize("format", sorted(EXPECTED))
def test_every_prompt_ends_with_the_turn_to_answer(format: str) -> None:
    for policy in ("last_turn", "every_turn"):
        for result in outcomes(format, policy):
            if isinstance(result, list):
                for prompt in result:
                    assert prompt.messages[-1].role in ("user", "tool")
                    assert any(message.role == "user" for message in prompt.messages)


def test_infinity_instruct_keeps_language_string_id_and_drops_the_final_answer() -> None:
    prompt = prompts_of("infinity_instruct", 1)[0]
    assert prompt.language == "zh-cn"
    assert prompt.metadata["source_id"] == "ab12"
    assert [message.role for message in prompt.messages] == ["user"]
    assert prompts_of("infinity_instruct", 0)[0].metadata["source_id"] == "1"


def test_every_turn_gives_one_prompt_per_assistant_turn_with_the_earlier_answers_kept() -> None:
    first, second = prompts_of("infinity_instruct", 12, "every_turn")
    assert [m.content for m in first.messages] == ["q1"]
    assert [m.content for m in second.messages] == ["q1", "a1", "q2"]
    assert (first.turn_index, second.turn_index) == (0, 1)
    (last,) = prompts_of("infinity_instruct", 12, "last_turn")
    assert last.messages == second.messages


def test_hermes_python_repr_tools_in_the_system_prompt_become_structured_tools() -> None:
    prompt = prompts_of("hermes_fc", 0)[0]
    assert prompt.tools is not None
    function = prompt.tools[0]["function"]
    assert function["name"] == "get_time"
    assert function["parameters"]["properties"]["verbose"]["default"] is False
    system = prompt.messages[0]
    assert system.role == "system"
    assert "<tools>" not in (system.content or "") and "<tool_call>" not in (system.content or "")
    assert "Don't make assumptions" in (system.content or "")
    # The final gpt turn was the tool call: what is left is the user's request.
    assert prompt.messages[-1].role == "user"


def test_hermes_several_tool_calls_in_one_turn_and_tool_responses_are_structured() -> None:
    prompt = prompts_of("hermes_fc", 1)[0]
    roles = [message.role for message in prompt.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool"]
    calls = prompt.messages[2].tool_calls or []
    assert [(call.function.name, call.function.arguments) for call in calls] == [
        ("add", {"a": 1, "b": 2}),
        ("add", {"a": 3, "b": 4}),
    ]
    assert [message.content for message in prompt.messages[3:]] == ['{"result": 3}', '{"result": 7}']


def test_hermes_tools_field_without_wrapper_is_wrapped() -> None:
    prompt = prompts_of("hermes_fc", 2)[0]
    assert prompt.tools == [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add numbers",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                },
            },
        }
    ]
    assert prompt.messages[0].content == "You are helpful."


def test_hermes_unparseable_call_in_the_dropped_final_turn_does_not_reject_the_row() -> None:
    prompt = prompts_of("hermes_fc", 5)[0]
    assert [message.content for message in prompt.messages] == ["Add 9 and 1"]


def test_toucan_tools_come_from_mcp_servers_and_function_turns_become_tool_messages() -> None:
    prompt = prompts_of("toucan", 0)[0]
    assert prompt.tools is not None
    assert prompt.tools[0]["function"]["parameters"] == {
        "type": "object",
        "properties": {"q": {"type": "string"}},
    }
    roles = [message.role for message in prompt.messages]
    assert roles == ["user", "assistant", "assistant", "tool", "tool"]
    assert prompt.messages[1].tool_calls is not None
    assert prompt.messages[1].tool_calls[0].function.arguments == {"q": "cats"}
    assert prompt.messages[3].name == "lookup"


def test_openai_content_parts_and_developer_role_are_normalised() -> None:
    prompt = prompts_of("openai_messages", 0)[0]
    assert [(m.role, m.content) for m in prompt.messages] == [("system", "sys"), ("user", "parts content")]


def test_openai_tool_calls_with_dict_or_string_arguments_keep_ids() -> None:
    prompt = prompts_of("openai_messages", 1)[0]
    calls = prompt.messages[1].tool_calls or []
    assert [(c.id, c.function.arguments) for c in calls] == [
        ("c1", {"a": 1, "b": 2}),
        ("c2", {"a": 2, "b": 2}),
    ]
    assert [m.tool_call_id for m in prompt.messages[2:]] == ["c1", "c2"]


def test_sharegpt_function_call_and_observation_turns_become_calls_and_tool_results() -> None:
    prompt = prompts_of("sharegpt", 2)[0]
    assert [m.role for m in prompt.messages] == ["user", "assistant", "tool"]
    assert prompt.messages[1].tool_calls is not None
    assert prompt.messages[1].tool_calls[0].function.arguments == {"a": 1, "b": 2}
    system_prompt = prompts_of("sharegpt", 1)[0]
    assert system_prompt.messages[0].role == "system"


def test_question_answer_formats_keep_provenance_but_not_programming_language_as_language() -> None:
    prompt = prompts_of("codefeedback_filtered", 0)[0]
    assert prompt.language is None
    assert prompt.metadata == {"resource": "evol", "lang": "c"}


def test_unknown_format_is_a_clear_error() -> None:
    with pytest.raises(DatasetError, match="Unknown dataset format 'alpaca'"):
        normalise_row("alpaca", {}, 0)
