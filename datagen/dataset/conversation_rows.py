r"""One training row per on-policy conversation (``tokenize.conversation_rows: per_conversation``).

An on-policy conversation is stored as one record per turn (``<prompt_id>/<sample_index>/<turn>``), and each
turn's request already holds the whole history: the target's earlier answers, the dataset's user turns and the
tool results spliced in after the target's calls. So the conversation's row is built from the record of its
last turn the merge keeps: the conversation rendered whole with the target's chat template, loss on every
assistant turn the target wrote and on nothing else.

Which turn the row ends on (:class:`ConversationGrouper`): the latest turn that passes the merge's screen. A
truncated last turn is kept with ``tokenize.include_truncated`` (no loss on the ``<|im_end|>`` the template
adds, as for any truncated row); otherwise it is dropped (counted ``truncated``) and the row ends at the turn
before it, whose answer ended. A turn that failed is not stored, so the row ends at the last stored turn.
Turns the row holds as history are counted as ``turns_in_conversation_rows``, never as dropped; when the row
itself is refused (``too_long``, ``template_mismatch``), every turn it would have held is counted under that
reason. The shard's writer stores a conversation's turns together and in order (one prompt shard holds the
whole conversation); a turn found after its conversation was closed, or out of order, is dropped as
``conversation_out_of_order`` rather than making a second row. A retry round (``--retry-failed``) stores the
turns it sent in a file of its own: there the conversation's row trains only those turns, its earlier turns
being history without loss (the earlier round's row trained them), so every stored turn is trained once.

Where the loss goes in the history (:func:`history_spans`): the Qwen3 templates re-render earlier assistant
turns their own way (reasoning before the last user query dropped, no empty think block), so a row holds what
the template renders of each earlier turn, and its loss covers that: for each earlier assistant turn, the
characters after its ``<|im_start|>assistant\n`` header (and after the template filler the generation prompt
pre-filled, e.g. Qwen3.6's ``<think>\n``, when the rendered turn starts with it) through its ``<|im_end|>``.
The turns are found in the render of the last turn's prompt, and the row is refused unless that render holds
exactly one assistant block per assistant message, each closed by ``<|im_end|>`` and holding the message's
text and tool names. The last turn's loss is the single-turn rule's (:mod:`datagen.dataset.tokenize`). A
token is trained on when its characters overlap any of these spans.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from datagen.errors import TokenizeError
from datagen.records import CompletionRecord, Message

logger = logging.getLogger(__name__)

ConversationRows = Literal["per_turn", "per_conversation"]
PER_TURN: ConversationRows = "per_turn"
PER_CONVERSATION: ConversationRows = "per_conversation"
DROP_OUT_OF_ORDER = "conversation_out_of_order"
TURN_START = "<|im_start|>"
ASSISTANT_HEADER = "<|im_start|>assistant\n"
END_OF_TURN = "<|im_end|>"


def history_spans(
    prompt_text: str, messages: list[Message], generation_prompt: str, key: str
) -> list[tuple[int, int]]:
    """Character spans of the earlier assistant turns in a turn's prompt render: what the target wrote of them.

    Args:
        prompt_text: The render of ``messages`` with the generation prompt (what the server saw).
        messages: The turn's request: the conversation so far.
        generation_prompt: What the template appends to open an assistant turn (header plus any filler).
        key: The record's key, for errors.

    Returns:
        ``(start, end)`` per assistant message in ``messages``, in order: after its header (and the filler,
        when the rendered turn starts with the whole generation prompt) through its ``<|im_end|>``.

    Raises:
        TokenizeError: The render does not hold exactly one closed assistant block per assistant message,
            each with the message's text and tool names (not a Qwen-style template, or text that imitates
            its markers).

    """
    answers = [message for message in messages if message.role == "assistant"]
    starts: list[int] = []
    found = prompt_text.find(ASSISTANT_HEADER)
    while found >= 0:
        starts.append(found)
        found = prompt_text.find(ASSISTANT_HEADER, found + len(ASSISTANT_HEADER))
    opened = len(prompt_text) - len(generation_prompt)
    if (
        not generation_prompt.startswith(ASSISTANT_HEADER)
        or not prompt_text.endswith(generation_prompt)
        or len(starts) != len(answers) + 1
        or starts[-1] != opened
    ):
        raise TokenizeError(
            f"Completion {key}: the prompt render does not hold one {ASSISTANT_HEADER!r} block per assistant "
            f"turn ({len(starts)} blocks for {len(answers)} earlier turns and the answer), so the conversation's "
            "turns cannot be located; per-conversation rows need a Qwen-style template (or set "
            "tokenize.conversation_rows: per_turn).",
            key=key,
        )
    spans: list[tuple[int, int]] = []
    for start, following, message in zip(starts, starts[1:], answers, strict=False):
        if prompt_text.startswith(generation_prompt, start):
            body = start + len(generation_prompt)
        else:
            body = start + len(ASSISTANT_HEADER)
        end = prompt_text.find(END_OF_TURN, body, following)
        block = prompt_text[body:end] if end >= 0 else ""
        expected = [(message.content or "").strip()]
        expected += [call.function.name for call in message.tool_calls or []]
        if end < 0 or TURN_START in block or not all(text in block for text in expected):
            raise TokenizeError(
                f"Completion {key}: the rendered assistant turn at character {start} is not closed by "
                f"{END_OF_TURN} before the next turn, or does not hold the turn's text and tool calls; the "
                "conversation's row is refused.",
                key=key,
            )
        spans.append((body, end + len(END_OF_TURN)))
    return spans


def token_spans(offsets: list[tuple[int, int]], regions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Token index ranges whose characters overlap each character region (the loss-mask overlap rule).

    Args:
        offsets: Each token's ``(start, end)`` characters, in order.
        regions: Disjoint character regions, in order.

    Returns:
        One ``[first, last + 1)`` per region holding the tokens that overlap it (empty when none do).

    """
    spans: list[tuple[int, int]] = []
    index = 0
    for start, end in regions:
        while index < len(offsets) and offsets[index][1] <= start:
            index += 1
        first = index
        while index < len(offsets) and offsets[index][0] < end:
            index += 1
        spans.append((first, index))
        # A token straddling two regions belongs to both: step back so the next region sees it too.
        index = max(first, index - 1)
    return spans


