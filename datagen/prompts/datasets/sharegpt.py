"""ShareGPT-style rows (``conversations: [{from, value}]``): Infinity-Instruct, AgentInstruct, ShareGPT."""

from __future__ import annotations

from typing import Any

from datagen.config import MultiTurnPolicy
from datagen.prompts.datasets.model import NormalisedPrompt
from datagen.prompts.datasets.tools import (
    parse_tool_text,
    parse_tools,
    split_tool_call_blocks,
    split_tool_responses,
    tool_call_from_dict,
)
from datagen.prompts.datasets.turns import (
    SHAREGPT_ROLES,
    Converter,
    Turn,
    build_prompts,
    map_role,
    require_objects,
    require_row,
    require_text,
    text_turn,
)
from datagen.records import Message


def _source_id(row: dict[str, Any]) -> str | None:
    # Infinity-Instruct ids are ints in some copies and hex strings in others: always a string.
    value = row.get("id")
    return None if value is None else str(value)


def sharegpt_turns(conversations: Any, *, tool_markup: bool = False) -> list[Turn]:
    """Turns of a ``conversations`` list.

    Args:
        conversations: The row's ``conversations`` value.
        tool_markup: Parse ``<tool_call>`` blocks in assistant turns and ``<tool_response>`` blocks in
            tool turns (Hermes-style rows).

    Raises:
        RowRejected: The list or a turn does not have the ShareGPT layout.

    """
    turns: list[Turn] = []
    for position, item in require_objects(conversations, "conversations", "turn"):
        speaker = item.get("from", item.get("role"))
        role = map_role(speaker, SHAREGPT_ROLES)
        value = require_text(item.get("value", item.get("content")), f"turn {position}'s value")
        if str(speaker).strip().lower() == "function_call":
            turns.append(Turn(role, _function_call_turn(value)))
        elif role == "assistant" and tool_markup:
            turns.append(Turn(role, _assistant_markup_turn(value)))
        elif role == "tool" and tool_markup:
            turns.append(Turn(role, _tool_markup_turn(value)))
        else:
            turns.append(text_turn(role, value))
    return turns


def _function_call_turn(value: str) -> Converter:
    def convert() -> list[Message]:
        parsed = parse_tool_text(value, "a function_call turn is")
        items = parsed if isinstance(parsed, list) else [parsed]
        return [
            Message(role="assistant", content=None, tool_calls=[tool_call_from_dict(item) for item in items])
        ]

    return convert


def _assistant_markup_turn(value: str) -> Converter:
    def convert() -> list[Message]:
        content, calls = split_tool_call_blocks(value)
        return [Message(role="assistant", content=content, tool_calls=calls or None)]

    return convert


def _tool_markup_turn(value: str) -> Converter:
    def convert() -> list[Message]:
        return [Message(role="tool", content=body) for body in split_tool_responses(value)]

    return convert


def _prepend_system(turns: list[Turn], system: Any) -> list[Turn]:
    if isinstance(system, str) and system.strip() and not (turns and turns[0].role == "system"):
        return [text_turn("system", system), *turns]
    return turns


def normalise_infinity_instruct(row: Any, index: int, policy: MultiTurnPolicy) -> list[NormalisedPrompt]:
    """BAAI/Infinity-Instruct: ``id``, ``conversations``, ``label``, ``langdetect``, ``source``."""
    data = require_row(row)
    language = data.get("langdetect")
    metadata: dict[str, Any] = {"source_id": _source_id(data)}
    if isinstance(data.get("source"), str):
        metadata["source"] = data["source"]
    label = data.get("label")
    if isinstance(label, dict) and isinstance(label.get("cate_ability_en"), list):
        metadata["categories"] = [str(item) for item in label["cate_ability_en"]][:8]
    return build_prompts(
        sharegpt_turns(data.get("conversations")),
        policy=policy,
        source_index=index,
        language=language.strip().lower() if isinstance(language, str) and language.strip() else None,
        metadata=metadata,
    )


def normalise_agentinstruct(row: Any, index: int, policy: MultiTurnPolicy) -> list[NormalisedPrompt]:
    """THUDM/AgentInstruct: ``id``, ``conversations[{from, loss, value}]`` with ReAct text, no tools."""
    data = require_row(row)
    return build_prompts(
        sharegpt_turns(data.get("conversations")),
        policy=policy,
        source_index=index,
        metadata={"source_id": _source_id(data)},
    )


def normalise_sharegpt(row: Any, index: int, policy: MultiTurnPolicy) -> list[NormalisedPrompt]:
    """Generic ShareGPT: ``conversations[{from, value}]``, optional ``system`` and ``tools``.

    Assistant ``function_call`` turns and ``<tool_call>`` blocks become structured calls when the row
    defines tools; ``observation``/``tool`` turns become tool messages.
    """
    data = require_row(row)
    tools = parse_tools(data.get("tools"))
    turns = sharegpt_turns(data.get("conversations"), tool_markup=tools is not None)
    role_language = data.get("language")
    return build_prompts(
        _prepend_system(turns, data.get("system")),
        policy=policy,
        tools=tools,
        source_index=index,
        language=role_language.strip().lower()
        if isinstance(role_language, str) and role_language.strip()
        else None,
        metadata={"source_id": _source_id(data)},
    )
