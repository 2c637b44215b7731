"""SGLang's native ``/generate`` wire format: exact token ids in, exact token ids out (exact-token mode).

The prompt is rendered with the target's chat template here, by the function the tokenize step renders a
training row's prompt with (:func:`datagen.dataset.tokenizer.render_prompt`), and sent as ``input_ids`` with
``sampling_params``; the answer's ``output_ids`` are kept verbatim with its finish reason and token counts, so
tokenization uses them without re-tokenizing text (zero drift). Reasoning and tool calls are split from the
raw text for the record (:mod:`datagen.generation.qwen_markup`); ``/generate`` applies no chat template and no
reasoning or tool-call parser.

Prompts are rendered in the shard task's thread before its requests reach the dispatcher
(:func:`attach_prompt_tokens`); the dispatcher's loop only builds bodies and parses answers, except for an
on-policy conversation's later turn, rendered as the turn before lands (its history is known only then): the
ids of the history it shares with that turn's prompt are taken from it, and only the rest is tokenized.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, StrictInt, TypeAdapter, ValidationError

from datagen.dataset.tokenizer import TokenizerSpec, render_prompt, shared_spec
from datagen.errors import TokenizeError
from datagen.generation.failures import FailureKind, error_type
from datagen.generation.openai_chat import (
    GenerationRequest,
    PromptTokens,
    UnusableResponseError,
    excerpt,
    optional_sampling_fields,
)
from datagen.generation.qwen_markup import (
    opens_reasoning,
    split_reasoning,
    split_tool_calls,
    strip_end_of_text,
)
from datagen.records import AssistantCompletion, FailureRecord, FinishReason, PromptRecord, TokenUsage

GENERATE_PATH = "/generate"
# sglang's /generate finish_reason.type values mapped onto datagen's.
GENERATE_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
# Sampling fields whose /generate name differs from the chat-completions name (the engines' rules use those).
GENERATE_FIELD_NAMES: Final = {"max_tokens": "max_new_tokens", "seed": "sampling_seed"}
# Validated in pydantic-core (microseconds for thousands of ids), on the dispatcher's loop thread.
_TOKEN_IDS: TypeAdapter[list[int]] = TypeAdapter(list[StrictInt])


class GenerateResult(BaseModel):
    """What one ``/generate`` answer carries that datagen keeps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str
    output_ids: list[int] = Field(description="Exact generated token ids (EOS / end-of-turn included).")
    finish_reason: FinishReason
    usage: TokenUsage
    meta_info: dict[str, Any] = Field(default_factory=dict, description="sglang's meta_info, verbatim.")


