"""Tool definitions and tool calls found in dataset rows, turned into structured OpenAI-style data.

Datasets carry tools as JSON strings, Python reprs (single quotes, True/False, as in Hermes system
prompts), lists of bare function schemas or of ``{"type": "function", "function": ...}`` wrappers. All
of them become a list of wrapped definitions; tool calls become :class:`~datagen.records.ToolCall` with
dict arguments.
"""

from __future__ import annotations

import json
import re
from typing import Any

from datagen.literals import parse_loose
from datagen.prompts.datasets.model import RowRejected
from datagen.records import FunctionCall, ToolCall

TOOLS_BLOCK = re.compile(r"<tools>(.*?)</tools>", re.DOTALL)
TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
TOOL_RESPONSE_BLOCK = re.compile(r"<tool_response>(.*?)(?:</tool_response>|$)", re.DOTALL)
# Hermes's boilerplate about tools and its call format; the target's chat template states its own when
# it renders `tools`, so keeping these would describe the tools twice (and a conflicting call format).
HERMES_BOILERPLATE = (
    re.compile(r"You are a function calling AI model\.\s*"),
    re.compile(r"You are provided with function signatures within <tools>\s*</tools> XML tags\.\s*"),
    re.compile(r"You may call one or more functions to assist with the user query\.\s*"),
    re.compile(r"For each function call,? return.*</tool_call>\s*", re.DOTALL),
)


def strip_hermes_boilerplate(system: str) -> str:
    """The system prompt without its ``<tools>`` blocks and Hermes's tool-calling boilerplate."""
    for pattern in HERMES_BOILERPLATE:
        system = pattern.sub("", system)
    system = TOOLS_BLOCK.sub("", system)
    return re.sub(r"\n{3,}", "\n\n", system).strip()


def parse_tool_text(text: str, what: str) -> Any:
    """A tool call written as text (JSON or a Python literal, white space around it ignored), parsed.

    Args:
        text: The text.
        what: The start of the rejection's message, e.g. ``"a <tool_call> block is"``.

    Returns:
        The parsed value.

    Raises:
        RowRejected: ``unparseable_tool_call`` when the text is neither.

    """
    try:
        return parse_loose(text.strip())
    except ValueError as error:
        raise RowRejected("unparseable_tool_call", f"{what} not parseable: {error}") from None


