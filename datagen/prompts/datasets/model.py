"""The two outcomes of normalising one dataset row: prompts to answer, or a counted rejection."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from datagen.records import Message

RejectionReason = Literal[
    "malformed",  # the row is not the documented layout (missing field, wrong type, unreadable line)
    "empty",  # no conversation, or the turn to answer is empty
    "unknown_role",  # a turn's role is none the format defines
    "bad_turn_order",  # e.g. a system message after the first turn, a tool result with no prompt
    "unparseable_tools",  # tool definitions present but not parseable
    "unparseable_tool_call",  # an assistant tool call whose body is neither JSON nor a Python dict
    "no_user_turn",  # nothing for the model to answer
    "wrong_language",  # the row's language is not in DatasetConfig.languages
    "too_long",  # the rendered prompt exceeds DatasetConfig.max_prompt_tokens
    "template_error",  # the target's chat template refused to render the prompt
    "duplicate",  # same normalised content as an earlier prompt of this run
    "in_existing_corpus",  # same normalised content as a prompt of the existing training corpus
    "over_cap",  # a valid prompt not drawn by the dataset's quota sample (max_prompts, share, caps)
]
REJECTION_REASONS: tuple[str, ...] = get_args(RejectionReason)


class NormalisedPrompt(BaseModel):
    """One prompt in neutral form: messages ending with the turn the model must answer, plus tools.

    Attributes:
        messages: System/user/assistant/tool messages; the last one is a user or tool turn.
        tools: Tool definitions in OpenAI form (``{"type": "function", "function": {...}}``), or None.
        source_index: The row number in the dataset (across all its files).
        turn_index: Which assistant turn of the row this prompt asks for (0-based; several with
            ``multi_turn: every_turn``).
        language: The row's natural language when the dataset records one (e.g. ``en``, ``zh-cn``).
        metadata: Small provenance facts from the row (source id, category, sub-dataset).

    """

    model_config = ConfigDict(extra="forbid")

    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    source_index: int = 0
    turn_index: int = 0
    language: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class Rejection(BaseModel):
    """A row (or one prompt of it) that was not used, with a reason from a fixed vocabulary.

    Attributes:
        reason: One of :data:`REJECTION_REASONS`.
        detail: A short human-readable explanation.
        source_index: The row number in the dataset.

    """

    model_config = ConfigDict(extra="forbid")

    reason: RejectionReason
    detail: str = ""
    source_index: int = 0


class RowRejected(Exception):
    """Raised inside a normaliser to reject the current row; never escapes :func:`normalise_row`."""

    def __init__(self, reason: RejectionReason, detail: str) -> None:
        super().__init__(detail)
        self.reason: RejectionReason = reason
        self.detail = detail
