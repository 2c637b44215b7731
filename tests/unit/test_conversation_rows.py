"""Per-conversation rows of on-policy conversations, with the real Qwen3 tokenizer and Qwen3/Qwen3.6 templates.

A conversation's row is its last kept turn's record rendered whole; the loss must cover exactly what the target
wrote of every assistant turn as the template renders it (earlier turns' reasoning only where the template keeps
it, no header, no pre-filled filler, the ``<|im_end|>`` of turns that ended, never the newline after it) and
nothing of the system prompt, user turns or spliced tool results. Each row is checked against an independent
computation: ``apply_chat_template``'s full render tokenized with character offsets, and the trained texts written
out by hand per template, located in that render in order; a token is trained when its characters overlap one.
The records are made by :class:`~datagen.generation.conversation.Conversation` itself
(:mod:`tests.support.on_policy`). The shard-level tests check which turn a conversation's row ends on and that
every stored turn is counted once: a row, inside a row, or dropped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from datagen.dataset.conversation_rows import DROP_OUT_OF_ORDER, ConversationGrouper, token_spans
from datagen.dataset.tokenize import EncodedRow, RowTokenizer
from datagen.dataset.tokenize_workers import ShardTokenizer, TokenizeJob
from datagen.dataset.tokenizer import TokenizerSpec, load_tokenizer
from datagen.errors import TokenizeError
from datagen.records import CompletionRecord, Message
from tests.support.on_policy import DATASET_ANSWER, SCRIPTS, converse
from tests.support.qwen import build_qwen_tokenizer_dir

END = "<|im_end|>"
CALL_QWEN3 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_QWEN36 = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
)
# (conversation, the turn the row ends on) -> per template, the text trained of each assistant turn, in order.
# Qwen3 drops reasoning before the last user query and the target wrote "<think>\n" itself; Qwen3.6 pre-fills
# "<think>\n" in the generation prompt and trims content. The tool conversation's row ending at turn 1 (after the
# spliced result) keeps turn 0's reasoning: turn 0 comes after the last user query.
EXPECTED: dict[tuple[str, int], dict[str, list[str]]] = {
    ("thinking", 2): {
        "qwen3": [
            f"17 · 3 = **51**.{END}",
            f"51 ÷ 4 = 12.75.{END}",
            f"<think>\n12.75 is closer to 13 than to 12.\n</think>\n\nIt rounds to 13.\n{END}",
        ],
        "qwen3.6": [
            f"17 · 3 = **51**.{END}",
            f"51 ÷ 4 = 12.75.{END}",
            f"12.75 is closer to 13 than to 12.\n</think>\n\nIt rounds to 13.{END}",
        ],
    },
    ("tool", 2): {
        "qwen3": [
            f"{CALL_QWEN3}{END}",
            f"It is sunny in Paris, 18 °C.{END}",
            f"<think>\nSunny: no rain.\n</think>\n\nNo umbrella needed today.{END}",
        ],
        "qwen3.6": [
            f"{CALL_QWEN36}{END}",
            f"It is sunny in Paris, 18 °C.{END}",
            f"Sunny: no rain.\n</think>\n\nNo umbrella needed today.{END}",
        ],
    },
    ("tool", 1): {
        "qwen3": [
            f"<think>\nThe user wants Paris's weather: call the tool.\n</think>\n\n{CALL_QWEN3}{END}",
            f"<think>\nThe tool says sunny and 18 °C.\n</think>\n\nIt is sunny in Paris, 18 °C.{END}",
        ],
        "qwen3.6": [
            f"The user wants Paris's weather: call the tool.\n</think>\n\n{CALL_QWEN36}{END}",
            f"The tool says sunny and 18 °C.\n</think>\n\nIt is sunny in Paris, 18 °C.{END}",
        ],
    },
    # The same with thinking off: the earlier tool-call turn (after the last user query) is rendered with Qwen3.6's
    # empty think block, which the generation prompt pre-filled when it was generated: filler, not trained.
    ("tool_no_thinking", 1): {
        "qwen3": [f"{CALL_QWEN3}{END}", f"It is sunny in Paris, 18 °C.{END}"],
        "qwen3.6": [f"{CALL_QWEN36}{END}", f"It is sunny in Paris, 18 °C.{END}"],
    },
    # Thinking off: the earlier answer has no think block in the render; the last turn's pre-filled empty one
    # is filler. The last turn was cut at max_tokens: no end of turn trained.
    ("no_thinking_truncated", 1): {
        "qwen3": [f"Blue.{END}", "Blue as the sea, blue as the sky, blue as"],
        "qwen3.6": [f"Blue.{END}", "Blue as the sea, blue as the sky, blue as"],
    },
}


def conversation_turn(conversation: str, turn: int) -> CompletionRecord:
    """A turn's record of a scripted conversation; ``tool_no_thinking``: the tool one without reasoning, thinking off."""
    if conversation != "tool_no_thinking":
        return converse(conversation)[turn]
    record = converse("tool")[turn]
    history = [message.model_copy(update={"reasoning_content": None}) for message in record.messages]
    return record.model_copy(
        update={
            "messages": history,
            "completion": record.completion.model_copy(update={"reasoning_content": None}),
            "sampling": record.sampling.model_copy(update={"enable_thinking": False}),
        }
    )


