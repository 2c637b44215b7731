"""Loss masks with the real Qwen3 tokenizer and the real Qwen3 and Qwen3.6 chat templates.

The mask must be 1 exactly on the tokens the target generated for the trained assistant turn (its end-of-turn
token included when it produced one) and 0 on everything else. ``assert_mask_exact`` checks that from the
text alone (what the prompt render is, what the model generated); it is shown to reject masks shifted by one
token, so a passing test means something. Rows are also compared with an independent reference: the
template rendered through ``apply_chat_template``, the full text tokenized with character offsets, the
overlap rule applied token by token.

On-policy conversations' rows (:mod:`tests.support.on_policy`: each turn's record made by the code that makes it
in a run, its history the target's own earlier answers) are among the cases: each turn's mask must be exactly
that turn's answer, none of the earlier answers, reasoning or spliced tool results it follows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from datagen.dataset.tokenize import EncodedRow, RowTokenizer, TokenizedRow, tokenize_completion
from datagen.dataset.tokenizer import TokenizerSpec, load_tokenizer
from datagen.records import (
    AssistantCompletion,
    CompletionRecord,
    FunctionCall,
    Message,
    SamplingParams,
    TokenUsage,
    ToolCall,
)
from tests.support.on_policy import DATASET_ANSWER, SCRIPTS, converse, on_policy_records
from tests.support.qwen import QWEN3_VOCAB_SIZE, THINK_TOKEN_ID, build_qwen_tokenizer_dir

END = "<|im_end|>"
TEMPLATES = ["qwen3", "qwen3.6"]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query"],
        },
    },
}
USER = Message(role="user", content="What is the capital of France?")


@pytest.fixture(scope="module", params=TEMPLATES)
def qwen(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    directory = build_qwen_tokenizer_dir(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, load_tokenizer(str(directory))


def record(
    messages: list[Message],
    completion: AssistantCompletion,
    *,
    thinking: bool | None = None,
    tools: list[dict[str, Any]] | None = None,
    finish_reason: str = "stop",
) -> CompletionRecord:
    return CompletionRecord(
        prompt_id="p",
        dataset="demo",
        messages=messages,
        tools=tools,
        completion=completion,
        finish_reason=finish_reason,  # type: ignore[arg-type]
        usage=TokenUsage(),
        model="Qwen/Qwen3.6-27B",
        engine="sglang",
        server="http://127.0.0.1:30000",
        sampling=SamplingParams(enable_thinking=thinking),
        latency_s=1.0,
    )


def renders(tokenizer: Any, rec: CompletionRecord) -> tuple[str, str]:
    """Prompt render (with generation prompt) and full render, through transformers' own apply_chat_template."""
    extra = {} if rec.sampling.enable_thinking is None else {"enable_thinking": rec.sampling.enable_thinking}
    messages = [message.to_chat_dict() for message in rec.messages]
    answer = Message(
        role="assistant",
        content=rec.completion.content,
        reasoning_content=rec.completion.reasoning_content,
        tool_calls=rec.completion.tool_calls,
    ).to_chat_dict()
    prompt = tokenizer.apply_chat_template(
        messages, tools=rec.tools, add_generation_prompt=True, tokenize=False, **extra
    )
    full = tokenizer.apply_chat_template([*messages, answer], tools=rec.tools, tokenize=False, **extra)
    return prompt, full


def reference_row(tokenizer: Any, rec: CompletionRecord) -> tuple[list[int], list[int]]:
    """The loss-mask rule, implemented independently: offsets of the full render overlapping the answer."""
    prompt, full = renders(tokenizer, rec)
    assert full.startswith(prompt)
    end = full.rindex(END) + (len(END) if rec.finish_reason in {"stop", "tool_calls"} else 0)
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(start < end and stop > len(prompt)) for start, stop in encoding["offset_mapping"]]
    return list(encoding["input_ids"]), mask


def generated_text(tokenizer: Any, rec: CompletionRecord) -> str:
    """What the model produced: the full render after the prompt render, through its end of turn."""
    prompt, full = renders(tokenizer, rec)
    turn_end = full.rindex(END)
    ended = rec.finish_reason in {"stop", "tool_calls"}
    return full[len(prompt) : turn_end + (len(END) if ended else 0)]