class PromptEncoder:
    """Renders prompts with the target's chat template and tokenizes them, as training rows' prompts are.

    Args:
        spec: The target tokenizer's spec (:meth:`TokenizerSpec.from_tokenizer`); the merge's workers build
            their tokenizer from the same serialized form.

    """

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        self.backend = spec.backend()
        self._added_ids = frozenset(int(token_id) for token_id in self.backend.get_added_tokens_decoder())

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> PromptEncoder:
        """The encoder of a loaded ``transformers`` fast tokenizer."""
        return cls(TokenizerSpec.from_tokenizer(tokenizer))

    def encode(
        self,
        prompts: list[tuple[PromptRecord, bool | None]],
        previous: list[PromptTokens | None] | None = None,
    ) -> list[PromptTokens | TokenizeError]:
        """Render and tokenize prompts; one result per ``(prompt, enable_thinking)``, in order.

        Args:
            prompts: Each prompt with the thinking switch it is sampled with.
            previous: Given for a conversation's turns: per prompt, the tokens of the turn before (or None for
                a first turn). The ids of the text both renders share, up to an added token, are taken from it,
                and only the rest is tokenized (a later turn on the dispatcher's loop: its history is not
                tokenized again); the ids are the same either way. Only then is the render kept for a next
                turn. None: prompts no turn follows (nothing is kept).

        Returns:
            Per prompt its ids, or the :class:`TokenizeError` saying why the template cannot render it.

        """
        results: list[PromptTokens | TokenizeError | None] = []
        texts: list[str] = []
        heads: list[tuple[int, list[int], tuple[tuple[int, int], ...]]] = []
        for position, (prompt, thinking) in enumerate(prompts):
            try:
                text = render_prompt(self.spec, prompt.messages, prompt.tools, thinking)
            except TokenizeError as error:
                results.append(error)
                continue
            before = previous[position] if previous is not None else None
            start, count, cuts = shared_head(before, text) if before is not None else (0, 0, ())
            texts.append(text)
            heads.append((start, before.input_ids[:count] if before is not None else [], cuts))
            results.append(None)
        # encode_batch encodes each text exactly as the row tokenizer's encode() does, and releases the GIL
        # while it runs, so the dispatcher's loop thread is not held up by a shard's renders.
        tails = [text[start:] for text, (start, _, _) in zip(texts, heads, strict=True)]
        encodings = iter(self.backend.encode_batch(tails, add_special_tokens=False))
        rendered = iter(zip(texts, heads, strict=True))
        out: list[PromptTokens | TokenizeError] = []
        for result in results:
            if result is not None:
                out.append(result)
                continue
            text, (start, head, cuts) = next(rendered)
            encoding = next(encodings)
            tail: list[int] = encoding.ids
            if previous is None:
                # Not a conversation's turn: nothing follows it, so nothing is kept for a next render.
                out.append(PromptTokens(input_ids=tail, opens_reasoning=opens_reasoning(text)))
                continue
            added = [
                (start + end, len(head) + index + 1)
                for index, (token, (_, end)) in enumerate(zip(tail, encoding.offsets, strict=True))
                if token in self._added_ids
            ]
            out.append(
                PromptTokens(
                    input_ids=head + tail,
                    opens_reasoning=opens_reasoning(text),
                    text=text,
                    cuts=(*cuts, *added),
                )
            )
        return out


def shared_head(before: PromptTokens, text: str) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    """Where ``text`` may take ``before``'s ids: ``(characters, ids, cuts)`` at its last shared added token."""
    for position in range(len(before.cuts) - 1, -1, -1):
        end, count = before.cuts[position]
        if text.startswith(before.text[:end]):
            return end, count, before.cuts[: position + 1]
    return 0, 0, ()


_encoder_lock = threading.Lock()
_encoders: dict[str, tuple[TokenizerSpec, PromptEncoder]] = {}


def prompt_encoder(tokenizer_path: str) -> PromptEncoder:
    """The process's encoder for the tokenizer at ``tokenizer_path``, built once from the shared spec.

    Args:
        tokenizer_path: ``model.tokenizer`` of the run.

    Returns:
        The encoder; the same one for every shard task of the process.

    Raises:
        ConfigError: The tokenizer cannot be loaded (preflight checked it already).

    """
    spec = shared_spec(tokenizer_path)
    with _encoder_lock:
        cached = _encoders.get(tokenizer_path)
        if cached is None or cached[0] is not spec:
            cached = (spec, PromptEncoder(spec))
            _encoders[tokenizer_path] = cached
        return cached[1]