@dataclass(frozen=True)
class RowSource:
    """The completion a row is built from, and how many earlier turns of its conversation the row holds.

    Attributes:
        line: The completion's line in its shard (the row's source).
        record: The completion; for a conversation's row, its last kept turn, whose request holds the whole
            conversation before its answer.
        history_turns: Stored turns before it that the row holds as history (kept or screened out); 0 for
            every row that is not a whole conversation's.
        first_turn: The conversation's first turn in this file: the row trains the target's turns from it on.
            Turns before it were stored by an earlier retry round of the shard, in that round's own file and
            row, so here they are history without loss (every turn is trained once). 0 but in retry rounds.

    """

    line: int
    record: CompletionRecord
    history_turns: int
    first_turn: int = 0


@dataclass
class ConversationGrouper:
    """Streams a shard's on-policy turns, handing back each conversation's row turn once its turns are over.

    Holds one conversation at a time: the shard stores a conversation's turns together and in order.
    """

    dropped: Counter[str] = field(default_factory=Counter)
    # The conversation held: its key, its latest turn, the latest turn the screen kept, the turns before that one,
    # and the turns after it the screen dropped (by reason); then the conversations already closed.
    _key: tuple[str, str, int] | None = field(default=None, init=False)
    _first: int = field(default=0, init=False)
    _turn: int = field(default=-1, init=False)
    _kept: tuple[int, CompletionRecord] | None = field(default=None, init=False)
    _before: int = field(default=0, init=False)
    _after: Counter[str] = field(default_factory=Counter, init=False)
    _closed: set[tuple[str, str, int]] = field(default_factory=set, init=False)

    def add(self, line: int, record: CompletionRecord, drop_reason: str | None) -> RowSource | None:
        """Take one turn (``drop_reason``: why the screen drops it, None when kept).

        Returns:
            The previous conversation's row turn when this turn starts another conversation, else None.

        """
        key = (record.dataset, record.prompt_id, record.sample_index)
        turn = record.turn if record.turn is not None else 0
        finished: RowSource | None = None
        if key != self._key:
            if key in self._closed:
                self._out_of_order(record)
                return None
            finished = self.close()
            self._key, self._first = key, turn
        elif turn <= self._turn:
            self._out_of_order(record)
            return None
        self._turn = turn
        if drop_reason is not None:
            self._after[drop_reason] += 1
        else:
            if self._kept is not None:
                self._before += 1 + sum(self._after.values())
                self._after.clear()
            self._kept = (line, record)
        return finished

    def close(self) -> RowSource | None:
        """End the conversation held: its row turn (None when the screen dropped every turn)."""
        if self._key is not None:
            self._closed.add(self._key)
        self.dropped.update(self._after)
        row = (
            None if self._kept is None else RowSource(self._kept[0], self._kept[1], self._before, self._first)
        )
        self._key, self._first, self._turn, self._kept, self._before = None, 0, -1, None, 0
        self._after = Counter()
        return row

    def _out_of_order(self, record: CompletionRecord) -> None:
        self.dropped[DROP_OUT_OF_ORDER] += 1
        logger.warning(
            "on-policy turn out of its conversation's order, dropped key=%s (a shard written by datagen holds "
            "each conversation's turns together and in order)",
            record.key,
        )
