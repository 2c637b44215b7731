"""Cut a normalised conversation into prompts, one per assistant turn to regenerate.

Every format turns a row into a list of :class:`Turn` (a role plus a lazy conversion to messages, so a
turn that is dropped, such as the final answer, is never parsed and cannot reject the row). This module
applies the multi-turn policy and the checks every prompt must pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from datagen.config import MultiTurnPolicy
from datagen.prompts.datasets.model import NormalisedPrompt, RowRejected
from datagen.records import Message, Role

# `from` values of ShareGPT-style turns, lower-cased, and the neutral role each one means.
SHAREGPT_ROLES: Mapping[str, Role] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "function_response": "tool",
    "ipython": "tool",
}
# OpenAI-style `role` values and the neutral role each one means.
OPENAI_ROLES: Mapping[str, Role] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
    "ipython": "tool",
}


Converter = Callable[[], list[Message]]


@dataclass(frozen=True)
class Turn:
    """One turn of a conversation: its neutral role and how to turn it into messages."""

    role: Role
    convert: Converter


def map_role(value: Any, table: Mapping[str, Role]) -> Role:
    """The neutral role of a dataset's role name.

    Raises:
        RowRejected: The name is not a string or not in ``table`` (reason ``unknown_role``).

    """
    if not isinstance(value, str):
        raise RowRejected("malformed", f"a turn's role is a {type(value).__name__}, not a string")
    role = table.get(value.strip().lower())
    if role is None:
        raise RowRejected("unknown_role", f"unknown role {value[:40]!r}")
    return role


def require_text(value: Any, what: str) -> str:
    """``value`` when it is a string.

    Raises:
        RowRejected: It is missing or not a string (reason ``malformed``).

    """
    if value is None:
        raise RowRejected("malformed", f"{what} is missing")
    if not isinstance(value, str):
        raise RowRejected("malformed", f"{what} is a {type(value).__name__}, not a string")
    return value


def require_list(value: Any, what: str) -> list[Any]:
    """``value`` when it is a list (a JSON string of a list is decoded).

    Raises:
        RowRejected: It is missing or not a list (reason ``malformed``, or ``empty`` for an empty list).

    """
    if value is None:
        raise RowRejected("malformed", f"{what} is missing")
    if not isinstance(value, list | tuple):
        raise RowRejected("malformed", f"{what} is a {type(value).__name__}, not a list")
    if not value:
        raise RowRejected("empty", f"{what} is empty")
    return list(value)


def require_objects(value: Any, what: str, item: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """The items of the list ``value`` with their positions, each checked to be an object as it comes.

    Raises:
        RowRejected: As :func:`require_list`, or an item is not an object (``malformed``, naming ``item``
            and its position).

    """
    for position, entry in enumerate(require_list(value, what)):
        if not isinstance(entry, dict):
            raise RowRejected("malformed", f"{item} {position} is a {type(entry).__name__}, not an object")
        yield position, entry


def require_row(row: Any) -> dict[str, Any]:
    """``row`` when it is an object.

    Raises:
        RowRejected: It is not (reason ``malformed``).

    """
    if not isinstance(row, dict):
        raise RowRejected("malformed", f"the row is a {type(row).__name__}, not an object")
    return row


def source_id(row: dict[str, Any]) -> str | None:
    """The row's ``id`` as a string (ints in some copies of a dataset, hex strings in others), or None."""
    value = row.get("id")
    return None if value is None else str(value)


def language_tag(value: Any) -> str | None:
    """A row's language field, stripped and lower-cased; None when it is not a non-blank string."""
    return value.strip().lower() if isinstance(value, str) and value.strip() else None


def text_turn(role: Role, text: str) -> Turn:
    """A turn holding plain text."""
    return Turn(role, lambda: [Message(role=role, content=text)])


