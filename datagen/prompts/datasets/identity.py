"""The stable identity of a prompt: a hash of its whitespace- and case-normalised content.

The same messages and tools give the same id in any run and any dataset, which is what deduplication
within a dataset, across the datasets of a run, and across runs relies on. Ids of tool calls and the
reasoning of earlier turns are left out: they do not change what the model is asked.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from datagen.records import Message

PROMPT_ID_HEX_CHARS = 16  # 64 bits: collisions stay negligible far beyond millions of prompts


def _normalise_text(text: str | None) -> str:
    return " ".join(text.split()).lower() if text else ""


def _canonical_json(value: Any) -> str:
    return _normalise_text(
        json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    )


def canonical_content(messages: list[Message], tools: list[dict[str, Any]] | None) -> str:
    """The normalised content two prompts must share to count as the same prompt."""
    canonical_messages = [
        {
            "role": message.role,
            "content": _normalise_text(message.content),
            "name": _normalise_text(message.name),
            "tool_calls": [
                [call.function.name, _canonical_json(call.function.arguments)]
                for call in message.tool_calls or []
            ],
        }
        for message in messages
    ]
    return json.dumps(
        {"messages": canonical_messages, "tools": _canonical_json(tools or [])},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )


def prompt_id_for(messages: list[Message], tools: list[dict[str, Any]] | None) -> str:
    """The stable id of a prompt: the first 16 hex characters of the SHA-256 of its normalised content."""
    digest = hashlib.sha256(canonical_content(messages, tools).encode()).hexdigest()
    return digest[:PROMPT_ID_HEX_CHARS]
