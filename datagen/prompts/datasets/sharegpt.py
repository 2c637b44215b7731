"""ShareGPT-style rows (``conversations: [{from, value}]``): Infinity-Instruct, AgentInstruct, ShareGPT."""

from __future__ import annotations

from typing import Any

# Not `from datagen.prompts.datasets import turns`: the package's __init__ imports this module (via registry).
import datagen.prompts.datasets.turns as turns
from datagen.config import MultiTurnPolicy
from datagen.prompts.datasets.model import NormalisedPrompt
from datagen.prompts.datasets.tools import (
    parse_tool_text,
    parse_tools,
    split_tool_call_blocks,
    split_tool_responses,
    tool_call_from_dict,
)
from datagen.records import Message


def sharegpt_turns(conversations: Any, *, tool_markup: bool = False) -> list[turns.Turn]:
    """Turns of a ``conversations`` list.

    Args:
        conversations: The row's ``conversations`` value.
        tool_markup: Parse ``<tool_call>`` blocks in assistant turns and ``<tool_response>`` blocks in
            tool turns (Hermes-style rows).

    Raises:
        RowRejected: The list or a turn does not have the ShareGPT layout.

    """
    found: list[turns.Turn] = []
    for position, item in turns.require_objects(conversations, "conversations", "turn"):
        speaker = item.get("from", item.get("role"))
        role = turns.map_role(speaker, turns.SHAREGPT_ROLES)
        value = turns.require_text(item.get("value", item.get("content")), f"turn {position}'s value")
        if str(speaker).strip().lower() == "function_call":
            found.append(turns.Turn(role, _function_call_turn(value)))
        elif role == "assistant" and tool_markup:
            found.append(turns.Turn(role, _assistant_markup_turn(value)))
        elif role == "tool" and tool_markup:
            found.append(turns.Turn(role, _tool_markup_turn(value)))
        else:
            found.append(turns.text_turn(role, value))
    return found


def _function_call_turn(value: str) -> turns.Converter:
    def convert() -> list[Message]:
        parsed = parse_tool_text(value, "a function_call turn is")
        items = parsed if isinstance(parsed, list) else [parsed]
        return [
            Message(role="assistant", content=None, tool_calls=[tool_call_from_dict(item) for item in items])
        ]

    return convert


def _assistant_markup_turn(value: str) -> turns.Converter:
    def convert() -> list[Message]:
        content, calls = split_tool_call_blocks(value)
        return [Message(role="assistant", content=content, tool_calls=calls or None)]

    return convert


def _tool_markup_turn(value: str) -> turns.Converter:
    def convert() -> list[Message]:
        return [Message(role="tool", content=body) for body in split_tool_responses(value)]

    return convert


def _prepend_system(conversation: list[turns.Turn], system: Any) -> list[turns.Turn]:
    if isinstance(system, str) and system.strip() and not (conversation and conversation[0].role == "system"):
        return [turns.text_turn("system", system), *conversation]
    return conversation


def normalise_infinity_instruct(row: Any, index: int, policy: MultiTurnPolicy) -> list[NormalisedPrompt]:
    """BAAI/Infinity-Instruct: ``id``, ``conversations``, ``label``, ``langdetect``, ``source``."""
    data = turns.require_row(row)
    metadata: dict[str, Any] = {"source_id": turns.source_id(data)}
    if isinstance(data.get("source"), str):
        metadata["source"] = data["source"]
    label = data.get("label")
    if isinstance(label, dict) and isinstance(label.get("cate_ability_en"), list):
        metadata["categories"] = [str(item) for item in label["cate_ability_en"]][:8]
    return turns.build_prompts(
        sharegpt_turns(data.get("conversations")),
        policy=policy,
        source_index=index,
        language=turns.language_tag(data.get("langdetect")),
        metadata=metadata,
    )


def normalise_agentinstruct(row: Any, index: int, policy: MultiTurnPolicy) -> list[NormalisedPrompt]:
    """THUDM/AgentInstruct: ``id``, ``conversations[{from, loss, value}]`` with ReAct text, no tools."""
    data = turns.require_row(row)
    return turns.prompts_with_id(
        sharegpt_turns(data.get("conversations")), data, policy=policy, source_index=index
    )


def normalise_sharegpt(row: Any, index: int, policy: MultiTurnPolicy) -> list[NormalisedPrompt]:
    """Generic ShareGPT: ``conversations[{from, value}]``, optional ``system`` and ``tools``.

    Assistant ``function_call`` turns and ``<tool_call>`` blocks become structured calls when the row
    defines tools; ``observation``/``tool`` turns become tool messages.
    """
    data = turns.require_row(row)
    tools = parse_tools(data.get("tools"))
    conversation = sharegpt_turns(data.get("conversations"), tool_markup=tools is not None)
    return turns.prompts_with_id(
        _prepend_system(conversation, data.get("system")),
        data,
        policy=policy,
        source_index=index,
        tools=tools,
        language=turns.language_tag(data.get("language")),
    )
