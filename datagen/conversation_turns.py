"""Where the target answers in an on-policy conversation (``multi_turn: on_policy``): a prompt's cut into turns.

Shared because two stages need the same cut: generation sends one request per turn
(:mod:`datagen.generation.conversation`), and the prompts' inspection and the cost preview count those requests
before anything is sent. One cut, so the preview prices exactly the turns a run sends.
"""

from __future__ import annotations

from dataclasses import dataclass

from datagen.records import Message, ToolCall


@dataclass(frozen=True)
class ConversationTurns:
    """A prompt's conversation cut where the target answers.

    Attributes:
        head: The messages before the first assistant turn (system prompt, first user turn).
        segments: For each turn after the first, the dataset's messages between the assistant turn before it and
            it: a user turn, or the results of the tools that assistant turn called.
        dataset_calls: For each segment, the tool calls of the dataset's assistant turn before it (empty when
            it called none).

    """

    head: list[Message]
    segments: list[list[Message]]
    dataset_calls: list[list[ToolCall]]

    @property
    def turns(self) -> int:
        """Turns (requests) of one conversation: one per answer the target writes."""
        return 1 + len(self.segments)


def split_conversation(messages: list[Message]) -> ConversationTurns:
    """Cut a prompt's messages where the target answers.

    Args:
        messages: The conversation without its final answer (a prompt's ``messages``).

    Returns:
        The head, the segments between the dataset's assistant turns, and those turns' tool calls.

    """
    head: list[Message] = []
    segments: list[list[Message]] = []
    calls: list[list[ToolCall]] = []
    current = head
    answer_calls: list[ToolCall] = []
    previous_role: str | None = None
    for message in messages:
        if message.role == "assistant":
            if previous_role != "assistant":
                answer_calls = []
            answer_calls.extend(message.tool_calls or [])
            previous_role = message.role
            continue
        if previous_role == "assistant":
            current = []
            segments.append(current)
            calls.append(answer_calls)
        current.append(message)
        previous_role = message.role
    return ConversationTurns(head, segments, calls)