def assert_mask_exact(
    tokenizer: Any, rec: CompletionRecord, input_ids: list[int], loss_mask: list[int]
) -> None:
    """The mask is 1 exactly on the generated tokens (and the end of turn the model produced), 0 elsewhere."""
    assert len(input_ids) == len(loss_mask)
    assert set(loss_mask) <= {0, 1}
    positions = [index for index, bit in enumerate(loss_mask) if bit]
    assert positions, "no token is trained on"
    first, last = positions[0], positions[-1]
    assert positions == list(range(first, last + 1)), "the trained tokens are not one contiguous run"
    prompt, full = renders(tokenizer, rec)
    assert tokenizer.decode(input_ids) == full
    assert tokenizer.decode(input_ids[:first]) == prompt, "the tokens before the answer are not the prompt"
    assert tokenizer.decode(input_ids[first : last + 1]) == generated_text(tokenizer, rec)
    end_of_turn = tokenizer.convert_tokens_to_ids(END)
    ended = rec.finish_reason in {"stop", "tool_calls"}
    assert (input_ids[last] == end_of_turn) == ended, (
        "the end of turn is trained on iff the model produced it"
    )
    assert tokenizer.decode(input_ids[last + 1 :]) == ("\n" if ended else END + "\n")


def check(tokenizer: Any, rec: CompletionRecord) -> TokenizedRow:
    row = tokenize_completion(tokenizer, rec, max_length_tokens=None)
    assert isinstance(row, TokenizedRow)
    assert_mask_exact(tokenizer, rec, row.input_ids, row.loss_mask)
    assert (row.input_ids, row.loss_mask) == reference_row(tokenizer, rec)
    assert row.tokenized_from == "text"
    return row


def masked(tokenizer: Any, row: TokenizedRow) -> str:
    return str(tokenizer.decode([t for t, bit in zip(row.input_ids, row.loss_mask, strict=True) if bit]))


CALL_BERLIN = ToolCall(id="c1", function=FunctionCall(name="get_weather", arguments={"city": "Berlin"}))
CALL_PARIS = ToolCall(id="c2", function=FunctionCall(name="get_weather", arguments={"city": "Paris"}))
CALL_SEARCH = ToolCall(
    id="c3", function=FunctionCall(name="search", arguments={"query": "drafter models", "limit": 3})
)
CASES: dict[str, CompletionRecord] = {
    "thinking": record(
        [USER], AssistantCompletion(content="Paris.", reasoning_content="France's capital is Paris.")
    ),
    "thinking_explicitly_on": record(
        [USER], AssistantCompletion(content="Paris.", reasoning_content="Easy."), thinking=True
    ),
    "thinking_off": record([USER], AssistantCompletion(content="Paris."), thinking=False),
    "system_and_multi_turn": record(
        [
            Message(role="system", content="Answer briefly."),
            Message(role="user", content="Capital of Germany?"),
            Message(role="assistant", content="Berlin.", reasoning_content="Old reasoning, dropped."),
            Message(role="user", content="And of France?"),
        ],
        AssistantCompletion(content="Paris.", reasoning_content="Same kind of question."),
    ),
    "tool_definitions_and_one_call": record(
        [USER],
        AssistantCompletion(content="", tool_calls=[CALL_BERLIN]),
        thinking=False,
        tools=[WEATHER_TOOL],
    ),
    "parallel_tool_calls_with_reasoning": record(
        [Message(role="user", content="Weather in Berlin and Paris, and search drafters.")],
        AssistantCompletion(
            content="Let me check.",
            reasoning_content="Three calls at once.",
            tool_calls=[CALL_BERLIN, CALL_PARIS, CALL_SEARCH],
        ),
        tools=[WEATHER_TOOL, SEARCH_TOOL],
        finish_reason="tool_calls",
    ),
    "tool_responses_then_answer": record(
        [
            Message(role="system", content="Use the tools."),
            Message(role="user", content="Weather in Berlin and Paris?"),
            Message(
                role="assistant",
                content="",
                reasoning_content="Two calls.",
                tool_calls=[CALL_BERLIN, CALL_PARIS],
            ),
            Message(role="tool", content='{"temp_c": 18}', tool_call_id="c1"),
            Message(role="tool", content='{"temp_c": 21}', tool_call_id="c2"),
        ],
        AssistantCompletion(content="Berlin 18C, Paris 21C.", reasoning_content="Both answered."),
        tools=[WEATHER_TOOL],
    ),
    "truncated_thinking": record(
        [USER],
        AssistantCompletion(content=None, reasoning_content="Let me think about this for a long"),
        finish_reason="length",
    ),
    "truncated_answer": record(
        [USER],
        AssistantCompletion(content="Paris is the capital and"),
        thinking=False,
        finish_reason="length",
    ),
    **on_policy_records(),
}