def attach_prompt_tokens(
    requests: list[GenerationRequest],
    previous: list[PromptTokens | None] | None = None,
    *,
    encoder: PromptEncoder,
) -> tuple[list[GenerationRequest], list[FailureRecord]]:
    """Give every request its rendered prompt's ids; each prompt is rendered once for all its samples.

    Args:
        requests: Requests without ``prompt_tokens``.
        previous: Per request, the prompt tokens of its conversation's turn before (or None), whose ids of
            the shared history are reused (:meth:`PromptEncoder.encode`).
        encoder: The run's encoder (:func:`prompt_encoder`).

    Returns:
        The requests to send (with ``prompt_tokens``), and a failure for each request whose prompt the chat
        template cannot render (never sent: no server could answer it either).

    """
    index: dict[tuple[str, bool | None], int] = {}
    unique: list[tuple[PromptRecord, bool | None]] = []
    befores: list[PromptTokens | None] = []
    keys = [_render_key(request) for request in requests]
    for position, (request, key) in enumerate(zip(requests, keys, strict=True)):
        if key not in index:
            index[key] = len(unique)
            unique.append((request.prompt, request.sampling.enable_thinking))
            befores.append(previous[position] if previous is not None else None)
    encoded = encoder.encode(unique, befores if previous is not None else None)
    ready: list[GenerationRequest] = []
    failures: list[FailureRecord] = []
    for request, key in zip(requests, keys, strict=True):
        tokens = encoded[index[key]]
        if isinstance(tokens, TokenizeError):
            failures.append(
                FailureRecord(
                    prompt_id=request.prompt.prompt_id,
                    sample_index=request.sample_index,
                    dataset=request.dataset,
                    reason=f"the chat template cannot render the prompt: {tokens}",
                    error_type=error_type(FailureKind.UNRENDERABLE_PROMPT),
                    attempts=0,
                    turn=request.turn,
                )
            )
        else:
            ready.append(request.model_copy(update={"prompt_tokens": tokens}))
    return ready, failures


def _render_key(request: GenerationRequest) -> tuple[str, bool | None]:
    """What a render depends on: the prompt and the thinking switch; a conversation's later turn its own history."""
    name = request.key if request.turn else request.prompt.prompt_id
    return name, request.sampling.enable_thinking


def render_prompt_ids(tokenizer: Any, request: GenerationRequest) -> list[int]:
    """The prompt's token ids: the chat template rendered with a generation prompt, then encoded.

    Args:
        tokenizer: The target model's tokenizer (with its chat template).
        request: The request (messages, tools, ``enable_thinking``).

    Returns:
        The ids to send as ``input_ids``.

    Raises:
        TokenizeError: The template cannot render the prompt.

    """
    (tokens,) = PromptEncoder.from_tokenizer(tokenizer).encode(
        [(request.prompt, request.sampling.enable_thinking)]
    )
    if isinstance(tokens, TokenizeError):
        raise tokens
    return tokens.input_ids


def require_prompt_tokens(requests: Iterable[GenerationRequest]) -> None:
    """Check that every request carries its prompt's ids (exact-token mode sends nothing else).

    Raises:
        ValueError: A request has none (call :func:`attach_prompt_tokens` before submitting).

    """
    for request in requests:
        if request.prompt_tokens is None:
            raise ValueError(
                f"request {request.key} has no prompt_tokens: in exact-token mode requests are submitted with "
                "their rendered prompt ids (datagen.generation.sglang_generate.attach_prompt_tokens)"
            )


def generate_field_names(chat_fields: Iterable[str]) -> frozenset[str]:
    """Chat-completions sampling field names as ``/generate`` spells them (for the engines' field rules)."""
    return frozenset(GENERATE_FIELD_NAMES.get(name, name) for name in chat_fields)