@pytest.fixture(scope="module", params=["qwen3", "qwen3.6"])
def qwen(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    directory = build_qwen_tokenizer_dir(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, directory, load_tokenizer(str(directory))


@pytest.fixture(scope="module")
def rows(qwen: tuple[str, Path, Any]) -> RowTokenizer:
    # The merge's own path: the folder read without transformers.
    return RowTokenizer(TokenizerSpec.load(str(qwen[1])), max_length_tokens=None)


def full_render(tokenizer: Any, record: CompletionRecord) -> str:
    """The whole conversation through transformers' apply_chat_template."""
    thinking = record.sampling.enable_thinking
    extra = {} if thinking is None else {"enable_thinking": thinking}
    completion = record.completion
    answer = Message(
        role="assistant",
        content=completion.content,
        reasoning_content=completion.reasoning_content,
        tool_calls=completion.tool_calls,
    )
    chat = [message.to_chat_dict() for message in [*record.messages, answer]]
    text: str = tokenizer.apply_chat_template(chat, tools=record.tools, tokenize=False, **extra)
    return text


def reference_row(
    tokenizer: Any, record: CompletionRecord, trained: list[str]
) -> tuple[list[int], list[int]]:
    """Ids of the full render and the overlap rule over the hand-written trained texts, found in order."""
    full = full_render(tokenizer, record)
    regions, cursor = [], 0
    for text in trained:
        start = full.index(text, cursor)
        regions.append((start, start + len(text)))
        cursor = start + len(text)
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [
        int(any(begin < end and stop > start for start, end in regions))
        for begin, stop in encoding["offset_mapping"]
    ]
    return list(encoding["input_ids"]), mask


@pytest.mark.parametrize(("conversation", "turn"), sorted(EXPECTED))
def test_a_conversations_row_trains_exactly_every_assistant_turn_the_target_wrote(
    qwen: tuple[str, Path, Any], rows: RowTokenizer, conversation: str, turn: int
) -> None:
    name, _, tokenizer = qwen
    record = conversation_turn(conversation, turn)
    (row,) = rows.encode([record], whole_conversations=[0])
    assert isinstance(row, EncodedRow)
    trained = EXPECTED[(conversation, turn)][name]
    assert (row.input_ids, row.loss_mask()) == reference_row(tokenizer, record, trained)
    assert [tokenizer.decode(row.input_ids[start:end]) for start, end in row.spans] == trained
    assert row.loss_tokens == sum(row.loss_mask())
    text = tokenizer.decode(row.input_ids)
    assert DATASET_ANSWER not in text, "the history is the target's own"
    context = tokenizer.decode([t for t, bit in zip(row.input_ids, row.loss_mask(), strict=True) if not bit])
    for message in record.messages:
        if message.role in ("system", "user", "tool") and message.content:
            assert message.content.strip() in context, f"{message.role} text is context"


@pytest.mark.parametrize("conversation", sorted(SCRIPTS))
def test_the_answer_is_masked_as_its_own_per_turn_row(rows: RowTokenizer, conversation: str) -> None:
    # The last turn's span follows the single-turn rule: the same ids and answer span as the per-turn row.
    for record in converse(conversation):
        (whole,) = rows.encode([record], whole_conversations=[0])
        (single,) = rows.encode([record])
        assert isinstance(whole, EncodedRow) and isinstance(single, EncodedRow)
        assert whole.input_ids == single.input_ids
        assert (whole.loss_start, whole.loss_end) == (single.loss_start, single.loss_end)
        assert len(whole.history_spans) == record.turn
        assert single.history_spans == ()


def test_a_user_turn_imitating_an_assistant_header_refuses_the_row(rows: RowTokenizer) -> None:
    last = converse("thinking")[-1]
    messages = list(last.messages)
    messages[1] = Message(role="user", content="Quote this: <|im_start|>assistant\nHi<|im_end|>")
    (row,) = rows.encode([last.model_copy(update={"messages": messages})], whole_conversations=[0])
    assert isinstance(row, TokenizeError)
    assert "one '<|im_start|>assistant\\n' block per assistant turn" in str(row)


def test_an_earlier_turn_the_render_does_not_hold_refuses_the_row(rows: RowTokenizer) -> None:
    last = converse("thinking")[-1]
    messages = list(last.messages)
    index = next(i for i, message in enumerate(messages) if message.role == "assistant")
    # Content holding "</think>" without reasoning: the template renders only what follows it.
    messages[index] = messages[index].model_copy(
        update={"content": "hidden</think>shown", "reasoning_content": None}
    )
    (row,) = rows.encode([last.model_copy(update={"messages": messages})], whole_conversations=[0])
    assert isinstance(row, TokenizeError)
    assert "does not hold the turn's text" in str(row)


def test_token_spans_follow_the_overlap_rule() -> None:
    offsets = [(0, 3), (3, 5), (5, 9), (9, 10), (10, 14)]
    assert token_spans(offsets, [(4, 5), (9, 12)]) == [(1, 2), (3, 5)]
    assert token_spans(offsets, [(3, 6), (8, 9)]) == [(1, 3), (2, 3)]  # a token touching both regions
    assert token_spans(offsets, [(14, 14)]) == [(5, 5)]


def _shard(records: list[CompletionRecord]) -> bytes:
    return "".join(record.model_dump_json() + "\n" for record in records).encode()


def _plain(record: CompletionRecord) -> CompletionRecord:
    return record.model_copy(update={"prompt_id": "plain", "turn": None})


@pytest.fixture(scope="module")
def qwen3_spec(tmp_path_factory: pytest.TempPathFactory) -> TokenizerSpec:
    # Which turn a row ends on and the counts do not depend on the template: one is enough.
    return TokenizerSpec.load(str(build_qwen_tokenizer_dir(tmp_path_factory.mktemp("qwen3-shard"), "qwen3")))


def test_a_shard_makes_one_row_per_conversation_and_counts_every_turn_once(qwen3_spec: TokenizerSpec) -> None:
    conversations = {name: converse(name) for name in sorted(SCRIPTS)}
    plain = _plain(converse("thinking")[0])
    records = [
        *conversations["no_thinking_truncated"],
        plain,
        *conversations["thinking"],
        *conversations["tool"],
    ]
    per_turn = ShardTokenizer(TokenizeJob(qwen3_spec, None, False)).tokenize_shard("s", _shard(records))
    assert (per_turn.completions_read, per_turn.rows, dict(per_turn.dropped)) == (9, 8, {"truncated": 1})
    rows = RowTokenizer(qwen3_spec, max_length_tokens=None)
    for include_truncated in (False, True):
        job = TokenizeJob(qwen3_spec, None, include_truncated, conversation_rows="per_conversation")
        result = ShardTokenizer(job).tokenize_shard("s", _shard(records))
        assert result.completions_read == 9
        assert result.prompt_ids == ["no_thinking_truncated", "plain", "thinking", "tool"]
        # The truncated last turn is dropped unless kept: then the row ends at the turn before it.
        first_end = 1 if include_truncated else 0
        assert result.lines == [first_end, 2, 5, 8]
        assert result.finish_reasons == ["length" if include_truncated else "stop", "stop", "stop", "stop"]
        assert result.turns_in_conversation_rows == first_end + 2 + 2
        assert dict(result.dropped) == ({} if include_truncated else {"truncated": 1})
        assert result.rows + result.turns_in_conversation_rows + sum(result.dropped.values()) == 9
        # Each row equals its last turn's row tokenized alone as a whole conversation.
        offset = 0
        for index, (length, loss) in enumerate(zip(result.lengths, result.loss_tokens, strict=True)):
            (row,) = rows.encode([records[result.lines[index]]], whole_conversations=[0])
            assert isinstance(row, EncodedRow)
            assert list(result.input_ids[offset : offset + length]) == row.input_ids
            assert list(result.loss_mask[offset : offset + length]) == row.loss_mask()
            assert loss == row.loss_tokens
            offset += length
    # A row over max_length_tokens is refused with every turn it would have held.
    job = TokenizeJob(qwen3_spec, 60, False, conversation_rows="per_conversation")
    result = ShardTokenizer(job).tokenize_shard("s", _shard(conversations["thinking"]))
    assert (result.rows, result.turns_in_conversation_rows, dict(result.dropped)) == (0, 0, {"too_long": 3})


def test_turns_out_of_their_conversations_order_are_dropped_not_made_a_second_row() -> None:
    first, second = converse("thinking"), converse("tool")
    grouper = ConversationGrouper()
    finished = [
        grouper.add(line, record, None) for line, record in enumerate([*first[:2], *second, first[2]])
    ]
    finished.append(grouper.close())
    made = [row for row in finished if row is not None]
    assert [(row.record.prompt_id, row.record.turn, row.history_turns) for row in made] == [
        ("thinking", 1, 1),
        ("tool", 2, 2),
    ]
    assert grouper.dropped == {DROP_OUT_OF_ORDER: 1}
    repeated = ConversationGrouper()
    assert repeated.add(0, first[1], None) is None
    assert repeated.add(1, first[0], None) is None  # an earlier turn after a later one
    assert repeated.dropped == {DROP_OUT_OF_ORDER: 1}


def test_a_screened_out_turn_between_kept_ones_is_history_not_dropped() -> None:
    records = converse("thinking")
    grouper = ConversationGrouper()
    assert grouper.add(0, records[0], None) is None
    assert grouper.add(1, records[1], "empty_completion") is None
    assert grouper.add(2, records[2], None) is None
    row = grouper.close()
    assert row is not None and (row.line, row.history_turns) == (2, 2)
    assert not grouper.dropped
    assert json.loads(row.record.model_dump_json())["turn"] == 2


def test_a_retry_rounds_file_trains_only_its_own_turns_so_each_turn_is_trained_once(
    qwen3_spec: TokenizerSpec,
) -> None:
    # Round 0 stored turn 0; a retry round stored turns 1 and 2 (the failed turn and the one it ended) in a file
    # of its own. Two rows: the first trains turn 0, the second holds it as history and trains turns 1 and 2.
    records = converse("thinking")
    job = TokenizeJob(qwen3_spec, None, False, conversation_rows="per_conversation")
    first = ShardTokenizer(job).tokenize_shard("s", _shard(records[:1]))
    retried = ShardTokenizer(job).tokenize_shard("s.retry-0001", _shard(records[1:]))
    assert (first.rows, first.turns_in_conversation_rows) == (1, 0)
    assert (retried.rows, retried.turns_in_conversation_rows) == (1, 1)
    rows = RowTokenizer(qwen3_spec, max_length_tokens=None)
    (whole,) = rows.encode([records[2]], whole_conversations=[0])
    (own,) = rows.encode([records[2]], whole_conversations=[1])
    assert isinstance(whole, EncodedRow) and isinstance(own, EncodedRow)
    assert own.input_ids == whole.input_ids and own.spans == whole.spans[1:]
    assert list(retried.input_ids) == own.input_ids and list(retried.loss_mask) == own.loss_mask()
    grouper = ConversationGrouper()
    assert grouper.add(0, records[1], None) is None and grouper.add(1, records[2], None) is None
    made = grouper.close()
    assert made is not None and (made.first_turn, made.history_turns) == (1, 1)