def _parse_object_sequence(text: str) -> list[Any]:
    """Parse several JSON/Python values written one after another (``{...} {...}``)."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    position = 0
    stripped = text.strip()
    while position < len(stripped):
        while position < len(stripped) and stripped[position] in " \t\r\n,":
            position += 1
        if position >= len(stripped):
            break
        value, position = decoder.raw_decode(stripped, position)
        values.append(value)
    return values


def wrap_tool(tool: Any) -> dict[str, Any]:
    """One tool definition in wrapped OpenAI form.

    Accepts ``{"type": "function", "function": {...}}``, a bare ``{"name", "description", "parameters"}``
    schema, or an MCP tool (``inputSchema``/``input_schema`` instead of ``parameters``).

    Raises:
        RowRejected: ``tool`` is not a recognisable definition (reason ``unparseable_tools``).

    """
    if not isinstance(tool, dict):
        raise RowRejected("unparseable_tools", f"a tool definition is a {type(tool).__name__}, not an object")
    function = tool.get("function") if tool.get("type", "function") == "function" else None
    if isinstance(function, dict):
        body = dict(function)
    elif "name" in tool:
        body = {key: value for key, value in tool.items() if key != "type"}
    else:
        raise RowRejected("unparseable_tools", "a tool definition has no name")
    if not isinstance(body.get("name"), str) or not body["name"].strip():
        raise RowRejected("unparseable_tools", "a tool definition's name is not a non-empty string")
    for schema_key in ("inputSchema", "input_schema"):
        if schema_key in body and "parameters" not in body:
            body["parameters"] = body.pop(schema_key)
    return {"type": "function", "function": body}


def parse_tools(value: Any) -> list[dict[str, Any]] | None:
    """Tool definitions from a row field: a list, one object, or a JSON/Python-repr string of either.

    Returns:
        Wrapped definitions, or None when ``value`` holds none (missing, empty string, empty list).

    Raises:
        RowRejected: The value is present but not parseable (reason ``unparseable_tools``).

    """
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = parse_loose(value.strip())
        except ValueError:
            try:
                value = _parse_object_sequence(value)
            except (json.JSONDecodeError, RecursionError) as error:
                raise RowRejected(
                    "unparseable_tools", f"tools are not JSON or a Python literal: {error}"
                ) from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list | tuple):
        raise RowRejected("unparseable_tools", f"tools are a {type(value).__name__}, not a list")
    tools = [wrap_tool(tool) for tool in value]
    return tools or None


def extract_system_tools(system: str) -> tuple[list[dict[str, Any]] | None, str]:
    """Take the ``<tools>`` block out of a Hermes-style system prompt.

    Returns:
        The tools (None when the prompt has no block) and the prompt without the block and without
        Hermes's description of its call format (the target's chat template describes its own).

    Raises:
        RowRejected: A block is present but not parseable (reason ``unparseable_tools``).

    """
    if not TOOLS_BLOCK.search(system):
        return None, system
    remaining = strip_hermes_boilerplate(system)
    tools: list[dict[str, Any]] = []
    for block in TOOLS_BLOCK.findall(HERMES_BOILERPLATE[1].sub("", system)):
        tools.extend(parse_tools(block) or [])
    return tools or None, remaining


def make_tool_call(name: Any, arguments: Any, call_id: Any = None) -> ToolCall:
    """A structured tool call; ``arguments`` may be a dict or a JSON/Python-repr string of one.

    Raises:
        RowRejected: The name is missing or the arguments are not an object (``unparseable_tool_call``).

    """
    if not isinstance(name, str) or not name.strip():
        raise RowRejected("unparseable_tool_call", "a tool call has no function name")
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        arguments = {}
    if isinstance(arguments, str):
        arguments = parse_tool_text(arguments, f"arguments of {name!r} are")
    if not isinstance(arguments, dict):
        raise RowRejected("unparseable_tool_call", f"arguments of {name!r} are a {type(arguments).__name__}")
    return ToolCall(
        id=str(call_id) if call_id is not None else None,
        function=FunctionCall(name=name, arguments={str(key): value for key, value in arguments.items()}),
    )


def tool_call_from_dict(value: Any) -> ToolCall:
    """A tool call from ``{"name", "arguments"}`` or an OpenAI ``{"id", "function": {...}}`` object.

    Raises:
        RowRejected: ``value`` is not such an object (reason ``unparseable_tool_call``).

    """
    if not isinstance(value, dict):
        raise RowRejected("unparseable_tool_call", f"a tool call is a {type(value).__name__}, not an object")
    function = value.get("function")
    if isinstance(function, dict):
        return make_tool_call(function.get("name"), function.get("arguments"), value.get("id"))
    return make_tool_call(value.get("name"), value.get("arguments", value.get("parameters")), value.get("id"))


def split_tool_call_blocks(text: str) -> tuple[str | None, list[ToolCall]]:
    """Split an assistant turn into its text and its ``<tool_call>`` blocks.

    Returns:
        The text outside the blocks (None when only blocks) and the parsed calls (several per turn allowed).

    Raises:
        RowRejected: A block's body is neither JSON nor a Python dict (reason ``unparseable_tool_call``).

    """
    bodies = TOOL_CALL_BLOCK.findall(text)
    if not bodies:
        return text, []
    calls: list[ToolCall] = []
    for body in bodies:
        parsed = parse_tool_text(body, "a <tool_call> block is")
        for item in parsed if isinstance(parsed, list) else [parsed]:
            calls.append(tool_call_from_dict(item))
    remaining = TOOL_CALL_BLOCK.sub("", text).strip()
    return remaining or None, calls


def split_tool_responses(text: str) -> list[str]:
    """The bodies of the ``<tool_response>`` blocks of a tool turn (the whole text when it has none)."""
    bodies = [body.strip() for body in TOOL_RESPONSE_BLOCK.findall(text)]
    return bodies or [text.strip()]
