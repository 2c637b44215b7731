"""Turn one completion into a training row: token ids of the whole conversation plus a loss mask.

The target's own chat template renders the conversation twice: the prompt with the generation prompt
appended (exactly what the server saw), and the prompt followed by the generated assistant turn. The
prompt render must be a prefix of the full render, otherwise the template does not reproduce what was
served and the row is refused.

Loss-mask rule (text path): the loss region is the characters of the full render from the end of the
prompt render through the assistant turn's closing ``<|im_end|>`` inclusive. The full render is tokenized
once, with character offsets, and a token is trained on (mask 1) when its character span overlaps the loss
region. So a token that BPE merged across the prompt/answer boundary counts as generated (the model had to
produce it), while the prompt, system text, tools, tool results, template filler pre-filled in the prompt
(such as the empty think block of non-thinking mode) and the newline after ``<|im_end|>`` are never
trained on. A truncated completion (finish reason ``length``) did not end its turn, so its closing
``<|im_end|>`` (added by the template) is not trained on either.

Exact-ids path: when the engine returned the generated token ids, the row is the tokenized prompt render
followed by those ids (plus ``<|im_end|>`` when generation stopped on it but the ids leave it out), and the
mask is 1 exactly on the generated ids. This avoids any re-tokenization drift.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from datagen.errors import ConfigError, TokenizeError
from datagen.records import CompletionRecord, Message

logger = logging.getLogger(__name__)

END_OF_TURN_TOKEN = "<|im_end|>"
# Finish reasons meaning the model emitted its end-of-turn token itself.
ENDED_TURN_REASONS = frozenset({"stop", "tool_calls"})
REJECT_TOO_LONG = "too_long"


class TokenizedRow(BaseModel):
    """One training row: the rendered conversation's token ids and which of them carry loss.

    Attributes:
        input_ids: Token ids of the whole conversation (prompt + assistant turn).
        loss_mask: 1 on the generated tokens (through ``<|im_end|>``), 0 elsewhere; same length.
        num_tokens: ``len(input_ids)``.
        num_loss_tokens: ``sum(loss_mask)``.

    """

    model_config = ConfigDict(extra="forbid")

    prompt_id: str
    sample_index: int
    dataset: str
    input_ids: list[int]
    loss_mask: list[int]
    num_tokens: int
    num_loss_tokens: int
    finish_reason: str


class RejectedRow(BaseModel):
    """A completion that renders fine but is not kept as a row (e.g. too long); counted, never raised."""

    model_config = ConfigDict(extra="forbid")

    prompt_id: str
    sample_index: int
    dataset: str
    reason: Literal["too_long"]
    detail: str


def load_tokenizer(path: str) -> Any:
    """Load the target's tokenizer from local files only (never the network).

    Args:
        path: A local directory (or a hub id already in the local cache) holding a fast tokenizer
            with a chat template.

    Returns:
        A ``transformers`` fast tokenizer.

    Raises:
        ConfigError: Nothing loadable is there, the tokenizer is not a fast one (offsets are needed for the
            loss mask), or it has no chat template.

    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        where = "directory" if Path(path).exists() else "path (it does not exist locally)"
        raise ConfigError(
            f"Cannot load a tokenizer from {path}: {error}. Point `model.tokenizer_path` (or `model.path`) "
            f"at a local {where} holding the target's tokenizer files (tokenizer.json and its config).",
            path=path,
        ) from None
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(
            f"The tokenizer at {path} is not a fast (Rust) tokenizer; the loss mask needs character offsets. "
            "Provide a tokenizer.json next to the tokenizer config.",
            path=path,
        )
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"The tokenizer at {path} has no chat template; training rows must be rendered with the target's "
            "own template. Point `model.tokenizer_path` at the target model's tokenizer.",
            path=path,
        )
    return tokenizer


def render_conversation(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    enable_thinking: bool | None,
) -> str:
    """Render messages with the tokenizer's chat template, as text.

    Args:
        tokenizer: A tokenizer with a chat template.
        messages: Chat-template message dicts.
        tools: Tool schemas, or None.
        add_generation_prompt: Append the assistant turn opener.
        enable_thinking: Passed to the template when set (Qwen3 switch); left out otherwise.

    Returns:
        The rendered text.

    Raises:
        TokenizeError: The template failed to render these messages.

    """
    extra: dict[str, Any] = {}
    if enable_thinking is not None:
        extra["enable_thinking"] = enable_thinking
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **extra,
        )
    except (
        Exception
    ) as error:  # jinja raises many types (TemplateError, TypeError, ...): all mean "cannot render"
        raise TokenizeError(f"The chat template failed to render the conversation: {error}") from error
    if not isinstance(text, str):
        raise TokenizeError(f"The chat template returned {type(text).__name__}, expected text")
    return text