def test_the_fixture_tokenizer_is_qwen3s(qwen: tuple[str, Any]) -> None:
    _, tokenizer = qwen
    assert len(tokenizer) == QWEN3_VOCAB_SIZE
    assert tokenizer.convert_tokens_to_ids("<think>") == THINK_TOKEN_ID


@pytest.mark.parametrize("case", sorted(CASES))
def test_mask_is_exactly_the_generated_tokens(qwen: tuple[str, Any], case: str) -> None:
    _, tokenizer = qwen
    check(tokenizer, CASES[case])


def test_merge_path_gives_the_same_rows(qwen: tuple[str, Any]) -> None:
    # The merge reads the tokenizer folder without transformers and encodes with TextEncoder's fast path.
    _, tokenizer = qwen
    rows = RowTokenizer(TokenizerSpec.load(tokenizer.name_or_path), max_length_tokens=None)
    assert rows.text.fast
    assert rows.renders_answer_alone
    records = [CASES[case] for case in sorted(CASES)]
    for rec, row in zip(records, rows.encode(records), strict=True):
        assert isinstance(row, EncodedRow)
        assert (row.input_ids, row.loss_mask()) == reference_row(tokenizer, rec)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("shift", [-1, 1])
def test_checker_rejects_a_mask_shifted_by_one_token(qwen: tuple[str, Any], case: str, shift: int) -> None:
    _, tokenizer = qwen
    rec = CASES[case]
    row = check(tokenizer, rec)
    mask = row.loss_mask
    shifted = [0, *mask[:-1]] if shift == 1 else [*mask[1:], 0]
    with pytest.raises(AssertionError):
        assert_mask_exact(tokenizer, rec, row.input_ids, shifted)


def test_thinking_masks(qwen: tuple[str, Any]) -> None:
    name, tokenizer = qwen
    row = check(tokenizer, CASES["thinking"])
    answer = "France's capital is Paris.\n</think>\n\nParis.<|im_end|>"
    # Qwen3.6 opens the think block in the generation prompt, so the model never generated "<think>\n".
    assert masked(tokenizer, row) == (answer if name == "qwen3.6" else "<think>\n" + answer)


def test_non_thinking_mode_never_trains_on_the_prefilled_empty_think_block(qwen: tuple[str, Any]) -> None:
    _, tokenizer = qwen
    row = check(tokenizer, CASES["thinking_off"])
    assert masked(tokenizer, row) == "Paris.<|im_end|>"
    unmasked = tokenizer.decode([t for t, bit in zip(row.input_ids, row.loss_mask, strict=True) if not bit])
    assert unmasked.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n\n")


def test_multi_turn_trains_only_on_the_last_turn(qwen: tuple[str, Any]) -> None:
    _, tokenizer = qwen
    row = check(tokenizer, CASES["system_and_multi_turn"])
    assert "Berlin." not in masked(tokenizer, row)
    assert "Old reasoning" not in masked(tokenizer, row)
    # Both templates drop the reasoning of turns before the last user query (Qwen3.6 keeps it only when the
    # request sets preserve_thinking, which datagen's requests never do).
    assert "Old reasoning" not in tokenizer.decode(row.input_ids)


@pytest.mark.parametrize("conversation", sorted(SCRIPTS))
def test_on_policy_rows_train_only_on_their_own_turns_answer(
    qwen: tuple[str, Any], conversation: str
) -> None:
    _, tokenizer = qwen
    records = converse(conversation)
    for rec in records:
        assert rec.turn is not None
        row = check(tokenizer, rec)
        trained = masked(tokenizer, row)
        context = tokenizer.decode(
            [t for t, bit in zip(row.input_ids, row.loss_mask, strict=True) if not bit]
        )
        assert DATASET_ANSWER not in tokenizer.decode(row.input_ids), "the history is the target's own"
        assert (rec.completion.content or "").strip() in trained
        if rec.completion.reasoning_content:
            assert rec.completion.reasoning_content.strip() in trained
        for earlier in records[: rec.turn]:
            said, thought = earlier.completion.content, earlier.completion.reasoning_content
            if said:
                assert said.strip() in context and said.strip() not in trained
            if thought:
                assert thought.strip() not in trained
            for call in earlier.completion.tool_calls or []:
                assert call.function.name in context and call.function.name not in trained
        if rec.turn and rec.messages[-1].role == "tool":
            assert rec.messages[-1].content in context, "the spliced tool result is context"
    # Reasoning of turns before the row's last user query is not even rendered (the templates drop it).
    last = records[-1]
    if conversation == "thinking":
        text = tokenizer.decode(check(tokenizer, last).input_ids)
        assert all(earlier.completion.reasoning_content not in text for earlier in records[:-1])


