"""NousResearch/hermes-function-calling-v1: ShareGPT turns with Hermes tool-calling markup.

Tools come from the ``tools`` field (a JSON string, wrapped or bare entries) or from the ``<tools>``
block of the system prompt (often a Python repr). ``<tool_call>`` blocks in ``gpt`` turns become
structured calls, ``<tool_response>`` blocks in ``tool`` turns become tool messages. The ``<tools>`` block
and Hermes's tool-calling boilerplate are taken out of the system prompt, because the target's
chat template renders the tools and its own call format from ``tools``. In ``func_calling_singleturn``
the final ``gpt`` turn is the tool call, so dropping it leaves the user's request.
"""

from __future__ import annotations

from typing import Any

from datagen.config import MultiTurnPolicy
from datagen.prompts.datasets.model import NormalisedPrompt, RowRejected
from datagen.prompts.datasets.sharegpt import sharegpt_turns
from datagen.prompts.datasets.tools import extract_system_tools, parse_tools, strip_hermes_boilerplate
from datagen.prompts.datasets.turns import build_prompts, require_row, text_turn

METADATA_KEYS = ("id", "category", "subcategory", "task")


def _system_and_tools(
    system: str, field_tools: list[dict[str, Any]] | None
) -> tuple[str, list[dict[str, Any]] | None]:
    try:
        block_tools, remaining = extract_system_tools(system)
    except RowRejected:
        if field_tools is None:
            raise
        # The field holds the same tools in parseable form; only the broken block is dropped.
        remaining = strip_hermes_boilerplate(system)
        block_tools = None
    return remaining, field_tools if field_tools is not None else block_tools


def normalise_hermes_fc(row: Any, index: int, policy: MultiTurnPolicy) -> list[NormalisedPrompt]:
    """One Hermes row.

    Fields: ``id``, ``conversations[{from, value}]``, ``category``, ``subcategory``, ``task`` or
    ``schema``, optional ``tools``.
    """
    data = require_row(row)
    field_tools = parse_tools(data.get("tools"))
    turns = sharegpt_turns(data.get("conversations"), tool_markup=True)
    tools = field_tools
    if turns and turns[0].role == "system":
        system_message = turns[0].convert()[0]
        remaining, tools = _system_and_tools(system_message.content or "", field_tools)
        turns = ([text_turn("system", remaining)] if remaining else []) + turns[1:]
    metadata = {key: str(data[key]) for key in METADATA_KEYS if isinstance(data.get(key), str | int)}
    return build_prompts(turns, policy=policy, tools=tools, source_index=index, metadata=metadata)
