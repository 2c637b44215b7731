"""On-policy conversations (``multi_turn: on_policy``): chains of requests whose history is the target's own.

A prompt of an on-policy dataset holds a whole conversation without its final answer (as ``last_turn`` prepares
it). Its dataset's assistant turns only mark where the target answers: the first request holds the system
prompt and the first user turn; each answer the target writes becomes the assistant turn of the next request,
followed by the dataset's next user turn, until the conversation's user turns are used up. Each turn is one
request, keyed ``<prompt_id>/<sample_index>/<turn>``, and one stored record.

:class:`Conversation` is one chain, as a small state machine fed the results of its turns in order;
:class:`ConversationChains` are a shard's chains, what the shard hands the dispatcher as the ``follow`` of its
stream (:meth:`~datagen.generation.dispatcher.Dispatcher.submit_stream`): the moment a turn lands, the next
turn's request is admitted in its place, so many chains interleave and the fleet stays saturated. Pure: no I/O,
no threads; the shard stores what comes out.

Tool turns: where the dataset's assistant called tools and the dataset recorded their results, the target's
answer at that point must make the same calls (same names, equal arguments after parsing, in any order); then
the recorded results are spliced in after the target's calls (each ``tool_call_id`` the dataset gave one of its
calls now names the target's matching call) and the conversation goes on. A target that calls other tools, or
none, or calls a tool where the dataset's assistant answered, ends the conversation at its call.

A conversation ends early, and each of its turns not sent then gets a failure naming the turn and why, when a
turn:

- failed (its own failure is stored with its own kind): kind
  :attr:`~datagen.generation.failures.FailureKind.CONVERSATION_ENDED`;
- ended without finishing its answer (``finish_reason`` other than ``stop`` or ``tool_calls``: cut at
  ``max_tokens``, aborted): a truncated answer is no history the target would have had; ``conversation_ended``;
- made tool calls that are not the dataset's: kind :attr:`~datagen.generation.failures.FailureKind.TOOL_CALL_DIVERGED`.

A turn that ended unfinished (no live server, the dispatcher closed) stops its chain without a stored result:
the turns after it are handed back as unfinished too, and the shard's next attempt resumes the chain from its
last stored turn (:meth:`Conversation.replay`).

A retry round (``--retry-failed``) resumes the same way: a conversation whose failed turn may succeed when sent
again (:func:`~datagen.generation.failures.is_retryable`) is replayed through its turns stored in earlier rounds,
then sends that turn again and goes on with the turns its failure ended
(:func:`~datagen.generation.failures.retried_keys`); every other conversation is left as it is.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from datagen.conversation_turns import ConversationTurns, split_conversation
from datagen.generation.dispatch_state import GenerationResult
from datagen.generation.failures import FailureKind, error_type, is_unfinished
from datagen.generation.openai_chat import GenerationRequest, PromptTokens
from datagen.records import CompletionRecord, FailureRecord, Message, PromptRecord, SamplingParams, ToolCall

# Finish reasons after which the conversation may go on: the answer is whole.
CONTINUING_FINISH: Final = frozenset({"stop", "tool_calls"})


def _call_key(call: ToolCall) -> tuple[str, str]:
    """A call as compared: its name and its arguments as canonical JSON (key order and spacing ignored)."""
    return call.function.name, json.dumps(call.function.arguments, sort_keys=True, separators=(",", ":"))


def match_calls(target: list[ToolCall], dataset: list[ToolCall]) -> dict[int, int] | None:
    """Pair the target's tool calls with the dataset's: same names, equal arguments, in any order.

    Args:
        target: The calls the target made.
        dataset: The calls the dataset's assistant made at the same point.

    Returns:
        For each dataset call's position, the position of the target call it equals; None when the two sets of
        calls differ (or there are none).

    """
    if not dataset or len(target) != len(dataset):
        return None
    free: dict[tuple[str, str], list[int]] = {}
    for position, call in enumerate(target):
        free.setdefault(_call_key(call), []).append(position)
    pairs: dict[int, int] = {}
    for position, call in enumerate(dataset):
        candidates = free.get(_call_key(call))
        if not candidates:
            return None
        pairs[position] = candidates.pop(0)
    return pairs


def splice_results(segment: list[Message], target: list[ToolCall], dataset: list[ToolCall]) -> list[Message]:
    """The dataset's tool results, each ``tool_call_id`` naming the target's call it answers.

    Args:
        segment: The dataset's messages after its assistant's calls (tool results first).
        target: The target's calls.
        dataset: The dataset's calls; they equal ``target`` (:func:`match_calls`).

    Returns:
        The segment with the ids of the dataset's calls replaced by the ids of the target's matching calls
        (results without an id, or with one the dataset's calls do not have, are kept as they are).

    """
    pairs = match_calls(target, dataset) or {}
    ids = {
        call.id: target[pairs[position]].id
        for position, call in enumerate(dataset)
        if call.id is not None and position in pairs
    }
    spliced = []
    for message in segment:
        if message.role == "tool" and message.tool_call_id in ids:
            message = message.model_copy(update={"tool_call_id": ids[message.tool_call_id]})
        spliced.append(message)
    return spliced


def answer_message(record: CompletionRecord) -> Message:
    """The assistant turn the target wrote, as the next request's history holds it."""
    completion = record.completion
    return Message(
        role="assistant",
        content=completion.content,
        reasoning_content=completion.reasoning_content,
        tool_calls=completion.tool_calls,
    )


def turn_seed(sampling: SamplingParams, prompt_id: str, sample_index: int, turn: int) -> SamplingParams:
    """``sampling`` with the seed of one turn, derived like a single request's plus the turn (None stays None)."""
    return sampling.seeded_for(prompt_id, sample_index, turn)


@dataclass
class Step:
    """What follows a turn's result: results to hand on for turns never sent, and the next turn's request."""

    ended: list[FailureRecord] = field(default_factory=list)
    request: GenerationRequest | None = None


@dataclass
class Conversation:
    """One on-policy conversation of one sample of a prompt: its turns, answered in order.

    Attributes:
        prompt: The prompt (the whole conversation without its final answer).
        sample_index: Which sample of the prompt (each sample is a conversation of its own).
        sampling: The prompt's sampling (its mix setting applied; seeds are derived per turn).
        sampling_setting: The name of its mix setting, None without a mix.
        dataset: The dataset's name.

    """

    prompt: PromptRecord
    sample_index: int
    sampling: SamplingParams
    sampling_setting: str | None
    dataset: str
    cut: ConversationTurns = field(init=False)
    # The target's answers so far, as assistant messages; their number is the next turn.
    answers: list[Message] = field(default_factory=list, init=False)
    # What follows each answer in the next request: the dataset's segment, tool results spliced.
    followers: list[list[Message]] = field(default_factory=list, init=False)
    # Set once the conversation ended (every planned turn has a result, or the rest are unfinished).
    over: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.cut = split_conversation(self.prompt.messages)

    @property
    def turns(self) -> int:
        """Turns planned: one per answer the target writes (to a user turn, or after a tool's result)."""
        return self.cut.turns

    @property
    def next_turn(self) -> int:
        """The turn the next request is for."""
        return len(self.answers)

    def key(self, turn: int) -> str:
        """The request key of one turn."""
        return f"{self.prompt.prompt_id}/{self.sample_index}/{turn}"

    def turn_keys(self) -> list[str]:
        """Every planned turn's key, in order."""
        return [self.key(turn) for turn in range(self.turns)]

    def history(self, turn: int) -> list[Message]:
        """The messages of ``turn``'s request: the head, then each earlier answer of the target and the next user turn."""
        messages = list(self.cut.head)
        for answer, segment in zip(self.answers[:turn], self.followers[:turn], strict=True):
            messages.append(answer)
            messages.extend(segment)
        return messages

    def request(self) -> GenerationRequest:
        """The request of the next turn."""
        turn = self.next_turn
        prompt = self.prompt.model_copy(update={"messages": self.history(turn)})
        return GenerationRequest(
            prompt=prompt,
            sample_index=self.sample_index,
            sampling=turn_seed(self.sampling, self.prompt.prompt_id, self.sample_index, turn),
            sampling_setting=self.sampling_setting,
            turn=turn,
            dataset=self.dataset,
        )

    def advance(self, result: GenerationResult) -> Step:
        """Take the result of the next turn; say what follows.

        Args:
            result: The result of turn :attr:`next_turn` (a completion, a failure, or an unfinished failure).

        Returns:
            The next turn's request while the conversation goes on; else the turns never sent, each as a
            ``conversation_ended`` or ``tool_call_diverged`` failure (as unfinished failures of the same kind
            when the turn was unfinished: they are sent again with it).

        Raises:
            ValueError: The result is not the next turn's.

        """
        turn = self.next_turn
        if result.key != self.key(turn):
            raise ValueError(f"conversation {self.key(turn)} got the result of {result.key}")
        if isinstance(result, CompletionRecord):
            self.answers.append(answer_message(result))
            if self.next_turn >= self.turns:
                self.over = True
                return Step()
            if result.finish_reason not in CONTINUING_FINISH:
                return self._end(f"turn {turn} ended with finish_reason {result.finish_reason}", turn + 1)
            segment, diverged = self._follower(turn, result.completion.tool_calls or [])
            if diverged is not None:
                return self._end(diverged, turn + 1, kind=error_type(FailureKind.TOOL_CALL_DIVERGED))
            self.followers.append(segment)
            return Step(request=self.request())
        if is_unfinished(result):
            return self._end(result.reason, turn + 1, kind=result.error_type)
        return self._end(f"turn {turn} failed: {result.error_type}", turn + 1)

    def replay(self, stored: Mapping[str, GenerationResult]) -> Step:
        """Resume from the turns already stored: feed them in order, say what follows the last one.

        Args:
            stored: Results by request key (the shard's checkpoint parts); other conversations' are ignored.

        Returns:
            As :meth:`advance` for the last stored turn, except that results already stored are not handed on
            again; with no turn stored, the first turn's request.

        """
        step: Step | None = None
        while not self.over:
            result = stored.get(self.key(self.next_turn))
            if result is None:
                break
            step = self.advance(result)
            if step.request is None:
                self.over = True
                step.ended = [failure for failure in step.ended if failure.key not in stored]
                break
        return step if step is not None else Step(request=self.request())

    def _follower(self, turn: int, calls: list[ToolCall]) -> tuple[list[Message], str | None]:
        """What follows the target's answer of ``turn`` in the next request, or why the conversation ends there."""
        segment = self.cut.segments[turn]
        dataset = self.cut.dataset_calls[turn]
        if segment[0].role != "tool":
            if calls:
                return [], f"turn {turn} called {_names(calls)} where the dataset's assistant called no tool"
            return segment, None
        if match_calls(calls, dataset) is None:
            return (
                [],
                f"turn {turn} called {_names(calls) or 'no tool'} where the dataset called {_names(dataset)}",
            )
        return splice_results(segment, calls, dataset), None

    def _end(self, reason: str, first: int, *, kind: str | None = None) -> Step:
        """End the conversation: a failure for each turn from ``first`` on (unfinished ones when ``kind`` is)."""
        self.over = True
        stored = kind or error_type(FailureKind.CONVERSATION_ENDED)
        return Step(
            ended=[
                FailureRecord(
                    prompt_id=self.prompt.prompt_id,
                    sample_index=self.sample_index,
                    dataset=self.dataset,
                    reason=reason,
                    error_type=stored,
                    attempts=0,
                    turn=turn,
                )
                for turn in range(first, self.turns)
            ]
        )


def _names(calls: list[ToolCall]) -> str:
    return ", ".join(call.function.name for call in calls)


Deliver = Callable[[GenerationRequest, GenerationResult], None]
# Gives requests their rendered prompt's ids (exact-token mode: sglang_generate.attach_prompt_tokens), failing
# those the chat template cannot render.
# Its second argument: per request, the prompt tokens of the conversation's turn before (or None), whose ids of
# the shared history are reused.
Prepare = Callable[
    [list[GenerationRequest], list[PromptTokens | None] | None],
    tuple[list[GenerationRequest], list[FailureRecord]],
]


class ConversationChains:
    """A shard's on-policy conversations, resumed from storage and advanced as their turns land.

    In exact-token mode (``prepare``) each turn's prompt is rendered from its messages when the turn is built:
    a resumed turn in the shard's thread, a turn that follows one that landed on the dispatcher's loop thread
    (its history is known only then). A later turn's history holds the target's earlier answers as the chat
    template renders an assistant turn (content, and reasoning and tool calls where it keeps them), and its record
    keeps its own ``output_ids`` verbatim. A turn the template cannot render fails unsent
    (``unrenderable_prompt``) and ends its conversation like any failed turn.

    Args:
        conversations: Every conversation of the shard (each prompt times its samples), in prompt order.
        prepare: Renders turns' prompts into ids (exact-token mode); None sends messages (chat completions).

    """

    def __init__(self, conversations: Iterable[Conversation], prepare: Prepare | None = None) -> None:
        self.conversations = list(conversations)
        self.prepare = prepare
        self._by_id = {(c.prompt.prompt_id, c.sample_index): c for c in self.conversations}

    def only(self, keys: Iterable[str]) -> ConversationChains:
        """The chains with a turn among ``keys`` (a retry round's), in the same order."""
        wanted = set(keys)
        return ConversationChains(
            (c for c in self.conversations if any(k in wanted for k in c.turn_keys())), self.prepare
        )

    def keys(self) -> list[str]:
        """Every planned turn's key, conversation by conversation."""
        return [key for conversation in self.conversations for key in conversation.turn_keys()]

    def resume(
        self, stored: Mapping[str, GenerationResult]
    ) -> tuple[list[GenerationRequest], list[FailureRecord]]:
        """Pick every conversation up after its last stored turn.

        Args:
            stored: The shard's results by request key.

        Returns:
            The next turn's request of each conversation still going, and the failures to store: the
            ``conversation_ended`` ones of turns a stored result ended but that have none yet, and (exact-token
            mode) those of turns the template cannot render, with the turns that ends.

        """
        requests: list[GenerationRequest] = []
        ended: list[FailureRecord] = []
        for conversation in self.conversations:
            step = conversation.replay(stored)
            ended.extend(step.ended)
            if step.request is not None:
                requests.append(step.request)
        ready, unsent = self._prepared(requests, [None] * len(requests))
        return ready, ended + unsent

    def _prepared(
        self, requests: list[GenerationRequest], previous: list[PromptTokens | None]
    ) -> tuple[list[GenerationRequest], list[FailureRecord]]:
        """``requests`` ready to send; a turn the template cannot render fails, ending its conversation."""
        if self.prepare is None or not requests:
            return requests, []
        ready, unrenderable = self.prepare(requests, previous)
        unsent: list[FailureRecord] = []
        for failure in unrenderable:
            unsent.append(failure)
            unsent.extend(self._by_id[(failure.prompt_id, failure.sample_index)].advance(failure).ended)
        return ready, unsent

    def follower(
        self, deliver: Deliver, broken: Callable[[BaseException], None]
    ) -> Callable[[GenerationRequest, GenerationResult], GenerationRequest | None]:
        """The ``follow`` of the shard's stream: advance the turn's conversation, hand on the turns it ended.

        Args:
            deliver: Where the results of turns never sent go (the shard's inbox), like the dispatcher's.
            broken: Told when building the next turn raised (a bug, not a turn's failure): the shard waiting for
                that conversation's turns must stop instead of waiting for results that will never come.

        Returns:
            A callable giving the next turn's request (None when the conversation is over); it runs on the
            dispatcher's loop thread, right after the turn's result was delivered.

        """

        def follow(request: GenerationRequest, result: GenerationResult) -> GenerationRequest | None:
            try:
                conversation = self._by_id[(request.prompt.prompt_id, request.sample_index)]
                step = conversation.advance(result)
                for failure in step.ended:
                    deliver(request, failure)
                if step.request is None:
                    return None
                ready, unsent = self._prepared([step.request], [request.prompt_tokens])
                for failure in unsent:
                    deliver(step.request, failure)
                return ready[0] if ready else None
            except Exception as error:
                broken(error)
                raise

        return follow
