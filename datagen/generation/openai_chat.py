"""The OpenAI chat-completions wire format: the request datagen sends and how an answer becomes records.

Everything here is pure (no I/O): the dispatcher sends :func:`build_chat_payload` bodies and turns the
answers into records with :func:`parse_chat_completion`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from datagen.records import (
    AssistantCompletion,
    FinishReason,
    FunctionCall,
    PromptRecord,
    SamplingParams,
    TokenUsage,
    ToolCall,
    request_key,
)

CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
BODY_EXCERPT_CHARS = 200
FINISH_REASONS: dict[str, FinishReason] = {
    "stop": "stop",
    "eos": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "abort": "abort",
    "content_filter": "content_filter",
}


class PromptTokens(BaseModel):
    """A prompt rendered with the target's chat template and tokenized, for exact-token mode (``/generate``).

    Attributes:
        input_ids: The rendered prompt's token ids, generation prompt included.
        opens_reasoning: The generation prompt leaves a ``<think>`` block open (Qwen3.5/3.6 pre-fill
            ``<think>`` and a newline), so the answer starts inside its reasoning.
        text: The rendered prompt, kept so the conversation's next turn tokenizes only what changed.
        cuts: ``(character, ids)`` after each added token of ``text``: its first ``ids`` are the ids of its
            first ``character`` characters (the tokenizer splits on added tokens before anything else).

    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    input_ids: list[int] = Field(min_length=1)
    opens_reasoning: bool = False
    text: str = Field(default="", exclude=True, repr=False)
    cuts: tuple[tuple[int, int], ...] = Field(default=(), exclude=True, repr=False)


class GenerationRequest(BaseModel):
    """One request to generate: a prompt, which sample of it, and how to sample.

    Attributes:
        prompt: The prompt to answer.
        sample_index: Which of the prompt's samples this is (0-based).
        sampling: The resolved sampling parameters (seed already derived per request, if any).
        sampling_setting: The name of the dataset's sampling-mix setting the prompt drew (None: no mix).
        turn: An on-policy conversation's turn (None: a request of its own); ``prompt.messages`` then hold the
            conversation so far, the target's own earlier answers included.
        dataset: The dataset the prompt belongs to.
        prompt_tokens: The rendered prompt's ids (exact-token mode only; shared by the prompt's samples).

    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: PromptRecord
    sample_index: int = Field(default=0, ge=0)
    sampling: SamplingParams
    sampling_setting: str | None = None
    turn: int | None = Field(default=None, ge=0)
    dataset: str
    prompt_tokens: PromptTokens | None = None

    @property
    def key(self) -> str:
        """The request key, unique within a run: ``<prompt_id>/<sample_index>`` (``/<turn>`` for a conversation's)."""
        return request_key(self.prompt.prompt_id, self.sample_index, self.turn)


class UnusableResponseError(Exception):
    """The body is not a usable chat completion (transient: overloaded servers send garbage)."""


class BadToolArgumentsError(Exception):
    """A tool call's arguments are not a JSON object (final: the model produced them)."""


def build_chat_payload(request: GenerationRequest, model: str) -> dict[str, Any]:
    """The OpenAI ``/v1/chat/completions`` body of one request (unset sampling fields left out).

    Args:
        request: What to generate.
        model: The model name the server expects.

    Returns:
        The JSON body.

    """
    sampling = request.sampling
    payload: dict[str, Any] = {
        "model": model,
        "messages": [message.to_chat_dict() for message in request.prompt.messages],
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
        "stream": False,
    }
    if request.prompt.tools:
        payload["tools"] = request.prompt.tools
    payload |= optional_sampling_fields(sampling, seed_name="seed")
    if sampling.enable_thinking is not None:
        payload["chat_template_kwargs"] = {"enable_thinking": sampling.enable_thinking}
    return payload


def optional_sampling_fields(sampling: SamplingParams, *, seed_name: str) -> dict[str, Any]:
    """The sampling fields sent only when set (``top_k``, ``min_p``, the seed under the API's name)."""
    fields: dict[str, Any] = {}
    if sampling.top_k is not None:
        fields["top_k"] = sampling.top_k
    if sampling.min_p is not None:
        fields["min_p"] = sampling.min_p
    if sampling.seed is not None:
        fields[seed_name] = sampling.seed
    return fields


def parse_chat_completion(data: Any) -> tuple[AssistantCompletion, FinishReason, TokenUsage]:
    """Turn a chat-completion response body into datagen's records.

    Args:
        data: The parsed JSON body.

    Returns:
        The assistant's completion, the finish reason (mapped onto datagen's literals) and the usage.

    Raises:
        UnusableResponseError: The body has no usable first choice, or the server aborted the generation.
        BadToolArgumentsError: A tool call's arguments are not a JSON object.

    """
    if not isinstance(data, dict):
        raise UnusableResponseError(f"expected a JSON object, got {type(data).__name__}")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise UnusableResponseError(f"no choices in {excerpt(json.dumps(data))}")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise UnusableResponseError("first choice has no message")
    tool_calls = [_parse_tool_call(call) for call in message.get("tool_calls") or []]
    completion = AssistantCompletion(
        content=message.get("content"),
        reasoning_content=message.get("reasoning_content") or message.get("reasoning"),
        tool_calls=tool_calls or None,
    )
    finish_reason = FINISH_REASONS.get(str(choice.get("finish_reason")), "unknown")
    if finish_reason == "abort":
        # A 200 that carries no finished answer (SGLang: evicted, overloaded): retried like a reset, never kept.
        raise UnusableResponseError(f"the server aborted the generation: {excerpt(json.dumps(choice))}")
    raw_usage = data.get("usage") or {}
    details = raw_usage.get("completion_tokens_details") or {}
    usage = TokenUsage(
        prompt_tokens=int(raw_usage.get("prompt_tokens") or 0),
        completion_tokens=int(raw_usage.get("completion_tokens") or 0),
        reasoning_tokens=details.get("reasoning_tokens"),
    )
    return completion, finish_reason, usage


def _parse_tool_call(call: Any) -> ToolCall:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise UnusableResponseError(f"malformed tool call {excerpt(json.dumps(call))}")
    function = call["function"]
    name = str(function.get("name") or "")
    raw = function.get("arguments")
    if raw is None or raw == "":
        arguments: Any = {}
    elif isinstance(raw, str):
        try:
            arguments = json.loads(raw)
        except json.JSONDecodeError as error:
            raise BadToolArgumentsError(
                f"tool call {name!r} has arguments that are not valid JSON ({error.msg}): {excerpt(raw)}"
            ) from None
    else:
        arguments = raw
    if not isinstance(arguments, dict):
        raise BadToolArgumentsError(
            f"tool call {name!r} has arguments that are not a JSON object: {excerpt(json.dumps(arguments))}"
        )
    return ToolCall(id=call.get("id"), function=FunctionCall(name=name, arguments=arguments))


def excerpt(text: str) -> str:
    """``text`` on one line, cut to ``BODY_EXCERPT_CHARS`` for error messages."""
    flat = " ".join(text.split())
    return flat if len(flat) <= BODY_EXCERPT_CHARS else flat[:BODY_EXCERPT_CHARS] + "..."
