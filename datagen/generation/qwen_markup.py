"""Qwen's reasoning and tool-call markup in a raw generated text, split the way SGLang splits it for chat.

``/generate`` applies no reasoning or tool-call parser: its ``text`` is what the model wrote,
``<think>...</think>`` and ``<tool_call>...</tool_call>`` included. The record still carries
``reasoning_content`` and structured ``tool_calls``, split here as SGLang's ``qwen3`` reasoning parser and its
Qwen tool-call parsers (``qwen25``: a JSON object per call; ``qwen3_coder``: ``<function=...>`` XML, the
Qwen3.5/3.6 format) split them for ``/v1/chat/completions``, quirks included (a contract test runs SGLang's
own parsers on the same texts), so a record reads the same whichever path made it. Training rows never use
this text in exact-token mode: they take the ids verbatim.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Final

from datagen.generation.openai_chat import BadToolArgumentsError, excerpt
from datagen.literals import parse_loose
from datagen.records import FunctionCall, ToolCall

logger = logging.getLogger(__name__)

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TURN_START = "<|im_start|>"
# SGLang trims the stop token it matched from `text` (not from `output_ids`); a server that does not leaves it.
END_OF_TEXT_MARKERS = ("<|im_end|>", "<|endoftext|>")
FUNCTION_START = "<function="
TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# A function runs to its closing tag, or to the end of the text when a truncated answer left it open; so does
# a parameter (or to the next parameter, or the function's end).
XML_FUNCTION = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
XML_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)
TEXT_TYPES: Final = frozenset({"string", "str", "text", "varchar", "char", "enum"})
INTEGER_TYPE_PREFIXES: Final = ("int", "uint", "long", "short", "unsigned")
# A parameter the tool's schema does not declare: kept as text.
_UNDECLARED: Final = object()


def opens_reasoning(prompt_text: str) -> bool:
    """Tell whether a rendered prompt leaves a ``<think>`` block open for the answer to continue.

    Qwen3.5/3.6 templates pre-fill ``<think>`` and a newline after the assistant header, so the model's text starts
    inside its reasoning and only closes it with ``</think>``; Qwen3's non-thinking mode pre-fills a closed,
    empty block instead.

    Args:
        prompt_text: The prompt render, generation prompt included.

    Returns:
        True when the last turn opened by the template has a ``<think>`` not closed after it.

    """
    turn = prompt_text[max(prompt_text.rfind(TURN_START), 0) :]
    return turn.rfind(THINK_START) > turn.rfind(THINK_END)


def strip_end_of_text(text: str) -> str:
    """``text`` without a trailing end-of-turn or end-of-text marker (the stop token, when not trimmed)."""
    for marker in END_OF_TEXT_MARKERS:
        if text.endswith(marker):
            return text[: -len(marker)]
    return text


def split_reasoning(text: str, *, reasoning_open: bool) -> tuple[str | None, str]:
    """Split a raw answer into its reasoning and the rest, like SGLang's ``qwen3`` reasoning parser.

    Args:
        text: The generated text.
        reasoning_open: The prompt left a ``<think>`` block open (:func:`opens_reasoning`).

    Returns:
        ``(reasoning, rest)``; reasoning is None when the answer has none. An answer cut off before
        ``</think>`` is all reasoning, unless a tool call starts in it (Qwen3.5 sometimes opens one without
        closing its reasoning): the call and what follows are the rest.

    """
    if not reasoning_open and THINK_START not in text:
        return None, text
    body = text
    while body.startswith(THINK_START):
        body = body[len(THINK_START) :]
    if THINK_END in body:
        reasoning, rest = body.split(THINK_END, 1)
        return reasoning, rest
    tool_start = body.find(TOOL_CALL_START)
    if tool_start != -1:
        return body[:tool_start], body[tool_start:]
    return body, ""


def split_tool_calls(text: str, tools: list[dict[str, Any]]) -> tuple[str, list[ToolCall]]:
    """Take Qwen tool calls out of an answer, as SGLang's ``qwen25`` / ``qwen3_coder`` parsers do for chat.

    Only for prompts that offer tools (SGLang's chat API parses calls only then). Calls written as
    ``<function=NAME>`` XML (Qwen3.5/3.6) follow ``qwen3_coder``: every function found counts, even one a
    truncated answer left open, and parameter values are typed by the tool's schema. Calls written as JSON
    (Qwen3) follow ``qwen25``: complete blocks only; a block that is not valid JSON, or names a tool the prompt
    does not offer, is left out (SGLang drops it with a warning) while the answer stays a completion.

    Args:
        text: The answer after its reasoning.
        tools: The prompt's tool schemas.

    Returns:
        ``(content, calls)``: the content is the text before the first ``<tool_call>`` (stripped for JSON
        calls, as ``qwen25`` does); without one, the text unchanged.

    Raises:
        BadToolArgumentsError: A JSON call whose arguments are not an object (final, as on the chat path,
            where datagen refuses such arguments from any server).

    """
    start = text.find(TOOL_CALL_START)
    if start == -1:
        return text, []
    blocks = TOOL_CALL_BLOCK.findall(text)
    if FUNCTION_START in text:
        found = _xml_calls(blocks or [text], tools)
        content = text[:start]
    else:
        names = {name for name, _ in _tool_schemas(tools)}
        found = [call for block in blocks for call in _json_calls(block, names)]
        content = text[:start].strip()
    calls = [
        # SGLang draws a random id per call; a deterministic one keeps a rerun's records comparable.
        ToolCall(id=f"call_{index}", function=FunctionCall(name=name, arguments=arguments))
        for index, (name, arguments) in enumerate(found)
    ]
    return content, calls


def _json_calls(block: str, names: set[str]) -> list[tuple[str, dict[str, Any]]]:
    try:
        data = json.loads(block.strip())
    except json.JSONDecodeError:
        logger.debug("tool call that is not JSON left out: %s", excerpt(block))
        return []
    calls = []
    for action in data if isinstance(data, list) else [data]:
        name = action.get("name") if isinstance(action, dict) else None
        if not isinstance(name, str) or name not in names:
            logger.debug("tool call of a tool the prompt does not offer left out: %s", excerpt(block))
            continue
        arguments = action.get("parameters") or action.get("arguments", {})
        if not isinstance(arguments, dict):
            raise BadToolArgumentsError(
                f"tool call {name!r} has arguments that are not a JSON object: {excerpt(block.strip())}"
            )
        calls.append((name, arguments))
    return calls


def _xml_calls(blocks: list[str], tools: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    schemas = dict(_tool_schemas(tools))
    calls = []
    for block in blocks:
        for function in XML_FUNCTION.finditer(block):
            body = function.group(1) if function.group(1) is not None else function.group(2)
            name, separator, parameters_text = body.partition(">")
            if not separator:
                continue
            properties = _properties(schemas.get(name))
            arguments: dict[str, Any] = {}
            for parameter in XML_PARAMETER.findall(parameters_text):
                key, separator, value = parameter.partition(">")
                if separator:
                    value = value.removeprefix("\n").removesuffix("\n")
                    arguments[key] = _typed_value(value, properties.get(key, _UNDECLARED))
            calls.append((name, arguments))
    return calls


def _tool_schemas(tools: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """(name, parameters schema) of every function tool."""
    found = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            continue
        function = tool.get("function")
        if isinstance(function, dict) and function.get("name"):
            found.append((str(function["name"]), function.get("parameters")))
    return found


def _properties(schema: Any) -> dict[str, Any]:
    """A parameters schema's top-level properties, or those of its anyOf/oneOf/allOf branches."""
    if not isinstance(schema, dict):
        return {}
    properties = schema.get("properties")
    if isinstance(properties, dict):
        return properties
    merged: dict[str, Any] = {}
    for keyword in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(keyword) or []:
            for key, value in _properties(branch).items():
                merged.setdefault(key, value)
    return merged


def _typed_value(value: str, schema: Any) -> Any:
    """An XML parameter's text as the value its schema declares (text when undeclared or unparseable)."""
    if value.lower() == "null":
        return None
    if schema is _UNDECLARED:
        return value
    kind = (_schema_type(schema) or "string").strip().lower()
    if kind in TEXT_TYPES:
        return value
    if kind.startswith(INTEGER_TYPE_PREFIXES):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        written_as_integer = "." not in value and "e" not in value.lower()
        return int(number) if written_as_integer and number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    structured = kind in ("object", "array", "arr") or kind.startswith(("dict", "list"))
    try:
        return parse_loose(value, json_first=structured)
    except ValueError:
        return value


def _schema_type(schema: Any) -> str | None:
    """The main JSON-schema type of a parameter (the one its value is converted to), None when unknown."""
    if not isinstance(schema, dict):
        return None
    declared = schema.get("type")
    if isinstance(declared, str):
        return declared
    if isinstance(declared, list) and declared:
        return next((kind for kind in declared if kind != "null"), "string")
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list):
        kinds = [kind for kind in (_schema_type(branch) for branch in branches) if kind]
        distinct = set(kinds)
        if len(distinct) == 1:
            return kinds[0]
        if len(distinct) == 2 and "null" in distinct:
            return next(kind for kind in kinds if kind != "null")
        if "string" in distinct:
            return "string"
        if kinds:
            return kinds[0]
    enum = schema.get("enum")
    if isinstance(enum, list):
        enum_kinds = {_value_type(value) for value in enum}
        return enum_kinds.pop() if len(enum_kinds) == 1 else "string"
    if isinstance(schema.get("allOf"), list):
        all_kinds = [_schema_type(branch) for branch in schema["allOf"]]
        return next((kind for kind in all_kinds if kind and kind != "string"), "string")
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return None


def _value_type(value: Any) -> str:
    if value is None:
        return "null"
    for kind, types in (("boolean", bool), ("integer", int), ("number", float), ("string", str)):
        if isinstance(value, types):
            return kind
    return "array" if isinstance(value, list) else "object"