def assistant_message(record: CompletionRecord) -> Message:
    """The assistant turn the completion adds to the conversation."""
    completion = record.completion
    return Message(
        role="assistant",
        content=completion.content,
        reasoning_content=completion.reasoning_content,
        tool_calls=completion.tool_calls,
    )


def tokenize_completion(
    tokenizer: Any, record: CompletionRecord, *, max_length_tokens: int | None
) -> TokenizedRow | RejectedRow:
    """Render and tokenize one completion with its loss mask (see the module docstring for the rule).

    Args:
        tokenizer: The target's fast tokenizer (:func:`load_tokenizer`).
        record: The completion with its prompt messages and tools.
        max_length_tokens: Rows with more tokens are rejected (not raised); no limit when None.

    Returns:
        The row, or a :class:`RejectedRow` saying why it is not kept.

    Raises:
        TokenizeError: The template cannot render the conversation, or the prompt render is not a prefix of
            the full render (the template does not reproduce what was served).

    """
    prompt_messages = [message.to_chat_dict() for message in record.messages]
    thinking = record.sampling.enable_thinking
    prompt_text = render_conversation(
        tokenizer, prompt_messages, tools=record.tools, add_generation_prompt=True, enable_thinking=thinking
    )
    end_of_turn_id = _token_id(tokenizer, END_OF_TURN_TOKEN)
    ended_turn = record.finish_reason in ENDED_TURN_REASONS
    output_ids = record.completion.output_token_ids
    if output_ids is not None:
        input_ids, loss_mask = _exact_ids_row(tokenizer, prompt_text, output_ids, end_of_turn_id, ended_turn)
    else:
        full_messages = [*prompt_messages, assistant_message(record).to_chat_dict()]
        full_text = render_conversation(
            tokenizer,
            full_messages,
            tools=record.tools,
            add_generation_prompt=False,
            enable_thinking=thinking,
        )
        input_ids, loss_mask = _rendered_row(tokenizer, prompt_text, full_text, ended_turn, record)
    if max_length_tokens is not None and len(input_ids) > max_length_tokens:
        return RejectedRow(
            prompt_id=record.prompt_id,
            sample_index=record.sample_index,
            dataset=record.dataset,
            reason=REJECT_TOO_LONG,
            detail=f"{len(input_ids)} tokens > max_length_tokens {max_length_tokens}",
        )
    return TokenizedRow(
        prompt_id=record.prompt_id,
        sample_index=record.sample_index,
        dataset=record.dataset,
        input_ids=input_ids,
        loss_mask=loss_mask,
        num_tokens=len(input_ids),
        num_loss_tokens=sum(loss_mask),
        finish_reason=record.finish_reason,
    )


def _token_id(tokenizer: Any, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
        raise TokenizeError(
            f"The tokenizer has no {token} token; datagen renders Qwen-style chat turns ending with it. "
            "Check `model.tokenizer_path`."
        )
    return token_id


def _exact_ids_row(
    tokenizer: Any, prompt_text: str, output_ids: list[int], end_of_turn_id: int, ended_turn: bool
) -> tuple[list[int], list[int]]:
    prompt_ids: list[int] = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    generated = list(output_ids)
    if ended_turn and (not generated or generated[-1] != end_of_turn_id):
        generated.append(end_of_turn_id)
    return prompt_ids + generated, [0] * len(prompt_ids) + [1] * len(generated)


def _rendered_row(
    tokenizer: Any, prompt_text: str, full_text: str, ended_turn: bool, record: CompletionRecord
) -> tuple[list[int], list[int]]:
    if not full_text.startswith(prompt_text):
        raise TokenizeError(
            f"Completion {record.key} of {record.dataset}: the prompt render is not a prefix of the "
            "prompt+answer render, so the chat template does not reproduce what was served (check that "
            "`model.tokenizer_path` is the served model's tokenizer and that enable_thinking matches the "
            "generation). First difference at character "
            f"{_first_difference(prompt_text, full_text)}.",
            key=record.key,
        )
    boundary = len(prompt_text)
    turn_end = full_text.rfind(END_OF_TURN_TOKEN)
    if turn_end < boundary:
        raise TokenizeError(
            f"Completion {record.key}: the rendered assistant turn does not end with {END_OF_TURN_TOKEN}; "
            "datagen supports Qwen-style chat templates only.",
            key=record.key,
        )
    loss_end = turn_end + len(END_OF_TURN_TOKEN) if ended_turn else turn_end
    encoding = tokenizer(full_text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids: list[int] = list(encoding["input_ids"])
    loss_mask = [
        1 if start < loss_end and stop > boundary else 0 for start, stop in encoding["offset_mapping"]
    ]
    return input_ids, loss_mask


def _first_difference(first: str, second: str) -> int:
    for index, (a, b) in enumerate(zip(first, second, strict=False)):
        if a != b:
            return index
    return min(len(first), len(second))