def build_generate_payload(
    input_ids: list[int], request: GenerationRequest, *, rid: str | None = None
) -> dict[str, Any]:
    """The ``/generate`` body of one request (unset sampling fields left out).

    Args:
        input_ids: The rendered prompt (:func:`render_prompt_ids`, or the request's ``prompt_tokens``).
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
    params |= optional_sampling_fields(sampling, seed_name="sampling_seed")
    payload: dict[str, Any] = {"input_ids": input_ids, "sampling_params": params, "stream": False}
    if rid is not None:
        payload["rid"] = rid
    return payload


def build_request_payload(request: GenerationRequest, *, rid: str) -> dict[str, Any]:
    """The ``/generate`` body of a request carrying its prompt's ids.

    Raises:
        ValueError: The request has no ``prompt_tokens``.

    """
    if request.prompt_tokens is None:
        require_prompt_tokens([request])
    assert request.prompt_tokens is not None
    return build_generate_payload(request.prompt_tokens.input_ids, request, rid=rid)


def parse_generate_response(data: Any) -> GenerateResult:
    """Turn a ``/generate`` answer into what datagen keeps.

    Args:
        data: The parsed JSON body (one object: datagen sends one prompt per request).

    Returns:
        Text, exact output ids, finish reason, usage and the raw meta_info.

    Raises:
        UnusableResponseError: The body lacks ``output_ids`` or ``meta_info``, or they are malformed
            (transient: overloaded servers send garbage; a server without ``/generate`` answers 404 before this).

    """
    if isinstance(data, list) and len(data) == 1:
        data = data[0]
    if not isinstance(data, dict):
        raise UnusableResponseError(f"expected a JSON object from /generate, got {type(data).__name__}")
    meta = data.get("meta_info")
    try:
        output_ids = _TOKEN_IDS.validate_python(data.get("output_ids"))
    except ValidationError:
        raise UnusableResponseError(
            f"/generate answer has no output_ids list: {excerpt(str(data))}"
        ) from None
    if not isinstance(meta, dict):
        raise UnusableResponseError(f"/generate answer has no meta_info: {excerpt(str(data))}")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    text = data.get("text")
    usage = TokenUsage.model_construct(
        prompt_tokens=_count(meta, "prompt_tokens") or 0,
        completion_tokens=_count(meta, "completion_tokens") or len(output_ids),
        reasoning_tokens=_count(meta, "reasoning_tokens"),
    )
    # Every field is checked above: validating the whole model again would repeat the ids' check.
    return GenerateResult.model_construct(
        text=text if isinstance(text, str) else "",
        output_ids=output_ids,
        finish_reason=GENERATE_FINISH_REASONS.get(str(kind), "unknown"),
        usage=usage,
        meta_info=meta,
    )


def parse_generate_completion(
    data: Any, request: GenerationRequest
) -> tuple[AssistantCompletion, FinishReason, TokenUsage]:
    """Turn a ``/generate`` answer into datagen's records (what ``parse_chat_completion`` does for chat).

    Args:
        data: The parsed JSON body.
        request: The request it answers (its prompt's tools and whether the prompt opened a think block).

    Returns:
        The completion (with ``output_token_ids``, reasoning and tool calls split from the text), the finish
        reason (``tool_calls`` when a stopped answer made calls, as SGLang reports it for chat) and the usage.

    Raises:
        UnusableResponseError: A malformed body, or a generation the server aborted (transient: not the
            request's fault; aborts the request caused come back as HTTP 4xx).
        BadToolArgumentsError: A tool call whose arguments are not a JSON object (final, as on the chat path).

    """
    result = parse_generate_response(data)
    if result.finish_reason == "abort":
        finish = result.meta_info.get("finish_reason")
        message = finish.get("message") if isinstance(finish, dict) else None
        raise UnusableResponseError(f"the server aborted the generation: {message or 'no reason given'}")
    tokens = request.prompt_tokens
    reasoning, rest = split_reasoning(
        strip_end_of_text(result.text), reasoning_open=tokens is not None and tokens.opens_reasoning
    )
    # SGLang's chat API looks for tool calls only when the request offers tools; so does the record.
    content, tool_calls = split_tool_calls(rest, request.prompt.tools) if request.prompt.tools else (rest, [])
    completion = AssistantCompletion.model_construct(
        # As SGLang's chat API reports them: content always text, an empty reasoning none.
        content=content,
        reasoning_content=reasoning or None,
        tool_calls=tool_calls or None,
        output_token_ids=result.output_ids,
    )
    finish_reason = result.finish_reason
    if tool_calls and finish_reason == "stop":
        finish_reason = "tool_calls"
    usage = result.usage
    if not usage.prompt_tokens and tokens is not None:
        usage = usage.model_copy(update={"prompt_tokens": len(tokens.input_ids)})
    return completion, finish_reason, usage


def _count(meta: dict[str, Any], key: str) -> int | None:
    """A token count from meta_info, None when absent."""
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UnusableResponseError(f"/generate meta_info.{key} is not a token count: {excerpt(repr(value))}")
    return value