@pytest.mark.parametrize("conversation", sorted(SCRIPTS))
def test_checker_rejects_a_mask_that_also_trains_an_earlier_answer(
    qwen: tuple[str, Any], conversation: str
) -> None:
    # What a trainer that trains every assistant turn of the render would do to an on-policy row.
    _, tokenizer = qwen
    records = converse(conversation)
    rec, earlier = records[-1], records[-2]
    row = check(tokenizer, rec)
    _, full = renders(tokenizer, rec)
    said = (earlier.completion.content or "").strip()
    assert said
    start = full.index(said)
    offsets = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    widened = [
        bit | int(begin < start + len(said) and stop > start)
        for bit, (begin, stop) in zip(row.loss_mask, offsets, strict=True)
    ]
    assert widened != row.loss_mask
    with pytest.raises(AssertionError):
        assert_mask_exact(tokenizer, rec, row.input_ids, widened)


def test_parallel_tool_calls_are_trained_on_in_the_templates_format(qwen: tuple[str, Any]) -> None:
    name, tokenizer = qwen
    row = check(tokenizer, CASES["parallel_tool_calls_with_reasoning"])
    text = masked(tokenizer, row)
    if name == "qwen3.6":
        assert (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nBerlin\n</parameter>\n</function>" in text
        )
        assert (
            "<function=search>\n<parameter=query>\ndrafter models\n</parameter>\n<parameter=limit>\n3\n"
            in text
        )
    else:
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin"}}\n</tool_call>' in text
    assert text.count("<tool_call>") == 3
    assert text.endswith("</tool_call><|im_end|>")
    context = tokenizer.decode([t for t, bit in zip(row.input_ids, row.loss_mask, strict=True) if not bit])
    assert '"name": "search"' in context  # the tool definitions are context, never trained on


def test_tool_responses_are_context(qwen: tuple[str, Any]) -> None:
    _, tokenizer = qwen
    row = check(tokenizer, CASES["tool_responses_then_answer"])
    text = masked(tokenizer, row)
    assert "<tool_response>" not in text
    assert text.endswith("Berlin 18C, Paris 21C.<|im_end|>")


def test_truncated_answer_does_not_train_on_an_end_of_turn_it_never_produced(qwen: tuple[str, Any]) -> None:
    _, tokenizer = qwen
    row = check(tokenizer, CASES["truncated_answer"])
    assert masked(tokenizer, row) == "Paris is the capital and"


def test_rendering_matches_apply_chat_template(qwen: tuple[str, Any]) -> None:
    _, tokenizer = qwen
    spec = TokenizerSpec.from_tokenizer(tokenizer)
    for rec in CASES.values():
        prompt, _ = renders(tokenizer, rec)
        extra = rec.sampling.enable_thinking
        ours = spec.render(
            [m.to_chat_dict() for m in rec.messages],
            tools=rec.tools,
            add_generation_prompt=True,
            enable_thinking=extra,
        )
        assert ours == prompt


def test_exact_ids_rows_use_the_engines_ids_verbatim(qwen: tuple[str, Any]) -> None:
    _, tokenizer = qwen
    # Ids a model may emit that differ from re-tokenizing the text ("Par" + "is." instead of "Paris.").
    output_ids = [
        *tokenizer.encode("Par", add_special_tokens=False),
        *tokenizer.encode("is.", add_special_tokens=False),
    ]
    rec = record([USER], AssistantCompletion(content="Paris.", output_token_ids=output_ids), thinking=False)
    row = tokenize_completion(tokenizer, rec, max_length_tokens=None)
    assert isinstance(row, TokenizedRow)
    prompt, _ = renders(tokenizer, rec)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    end_of_turn = tokenizer.convert_tokens_to_ids(END)
    assert row.input_ids == [*prompt_ids, *output_ids, end_of_turn]
    assert row.loss_mask == [0] * len(prompt_ids) + [1] * (len(output_ids) + 1)
    assert row.tokenized_from == "ids"
    assert row.input_ids != tokenizer.encode(renders(tokenizer, rec)[1], add_special_tokens=False)[:-1]


def test_every_template_fixture_is_vendored_with_its_notice() -> None:
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "qwen"
    notice = (fixtures / "NOTICE.md").read_text()
    assert "Apache License" in notice
    for name in ("qwen3.jinja", "qwen3.6.jinja"):
        assert name in notice
