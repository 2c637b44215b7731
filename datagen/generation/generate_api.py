"""SGLang's native ``/generate`` wire format: exact token ids in, exact token ids out (exact-token mode).

The prompt is rendered with the target's chat template here (the same render the tokenize step uses, so
the prompt ids of a training row are the ids that were served), sent as ``input_ids`` with
``sampling_params``; the answer's ``output_ids`` are kept verbatim with its ``meta_info`` (finish reason,
token counts), so tokenization uses them without re-tokenizing text (zero drift). Everything here is pure;
the dispatcher sends the bodies. Reasoning and tool calls are parsed from the text for the record by the
caller; ``/generate`` applies no chat template and no reasoning/tool parser.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from datagen.generation.wire import GenerationRequest, UnusableResponseError, excerpt
from datagen.records import FinishReason, TokenUsage

GENERATE_PATH = "/generate"
# sglang's /generate finish_reason.type values mapped onto datagen's.
GENERATE_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class GenerateResult(BaseModel):
    """What one ``/generate`` answer carries that datagen keeps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str
    output_ids: list[int] = Field(description="Exact generated token ids (EOS / end-of-turn included).")
    finish_reason: FinishReason
    usage: TokenUsage
    meta_info: dict[str, Any] = Field(default_factory=dict, description="sglang's meta_info, verbatim.")


def render_prompt_ids(tokenizer: Any, request: GenerationRequest) -> list[int]:
    """The prompt's token ids: the chat template rendered with a generation prompt, then encoded.

    This is the render :func:`datagen.output.tokenize.tokenize_completion` uses for exact-id rows, so the prompt
    part of a training row equals what the server saw.

    Args:
        tokenizer: The target model's tokenizer (with its chat template).
        request: The request (messages, tools, ``enable_thinking``).

    Returns:
        The ids to send as ``input_ids``.

    """
    from datagen.output.tokenize import render_conversation

    text = render_conversation(
        tokenizer,
        [message.to_chat_dict() for message in request.prompt.messages],
        tools=request.prompt.tools,
        add_generation_prompt=True,
        enable_thinking=request.sampling.enable_thinking,
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_generate_payload(
    input_ids: list[int], request: GenerationRequest, *, rid: str | None = None
) -> dict[str, Any]:
    """The ``/generate`` body of one request (unset sampling fields left out).

    Args:
        input_ids: The rendered prompt (:func:`render_prompt_ids`).
        request: Sampling parameters come from here.
        rid: sglang request id (lets ``/abort_request`` cancel it); must be unique among running requests.

    Returns:
        The JSON body.

    """
    sampling = request.sampling
    params: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        # /generate defaults to 128 new tokens: always send the limit.
        "max_new_tokens": sampling.max_tokens,
        # Keep special tokens in `text` so reasoning/tool markup can be parsed from it.
        "skip_special_tokens": False,
    }
    if sampling.top_k is not None:
        params["top_k"] = sampling.top_k
    if sampling.min_p is not None:
        params["min_p"] = sampling.min_p
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    payload: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": params, "stream": False}
    if rid is not None:
        payload["rid"] = rid
    return payload


def parse_generate_response(data: Any) -> GenerateResult:
    """Turn a ``/generate`` answer into what datagen keeps.

    Args:
        data: The parsed JSON body (one object: datagen sends one prompt per request).

    Returns:
        Text, exact output ids, finish reason, usage and the raw meta_info.

    Raises:
        UnusableResponseError: The body lacks ``output_ids`` or ``meta_info`` (transient: overloaded servers
            send garbage; a server without ``/generate`` answers 404 before this).

    """
    if isinstance(data, list) and len(data) == 1:
        data = data[0]
    if not isinstance(data, dict):
        raise UnusableResponseError(f"expected a JSON object from /generate, got {type(data).__name__}")
    output_ids = data.get("output_ids")
    meta = data.get("meta_info")
    if not isinstance(output_ids, list) or not all(isinstance(token, int) for token in output_ids):
        raise UnusableResponseError(f"/generate answer has no output_ids: {excerpt(str(data))}")
    if not isinstance(meta, dict):
        raise UnusableResponseError(f"/generate answer has no meta_info: {excerpt(str(data))}")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    usage = TokenUsage(
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        completion_tokens=int(meta.get("completion_tokens") or len(output_ids)),
    )
    return GenerateResult(
        text=str(data.get("text") or ""),
        output_ids=output_ids,
        finish_reason=GENERATE_FINISH_REASONS.get(str(kind), "unknown"),
        usage=usage,
        meta_info=meta,
    )
