"""OpenAI-style rows (``messages: [{role, content, ...}]``): m-a-p/Code-Feedback and generic chat data."""

from __future__ import annotations

from typing import Any

# Not `from datagen.prompts.datasets import turns`: the package's __init__ imports this module (via registry).
import datagen.prompts.datasets.turns as turns
from datagen.config import MultiTurnPolicy
from datagen.prompts.datasets.model import NormalisedPrompt, RowRejected
from datagen.prompts.datasets.tools import parse_tools, tool_call_from_dict
from datagen.records import Message, Role, ToolCall


def _optional_text(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        # OpenAI content parts: keep the text parts, in order.
        parts = [part.get("text") for part in value if isinstance(part, dict) and part.get("type") == "text"]
        if all(isinstance(part, str) for part in parts) and parts:
            return "".join(str(part) for part in parts)
    raise RowRejected("malformed", f"{what} is a {type(value).__name__}, not a string")


def _converter(item: dict[str, Any], role: Role, position: int) -> turns.Converter:
    def convert() -> list[Message]:
        content = _optional_text(item.get("content"), f"message {position}'s content")
        reasoning = _optional_text(item.get("reasoning_content"), f"message {position}'s reasoning_content")
        calls: list[ToolCall] | None = None
        raw_calls = item.get("tool_calls")
        if raw_calls is not None and role == "assistant":
            if not isinstance(raw_calls, list):
                raise RowRejected("unparseable_tool_call", f"message {position}'s tool_calls is not a list")
            calls = [tool_call_from_dict(call) for call in raw_calls] or None
        function_call = item.get("function_call")
        if function_call is not None and role == "assistant":
            calls = [*(calls or []), tool_call_from_dict(function_call)]
        if role == "assistant" and content is None and not calls:
            raise RowRejected("malformed", f"assistant message {position} has neither content nor tool calls")
        if role != "assistant" and content is None:
            raise RowRejected("malformed", f"{role} message {position} has no content")
        call_id = item.get("tool_call_id")
        name = item.get("name")
        return [
            Message(
                role=role,
                content=content,
                reasoning_content=reasoning or None,
                tool_calls=calls,
                tool_call_id=str(call_id) if call_id is not None and role == "tool" else None,
                name=name if isinstance(name, str) and role == "tool" else None,
            )
        ]

    return convert


def openai_turns(messages: Any) -> list[turns.Turn]:
    """Turns of an OpenAI ``messages`` list.

    Raises:
        RowRejected: The list or a message does not have the OpenAI layout.

    """
    found: list[turns.Turn] = []
    for position, item in turns.require_objects(messages, "messages", "message"):
        role = turns.map_role(item.get("role"), turns.OPENAI_ROLES)
        found.append(turns.Turn(role, _converter(item, role, position)))
    return found


def normalise_code_feedback(row: Any, index: int, policy: MultiTurnPolicy) -> list[NormalisedPrompt]:
    """m-a-p/Code-Feedback: ``id``, ``messages[{role, content}]``, multi-turn with execution feedback."""
    data = turns.require_row(row)
    return turns.prompts_with_id(openai_turns(data.get("messages")), data, policy=policy, source_index=index)


def normalise_openai_messages(row: Any, index: int, policy: MultiTurnPolicy) -> list[NormalisedPrompt]:
    """Generic chat rows: ``messages[{role, content, tool_calls?, ...}]`` plus optional ``tools``."""
    data = turns.require_row(row)
    return turns.prompts_with_id(
        openai_turns(data.get("messages")),
        data,
        policy=policy,
        source_index=index,
        tools=parse_tools(data.get("tools")),
        language=turns.language_tag(data.get("language")),
    )
