"""Turn completions into training rows: token ids of the whole conversation plus a loss mask.

Loss-mask rule (text path), the one every path reproduces exactly: the target's chat template renders the
prompt with the generation prompt appended (what the server saw) and the prompt followed by the generated
assistant turn; the prompt render must be a prefix of the full render (otherwise the template does not
reproduce what was served and the row is refused). The loss region is the characters of the full render from
the end of the prompt render through the assistant turn's closing ``<|im_end|>`` inclusive, and a token of the
full render is trained on (mask 1) exactly when its characters overlap that region. So a token that BPE merged
across the prompt/answer boundary counts as generated, while the prompt, system text, tools, tool results,
template filler pre-filled in the prompt (such as the empty think block of non-thinking mode) and the newline
after ``<|im_end|>`` never are. A truncated completion (finish reason ``length``) did not end its turn, so the
closing ``<|im_end|>`` the template adds is not trained on either.

How it is computed without character offsets: the fast tokenizer splits text on added tokens (``<|im_start|>``,
``<think>``...) before anything else, so the token ids of ``prompt + answer`` are the ids of the prompt up to
its last added token ("head") followed by the ids of the rest of the prompt ("tail", e.g. a newline after
``<think>``) plus the answer, tokenized together. Only that window is tokenized per row; the head's ids come
from the prompt, tokenized once per prompt and shared by its samples. When the window's first ids equal the
tail's own ids, the answer starts on a token boundary and the mask starts right after the tail; otherwise (BPE
merged the tail with the answer's first characters, rare) the window's character offsets from the Rust tokenizer
decide by the overlap rule above. The mask ends at the last ``<|im_end|>`` id. Both cases equal the overlap rule
on the full render; the tests check it against full-render offsets. The ids come from
:class:`~datagen.dataset.tokenize_text.TextEncoder`: exactly the Rust tokenizer's ids, several times faster.

Exact-ids path: when the engine returned the generated token ids, the row is the tokenized prompt render
followed by those ids (plus ``<|im_end|>`` when generation stopped but the ids end on no stop token), and the
mask is 1 exactly on the generated ids. Each row records which path made it (``text`` or ``ids``).

Whole on-policy conversations (``encode(..., whole_conversations=True)``): the last turn's record renders the
whole conversation; the same rule holds for its answer, and the earlier assistant turns add loss spans
(:mod:`datagen.dataset.conversation_rows`). Those rows are tokenized whole, with character offsets, from the
text (an earlier turn has no ids of its own in the record).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from datagen.dataset.conversation_rows import history_spans, token_spans
from datagen.dataset.tokenize_text import TextEncoder
from datagen.dataset.tokenizer import TokenizerSpec, render_prompt
from datagen.errors import TokenizeError
from datagen.records import (
    AssistantCompletion,
    CompletionRecord,
    FunctionCall,
    Message,
    SamplingParams,
    TokenUsage,
    ToolCall,
)

logger = logging.getLogger(__name__)

END_OF_TURN_TOKEN = "<|im_end|>"
END_OF_TEXT_TOKEN = "<|endoftext|>"
# Finish reasons meaning the model emitted its end-of-turn token itself.
ENDED_TURN_REASONS = frozenset({"stop", "tool_calls"})
REJECT_TOO_LONG = "too_long"
TokenizedFrom = Literal["text", "ids"]
TOKENIZED_FROM_TEXT: TokenizedFrom = "text"
TOKENIZED_FROM_IDS: TokenizedFrom = "ids"
# Prompt renders kept for the samples that follow: samples of one prompt sit next to each other in a shard,
# so a few thousand entries cover any realistic samples_per_prompt while bounding memory (~2 KB each).
PROMPT_CACHE_ENTRIES = 4096
AnswerRender = Literal["auto", "full"]
# The fixed context the answer is rendered after when the template appends turns (see RowTokenizer).
ANSWER_CONTEXT = [Message(role="user", content="?")]
_PROBE_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string"}},
                "required": ["word"],
            },
        },
    }
]
_PROBE_CALLS = [
    ToolCall(id="c1", function=FunctionCall(name="lookup", arguments={"word": "drafter"})),
    ToolCall(id="c2", function=FunctionCall(name="lookup", arguments={"word": "target", "n": [1, 2]})),
]
# Conversations on which the answer rendered alone must equal the full render's answer, or the template
# renders every conversation in full: system prompts, tools, earlier reasoning, tool responses (merged),
# parallel tool calls, answers with and without reasoning, content or calls.
APPEND_PROBES: list[tuple[list[Message], list[dict[str, Any]] | None, AssistantCompletion]] = [
    (
        [Message(role="user", content="Hi there.")],
        None,
        AssistantCompletion(content="\nHello!\n", reasoning_content="\nGreet back.\n"),
    ),
    (
        [Message(role="system", content="Be brief."), Message(role="user", content="2+2?")],
        None,
        AssistantCompletion(content="4"),
    ),
    (
        [
            Message(role="system", content="Use tools."),
            Message(role="user", content="Define drafter."),
            Message(role="assistant", content="", reasoning_content="Look it up.", tool_calls=_PROBE_CALLS),
            Message(role="tool", content="a small model", tool_call_id="c1"),
            Message(role="tool", content="the big model", tool_call_id="c2"),
        ],
        _PROBE_TOOLS,
        AssistantCompletion(content="A drafter is a small model.", reasoning_content="Both answered."),
    ),
    (
        [
            Message(role="user", content="First question."),
            Message(role="assistant", content="First answer.", reasoning_content="Old thoughts."),
            Message(role="user", content="Look up two words."),
        ],
        _PROBE_TOOLS,
        AssistantCompletion(content="Looking.", reasoning_content="Two calls.", tool_calls=_PROBE_CALLS),
    ),
    (
        [Message(role="user", content="Call it.")],
        _PROBE_TOOLS,
        AssistantCompletion(content=None, tool_calls=_PROBE_CALLS[:1]),
    ),
]


class TokenizedRow(BaseModel):
    """One training row: the rendered conversation's token ids and which of them carry loss.

    Attributes:
        input_ids: Token ids of the whole conversation (prompt + assistant turn).
        loss_mask: 1 on the generated tokens (through ``<|im_end|>``), 0 elsewhere; same length.
        num_tokens: ``len(input_ids)``.
        num_loss_tokens: ``sum(loss_mask)``.
        tokenized_from: ``text`` (rendered text re-tokenized) or ``ids`` (the engine's exact output ids).

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
    tokenized_from: TokenizedFrom = TOKENIZED_FROM_TEXT


class RejectedRow(BaseModel):
    """A completion that renders fine but is not kept as a row (e.g. too long); counted, never raised."""

    model_config = ConfigDict(extra="forbid")

    prompt_id: str
    sample_index: int
    dataset: str
    reason: Literal["too_long"]
    detail: str


@dataclass(frozen=True)
class EncodedRow:
    """A row in the compact form the merge writes: ids plus the runs of loss tokens.

    Attributes:
        input_ids: Token ids of the whole conversation.
        loss_start: Index of the first trained-on token of the answer.
        loss_end: One past the answer's last trained-on token (the mask is 1 on ``[loss_start, loss_end)``).
        tokenized_from: ``text`` or ``ids``.
        history_spans: ``[start, end)`` token ranges of the earlier assistant turns a per-conversation row
            also trains on, in order, all before ``loss_start`` (empty for every other row).

    """

    input_ids: list[int]
    loss_start: int
    loss_end: int
    tokenized_from: TokenizedFrom
    history_spans: tuple[tuple[int, int], ...] = ()

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Every run of loss tokens, in order: the history's, then the answer's."""
        return [*self.history_spans, (self.loss_start, self.loss_end)]

    @property
    def loss_tokens(self) -> int:
        """Tokens the loss counts."""
        return sum(end - start for start, end in self.spans)

    def loss_mask(self) -> list[int]:
        """The mask as a list of 0/1, one per token."""
        mask = [0] * len(self.input_ids)
        for start, end in self.spans:
            mask[start:end] = [1] * (end - start)
        return mask


@dataclass(frozen=True)
class _Prompt:
    """One prompt render and its tokenization, split at its last added token, and what it was rendered from."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None
    text: str
    ids: list[int]
    head_ids: list[int]
    tail_text: str
    tail_ids: list[int]


def assistant_message(record: CompletionRecord) -> Message:
    """The assistant turn the completion adds to the conversation."""
    completion = record.completion
    return Message(
        role="assistant",
        content=completion.content,
        reasoning_content=completion.reasoning_content,
        tool_calls=completion.tool_calls,
    )


class RowTokenizer:
    """Tokenizes completions in batches with the loss-mask rule of this module.

    One instance per process: it caches prompt renders (shared by the samples of a prompt) and calls the
    Rust tokenizer once per batch.

    Args:
        spec: The target tokenizer's spec (:meth:`TokenizerSpec.from_tokenizer`).
        max_length_tokens: Rows with more tokens are rejected (not raised); no limit when None.
        answer_render: ``auto``: render the generated turn alone (after a tiny fixed context) when the
            template passes the append probe (:data:`APPEND_PROBES`), else the whole conversation again;
            ``full``: always render the whole conversation again.

    Raises:
        TokenizeError: The tokenizer has no ``<|im_end|>`` token.

    """

    def __init__(
        self, spec: TokenizerSpec, *, max_length_tokens: int | None, answer_render: AnswerRender = "auto"
    ) -> None:
        self.spec = spec
        self.backend = spec.backend()
        self.text = TextEncoder(self.backend)
        self.max_length_tokens = max_length_tokens
        self.end_of_turn_id = _token_id(self.backend, END_OF_TURN_TOKEN)
        # Tokens an exact-token answer may end on when the model stopped by itself: the end of turn, or the
        # end-of-text / EOS token the server also stops on. None of them is followed by an invented <|im_end|>.
        stop_tokens = {END_OF_TURN_TOKEN, END_OF_TEXT_TOKEN, spec.special_tokens.get("eos_token", "")}
        self.stop_ids = frozenset(
            token_id for token_id in map(self.backend.token_to_id, stop_tokens - {""}) if token_id is not None
        )
        self._added_ids = frozenset(int(token_id) for token_id in self.backend.get_added_tokens_decoder())
        self._prompts: OrderedDict[tuple[str, str, bool | None], _Prompt] = OrderedDict()
        self._turns: dict[bool | None, tuple[str, str] | None] = {}
        self.renders_answer_alone = answer_render == "auto" and self._template_appends_turns()
        logger.debug("row tokenizer renders_answer_alone=%s", self.renders_answer_alone)

    def encode(
        self, records: list[CompletionRecord], *, whole_conversations: list[int] | None = None
    ) -> list[EncodedRow | RejectedRow | TokenizeError]:
        """Tokenize a batch of completions; one result per record, in order.

        Args:
            records: Completions to turn into rows.
            whole_conversations: When given, per record, the first turn its row trains: an on-policy turn
                (``turn`` set) after earlier answers becomes its whole conversation's row, with loss on every
                assistant turn from that one on (:mod:`datagen.dataset.conversation_rows`).

        Returns:
            Per record: the row, a :class:`RejectedRow` (too long), or the :class:`TokenizeError` saying why
            the template cannot render or reproduce it (returned, not raised, so one odd record does not
            sink a batch).

        """
        results: list[EncodedRow | RejectedRow | TokenizeError | None] = [None] * len(records)
        windows: list[str] = []
        pending: list[tuple[int, _Prompt]] = []
        for position, record in enumerate(records):
            try:
                prompt = self._prompt(record)
                if (
                    whole_conversations is not None
                    and record.turn is not None
                    and _has_history(record.messages)
                ):
                    row = self._conversation_row(record, prompt, whole_conversations[position])
                    results[position] = self._finish(record, row)
                    continue
                output_ids = record.completion.output_token_ids
                if output_ids is not None:
                    results[position] = self._finish(record, self._ids_row(record, prompt, output_ids))
                    continue
                windows.append(prompt.tail_text + self._answer_text(record, prompt))
                pending.append((position, prompt))
            except TokenizeError as error:
                results[position] = error
        if windows:
            encoded = self.text.encode_batch(windows)
            for (position, prompt), window, ids in zip(pending, windows, encoded, strict=True):
                record = records[position]
                try:
                    results[position] = self._finish(record, self._text_row(record, prompt, window, ids))
                except TokenizeError as error:
                    results[position] = error
        return [result for result in results if result is not None]

    def _prompt(self, record: CompletionRecord) -> _Prompt:
        """The prompt render of ``record`` (with the generation prompt), tokenized; cached per prompt."""
        thinking = record.sampling.enable_thinking
        key = (record.dataset, record.prompt_id, thinking)
        cached = self._prompts.get(key)
        # Prompt ids are content hashes, but the cache must never be the reason a row is wrong: compare.
        if cached is not None and cached.messages == record.messages and cached.tools == record.tools:
            self._prompts.move_to_end(key)
            return cached
        text = render_prompt(self.spec, record.messages, record.tools, thinking)
        ids = self.text.encode(text)
        split = len(ids)
        while split > 0 and ids[split - 1] not in self._added_ids:
            split -= 1
        if self.text.fast:
            tail_start = self.text.last_added_end(text)
        else:
            offsets = self.backend.encode(text, add_special_tokens=False).offsets
            tail_start = offsets[split - 1][1] if split else 0
        prompt = _Prompt(
            record.messages, record.tools, text, ids, ids[:split], text[tail_start:], ids[split:]
        )
        self._prompts[key] = prompt
        if len(self._prompts) > PROMPT_CACHE_ENTRIES:
            self._prompts.popitem(last=False)
        return prompt

    def _answer_text(self, record: CompletionRecord, prompt: _Prompt) -> str:
        """The characters the full render adds after the prompt render."""
        if self.renders_answer_alone and _has_user_query(record.messages):
            answer = self._answer_alone(record, prompt)
            if answer is not None:
                return answer
        return self._answer_from_full_render(record, prompt)

    def _turn_context(self, thinking: bool | None) -> tuple[str, str] | None:
        """The fixed context's render without and with the generation prompt, per thinking switch."""
        if thinking not in self._turns:
            context = [message.to_chat_dict() for message in ANSWER_CONTEXT]
            bare = self.spec.render(
                context, tools=None, add_generation_prompt=False, enable_thinking=thinking
            )
            opened = self.spec.render(
                context, tools=None, add_generation_prompt=True, enable_thinking=thinking
            )
            self._turns[thinking] = (bare, opened[len(bare) :]) if opened.startswith(bare) else None
        return self._turns[thinking]

    def _answer_alone(self, record: CompletionRecord, prompt: _Prompt) -> str | None:
        """The answer's characters from rendering it after the fixed context, or None to render in full."""
        thinking = record.sampling.enable_thinking
        context = self._turn_context(thinking)
        if context is None:
            return None
        bare, generation_prompt = context
        if not prompt.text.endswith(generation_prompt):
            return None
        turn = self.spec.render(
            [
                *(message.to_chat_dict() for message in ANSWER_CONTEXT),
                assistant_message(record).to_chat_dict(),
            ],
            tools=None,
            add_generation_prompt=False,
            enable_thinking=thinking,
        )
        if not turn.startswith(bare + generation_prompt):
            return None  # the full render explains the mismatch (or proves it is fine)
        return turn[len(bare) + len(generation_prompt) :]

    def _template_appends_turns(self) -> bool:
        """Tell whether, on every probe, the full render equals the prompt render plus the answer alone."""
        for index, (messages, tools, answer) in enumerate(APPEND_PROBES):
            for thinking in (None, True, False):
                if thinking is False and answer.reasoning_content:
                    continue
                record = _probe_record(index, messages, tools, answer, thinking)
                try:
                    prompt = self._prompt(record)
                    alone = self._answer_alone(record, prompt)
                    full = self._answer_from_full_render(record, prompt)
                except TokenizeError:
                    return False
                if alone != full:
                    logger.info("chat template fails the append probe; rendering every conversation in full")
                    return False
        self._prompts.clear()
        return True

    def _answer_from_full_render(self, record: CompletionRecord, prompt: _Prompt) -> str:
        """The characters the full render adds after the prompt render, from rendering it."""
        full_messages = [
            *(message.to_chat_dict() for message in record.messages),
            assistant_message(record).to_chat_dict(),
        ]
        full_text = self.spec.render(
            full_messages,
            tools=record.tools,
            add_generation_prompt=False,
            enable_thinking=record.sampling.enable_thinking,
        )
        if not full_text.startswith(prompt.text):
            raise TokenizeError(
                f"Completion {record.key} of {record.dataset}: the prompt render is not a prefix of the "
                "prompt+answer render, so the chat template does not reproduce what was served (check that "
                "`model.tokenizer_path` is the served model's tokenizer and that enable_thinking matches the "
                "generation). First difference at character "
                f"{_first_difference(prompt.text, full_text)}.",
                key=record.key,
            )
        return full_text[len(prompt.text) :]

    def _text_row(self, record: CompletionRecord, prompt: _Prompt, window: str, ids: list[int]) -> EncodedRow:
        tail_ids = prompt.tail_ids
        if ids[: len(tail_ids)] == tail_ids:
            first = len(tail_ids)
        else:
            # BPE merged the end of the prompt with the answer (rare): the first token reaching into the answer
            # starts the loss (the overlap rule), found from the Rust tokenizer's character offsets.
            boundary = len(prompt.tail_text)
            offsets = self.backend.encode(window, add_special_tokens=False).offsets
            first = next(index for index, (_, stop) in enumerate(offsets) if stop > boundary)
        turn_end = _last_index(ids, self.end_of_turn_id, first)
        if turn_end < 0:
            raise TokenizeError(
                f"Completion {record.key}: the rendered assistant turn does not end with {END_OF_TURN_TOKEN}; "
                "datagen supports Qwen-style chat templates only.",
                key=record.key,
            )
        ended = record.finish_reason in ENDED_TURN_REASONS
        head = len(prompt.head_ids)
        return EncodedRow(
            prompt.head_ids + ids,
            head + first,
            head + turn_end + (1 if ended else 0),
            TOKENIZED_FROM_TEXT,
        )

    def _conversation_row(self, record: CompletionRecord, prompt: _Prompt, first_turn: int) -> EncodedRow:
        """The whole conversation's row: loss on the answer (the rule above) and the earlier assistant turns.

        Earlier turns before ``first_turn`` are history without loss (another row trains them).
        """
        context = self._turn_context(record.sampling.enable_thinking)
        if context is None:
            raise TokenizeError(
                f"Completion {record.key}: the chat template's generation prompt does not append to the "
                "conversation, so its turns cannot be located; set tokenize.conversation_rows: per_turn.",
                key=record.key,
            )
        regions = history_spans(prompt.text, record.messages, context[1], record.key)[first_turn:]
        full = prompt.text + self._answer_text(record, prompt)
        turn_end = full.rfind(END_OF_TURN_TOKEN)
        if turn_end < len(prompt.text):
            raise TokenizeError(
                f"Completion {record.key}: the rendered assistant turn does not end with {END_OF_TURN_TOKEN}; "
                "datagen supports Qwen-style chat templates only.",
                key=record.key,
            )
        ended = record.finish_reason in ENDED_TURN_REASONS
        regions.append((len(prompt.text), turn_end + (len(END_OF_TURN_TOKEN) if ended else 0)))
        encoding = self.backend.encode(full, add_special_tokens=False)
        *history, (start, end) = token_spans(encoding.offsets, regions)
        return EncodedRow(list(encoding.ids), start, end, TOKENIZED_FROM_TEXT, tuple(history))

    def _ids_row(self, record: CompletionRecord, prompt: _Prompt, output_ids: list[int]) -> EncodedRow:
        generated = list(output_ids)
        if record.finish_reason in ENDED_TURN_REASONS and (
            not generated or generated[-1] not in self.stop_ids
        ):
            # The server left the stop token out of its ids (SGLang keeps it; other engines may not).
            generated.append(self.end_of_turn_id)
        ids = prompt.ids + generated
        return EncodedRow(ids, len(prompt.ids), len(ids), TOKENIZED_FROM_IDS)

    def _finish(self, record: CompletionRecord, row: EncodedRow) -> EncodedRow | RejectedRow:
        if self.max_length_tokens is not None and len(row.input_ids) > self.max_length_tokens:
            return RejectedRow(
                prompt_id=record.prompt_id,
                sample_index=record.sample_index,
                dataset=record.dataset,
                reason=REJECT_TOO_LONG,
                detail=f"{len(row.input_ids)} tokens > max_length_tokens {self.max_length_tokens}",
            )
        return row


# A row tokenizer rebuilds the Rust tokenizer and probes the template (~0.3 s for Qwen's): callers of
# tokenize_completion tokenize record after record with one tokenizer, so the last few are kept, keyed by what
# they were built from (a tokenizer changed in between gets a new one).
_ROW_TOKENIZER_LOCK = threading.Lock()


@functools.lru_cache(maxsize=4)
def _row_tokenizer(
    backend_json: str, chat_template: str, special: tuple[tuple[str, str], ...], max_length_tokens: int | None
) -> RowTokenizer:
    spec = TokenizerSpec(backend_json=backend_json, chat_template=chat_template, special_tokens=dict(special))
    return RowTokenizer(spec, max_length_tokens=max_length_tokens)


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
    spec = TokenizerSpec.from_tokenizer(tokenizer)
    special = tuple(sorted(spec.special_tokens.items()))
    rows = _row_tokenizer(spec.backend_json, spec.chat_template, special, max_length_tokens)
    with _ROW_TOKENIZER_LOCK:
        (result,) = rows.encode([record])
    if isinstance(result, TokenizeError):
        raise result
    if isinstance(result, RejectedRow):
        return result
    return TokenizedRow(
        prompt_id=record.prompt_id,
        sample_index=record.sample_index,
        dataset=record.dataset,
        input_ids=result.input_ids,
        loss_mask=result.loss_mask(),
        num_tokens=len(result.input_ids),
        num_loss_tokens=result.loss_tokens,
        finish_reason=record.finish_reason,
        tokenized_from=result.tokenized_from,
    )


def _has_user_query(messages: list[Message]) -> bool:
    """Tell whether a real user query (not a wrapped tool response) precedes the answer.

    Qwen templates decide from the last such query whether the final turn shows its think block; without
    one they treat the final turn differently, so those rows are rendered in full.
    """
    return any(
        message.role == "user" and not (message.content or "").lstrip().startswith("<tool_response>")
        for message in messages
    )


def _has_history(messages: list[Message]) -> bool:
    """Tell whether earlier assistant turns precede the answer (a turn of an on-policy conversation after its first)."""
    return any(message.role == "assistant" for message in messages)


def _probe_record(
    index: int,
    messages: list[Message],
    tools: list[dict[str, Any]] | None,
    answer: AssistantCompletion,
    thinking: bool | None,
) -> CompletionRecord:
    return CompletionRecord(
        prompt_id=f"append-probe-{index}",
        dataset="append-probe",
        messages=messages,
        tools=tools,
        completion=answer,
        finish_reason="tool_calls" if answer.tool_calls else "stop",
        usage=TokenUsage(),
        model="probe",
        engine="probe",
        server="probe",
        sampling=SamplingParams(enable_thinking=thinking),
        latency_s=0.0,
    )


def _token_id(backend: Any, token: str) -> int:
    token_id: int | None = backend.token_to_id(token)
    if token_id is None:
        raise TokenizeError(
            f"The tokenizer has no {token} token; datagen renders Qwen-style chat turns ending with it. "
            "Check `model.tokenizer_path`."
        )
    return token_id


def _last_index(ids: list[int], value: int, start: int) -> int:
    """Index of the last ``value`` in ``ids`` at or after ``start``, or -1."""
    for index in range(len(ids) - 1, start - 1, -1):
        if ids[index] == value:
            return index
    return -1


def _first_difference(first: str, second: str) -> int:
    for index, (a, b) in enumerate(zip(first, second, strict=False)):
        if a != b:
            return index
    return min(len(first), len(second))
