"""Qwen's reasoning and tool-call markup in a raw generated text, split the way SGLang splits it for chat.

``/generate`` applies no reasoning or tool-call parser: its ``text`` is what the model wrote,
``<think>...</think>`` and ``<tool_call>...</tool_call>`` included. The record still carries
``reasoning_content`` and structured ``tool_calls``, split here as SGLang's ``qwen3`` reasoning parser and its
Qwen tool-call parsers (``qwen25``: a JSON object per call; ``qwen3_coder``: ``<function=...>`` XML, the
Qwen3.5/3.6 format) split them for ``/v1/chat/completions``, so a record reads the same whichever path made
it. Training rows never use this text in exact-token mode: they take the ids verbatim.
"""

from __future__ import annotations

import json
import re
from typing import Any

from datagen.generation.wire import BadToolArgumentsError, excerpt
from datagen.records import FunctionCall, ToolCall

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TURN_START = "<|im_start|>"
# SGLang trims the stop token it matched from `text` (not from `output_ids`); a server that does not leaves it.
END_OF_TEXT_MARKERS = ("<|im_end|>", "<|endoftext|>")
TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


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


def split_tool_calls(text: str, tools: list[dict[str, Any]] | None) -> tuple[str, list[ToolCall]]:
    """Take the complete ``<tool_call>...</tool_call>`` blocks out of an answer, like SGLang's Qwen parsers.

    Args:
        text: The answer after its reasoning.
        tools: The prompt's tool schemas: XML parameter values are typed by them.

    Returns:
        ``(content, calls)``: with calls, the content is the text before the first call, stripped (SGLang's
        rule); without, the text unchanged. An unclosed block (a truncated answer) stays in the content.

    Raises:
        BadToolArgumentsError: A block is neither a JSON object with a name and object arguments nor a
            ``<function=NAME>`` XML call (final, like unparseable arguments on the chat path).

    """
    blocks = list(TOOL_CALL_BLOCK.finditer(text))
    if not blocks:
        return text, []
    calls = [_tool_call(match.group(1), index, tools) for index, match in enumerate(blocks)]
    return text[: blocks[0].start()].strip(), calls


def _tool_call(body: str, index: int, tools: list[dict[str, Any]] | None) -> ToolCall:
    stripped = body.strip()
    arguments: dict[str, Any]
    if stripped.startswith("{"):
        name, arguments = _json_call(stripped, index)
    else:
        match = XML_FUNCTION.search(stripped)
        if match is None:
            raise BadToolArgumentsError(
                f"tool call {index} is neither a JSON object nor a <function=...> call: {excerpt(stripped)}"
            )
        name = match.group(1).strip()
        types = _parameter_types(tools, name)
        arguments = {}
        for parameter in XML_PARAMETER.finditer(match.group(2)):
            key = parameter.group(1).strip()
            arguments[key] = _xml_value(_trim_newline(parameter.group(2)), types.get(key))
    # SGLang draws a random id per call; a deterministic one keeps a rerun's records comparable.
    return ToolCall(id=f"call_{index}", function=FunctionCall(name=name, arguments=arguments))


def _json_call(body: str, index: int) -> tuple[str, dict[str, Any]]:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as error:
        raise BadToolArgumentsError(
            f"tool call {index} is not valid JSON ({error.msg}): {excerpt(body)}"
        ) from None
    name = data.get("name") if isinstance(data, dict) else None
    if not isinstance(name, str) or not name:
        raise BadToolArgumentsError(f"tool call {index} has no function name: {excerpt(body)}")
    arguments = data.get("arguments", data.get("parameters"))
    if isinstance(arguments, str):
        # Some generations encode the arguments as a JSON string, as the OpenAI API does.
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            raise BadToolArgumentsError(
                f"tool call {name!r} has arguments that are not valid JSON ({error.msg}): {excerpt(body)}"
            ) from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise BadToolArgumentsError(
            f"tool call {name!r} has arguments that are not a JSON object: {excerpt(body)}"
        )
    return name, arguments


def _parameter_types(tools: list[dict[str, Any]] | None, name: str) -> dict[str, str]:
    """The JSON-schema type of each parameter of tool ``name`` (empty when unknown)."""
    for tool in tools or []:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties") or {}
            return {
                key: str(spec.get("type"))
                for key, spec in properties.items()
                if isinstance(spec, dict) and spec.get("type")
            }
    return {}


def _trim_newline(value: str) -> str:
    """The value between ``<parameter=...>`` tags without the one newline the format puts on each side."""
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


def _xml_value(value: str, declared: str | None) -> Any:
    """A string parameter stays text; anything else is read as JSON when it parses (numbers, objects...)."""
    if declared == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value
