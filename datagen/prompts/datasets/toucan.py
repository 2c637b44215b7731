"""Agent-Ark/Toucan-1.5M: every field is a string; ``messages`` and ``metadata`` hold JSON.

Tools are listed per MCP server under ``metadata.mcp_servers[].remote_server_response.tools`` (MCP
definitions with ``input_schema``/``inputSchema``); ``function`` turns are tool results and assistant
turns carry ``function_call {name, arguments}``.
"""

from __future__ import annotations

import json
from typing import Any

from datagen.config import MultiTurnPolicy
from datagen.prompts.datasets.model import NormalisedPrompt, RowRejected
from datagen.prompts.datasets.openai import openai_turns
from datagen.prompts.datasets.tools import parse_tools, wrap_tool
from datagen.prompts.datasets.turns import build_prompts, require_row


def _decode(value: Any, what: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (json.JSONDecodeError, RecursionError) as error:
            raise RowRejected("malformed", f"{what} is not valid JSON: {error}") from None
    return value


def _mcp_tools(metadata: Any) -> list[dict[str, Any]] | None:
    if not isinstance(metadata, dict):
        return None
    servers = metadata.get("mcp_servers")
    if servers is None:
        return None
    if not isinstance(servers, list):
        raise RowRejected("unparseable_tools", "metadata.mcp_servers is not a list")
    tools: list[dict[str, Any]] = []
    for server in servers:
        response = server.get("remote_server_response") if isinstance(server, dict) else None
        listed = response.get("tools") if isinstance(response, dict) else None
        if listed is None:
            continue
        if not isinstance(listed, list):
            raise RowRejected("unparseable_tools", "an MCP server's tools are not a list")
        tools.extend(wrap_tool(tool) for tool in listed)
    return tools or None


def normalise_toucan(row: Any, index: int, policy: MultiTurnPolicy) -> list[NormalisedPrompt]:
    """One Toucan row: ``messages`` (JSON string), ``metadata`` (JSON string with the MCP tools)."""
    data = require_row(row)
    messages = _decode(data.get("messages"), "messages")
    metadata = _decode(data.get("metadata"), "metadata")
    tools = _mcp_tools(metadata)
    if tools is None:
        tools = parse_tools(data.get("tools"))
    provenance = {key: data[key] for key in ("uuid", "subset_name") if isinstance(data.get(key), str)}
    return build_prompts(
        openai_turns(messages), policy=policy, tools=tools, source_index=index, metadata=provenance
    )