def _answer_starts(roles: list[Role]) -> list[int]:
    """The first index of each run of consecutive assistant turns (one answer may span several)."""
    return [
        i for i, role in enumerate(roles) if role == "assistant" and (i == 0 or roles[i - 1] != "assistant")
    ]


def _cut_points(roles: list[Role], policy: MultiTurnPolicy) -> list[int]:
    """Where prompts end: before each answer (and after the last turn if it is no answer)."""
    starts = _answer_starts(roles)
    if roles[-1] != "assistant":
        starts.append(len(roles))
    if policy in ("last_turn", "on_policy"):
        # on_policy: the whole conversation is one prompt; generation answers its user turns one by one
        # (datagen.generation.conversation), so its own assistant turns only mark where the target answers.
        return starts[-1:]
    return starts


def build_prompts(
    turns: list[Turn],
    *,
    policy: MultiTurnPolicy,
    tools: list[dict[str, Any]] | None = None,
    source_index: int = 0,
    language: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> list[NormalisedPrompt]:
    """Apply the multi-turn policy to a conversation and check every resulting prompt.

    Args:
        turns: The whole conversation, final answer included.
        policy: ``last_turn`` (one prompt answering the last assistant turn), ``every_turn`` (one per
            assistant turn), or ``on_policy`` (one prompt holding the conversation, cut as ``last_turn``: each of
            its user turns is answered in generation, after the target's own earlier answers).
        tools: The row's tool definitions.
        source_index: The row number.
        language: The row's language, if it records one.
        metadata: Provenance facts to carry.

    Returns:
        At least one prompt.

    Raises:
        RowRejected: No usable prompt (no turns, nothing asked by a user, an empty question, a system
            message after the first turn).

    """
    if not turns:
        raise RowRejected("empty", "the conversation has no turns")
    roles = [turn.role for turn in turns]
    cuts = [cut for cut in _cut_points(roles, policy) if "user" in roles[:cut]]
    if not cuts:
        raise RowRejected("no_user_turn", "no assistant turn follows a user turn")
    # Convert only the turns some prompt keeps: a dropped final answer is never parsed.
    converted: list[list[Message]] = [turn.convert() for turn in turns[: max(cuts)]]
    ends: list[int] = []
    total = 0
    for messages in converted:
        total += len(messages)
        ends.append(total)
    flat = [message for messages in converted for message in messages]
    answer_starts = _answer_starts(roles)
    prompts: list[NormalisedPrompt] = []
    for cut in cuts:
        messages = flat[: ends[cut - 1]]
        _check_prompt(messages)
        prompts.append(
            NormalisedPrompt(
                messages=messages,
                tools=tools,
                source_index=source_index,
                turn_index=sum(1 for start in answer_starts if start < cut),
                language=language,
                metadata=dict(metadata or {}),
            )
        )
    return prompts


def prompts_with_id(
    conversation: list[Turn],
    row: dict[str, Any],
    *,
    policy: MultiTurnPolicy,
    source_index: int,
    tools: list[dict[str, Any]] | None = None,
    language: str | None = None,
) -> list[NormalisedPrompt]:
    """:func:`build_prompts` for a row whose only provenance is its ``id`` (kept as ``source_id``)."""
    return build_prompts(
        conversation,
        policy=policy,
        tools=tools,
        source_index=source_index,
        language=language,
        metadata={"source_id": source_id(row)},
    )


def _check_prompt(messages: list[Message]) -> None:
    if any(message.role == "system" for message in messages[1:]):
        raise RowRejected("bad_turn_order", "a system message follows the first turn")
    last = messages[-1]
    if last.role not in ("user", "tool"):
        raise RowRejected("bad_turn_order", f"the prompt ends with a {last.role} turn")
    if last.role == "user" and not (last.content or "").strip():
        raise RowRejected("empty", "the user turn to answer is empty")
    if last.role == "tool" and not any(message.role == "user" for message in messages):
        raise RowRejected("no_user_turn", "a tool result with no user request before it")
