"""Rendering completions into token ids and loss masks with the tiny model's real tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datagen.dataset.tokenize import EncodedRow, RejectedRow, RowTokenizer, TokenizedRow, tokenize_completion
from datagen.dataset.tokenizer import TokenizerSpec, load_tokenizer
from datagen.errors import ConfigError, TokenizeError
from datagen.records import (
    AssistantCompletion,
    CompletionRecord,
    FunctionCall,
    Message,
    SamplingParams,
    TokenUsage,
    ToolCall,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def render_conversation(tokenizer: Any, messages: list[dict[str, Any]], **options: Any) -> str:
    """The conversation rendered by the target's template, as the merge renders it."""
    return TokenizerSpec.from_tokenizer(tokenizer, with_backend=False).render(messages, **options)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(str(tiny_model_dir))


def make_record(
    messages: list[Message],
    completion: AssistantCompletion,
    *,
    thinking: bool | None = None,
    tools: list[dict[str, Any]] | None = None,
    finish_reason: str = "stop",
) -> CompletionRecord:
    return CompletionRecord(
        prompt_id="p1",
        sample_index=0,
        dataset="demo",
        messages=messages,
        tools=tools,
        completion=completion,
        finish_reason=finish_reason,  # type: ignore[arg-type]
        usage=TokenUsage(prompt_tokens=10, completion_tokens=5),
        model="tiny",
        engine="transformers",
        server="http://127.0.0.1:1",
        sampling=SamplingParams(enable_thinking=thinking),
        latency_s=0.1,
    )


def tokenized(tokenizer: Any, record: CompletionRecord, max_length_tokens: int | None = None) -> TokenizedRow:
    row = tokenize_completion(tokenizer, record, max_length_tokens=max_length_tokens)
    assert isinstance(row, TokenizedRow)
    assert len(row.input_ids) == len(row.loss_mask) == row.num_tokens
    assert row.num_loss_tokens == sum(row.loss_mask)
    return row


def masked_text(tokenizer: Any, row: TokenizedRow) -> str:
    """Decode the loss tokens, checking they form one contiguous run."""
    positions = [index for index, bit in enumerate(row.loss_mask) if bit]
    assert positions == list(range(positions[0], positions[-1] + 1))
    return str(tokenizer.decode([row.input_ids[index] for index in positions]))


def unmasked_text(tokenizer: Any, row: TokenizedRow) -> str:
    return str(
        tokenizer.decode([token for token, bit in zip(row.input_ids, row.loss_mask, strict=True) if not bit])
    )


USER = [Message(role="user", content="What is the capital of France?")]


def test_plain_answer_masks_the_default_think_block_answer_and_end_of_turn(tokenizer: Any) -> None:
    row = tokenized(tokenizer, make_record(USER, AssistantCompletion(content="Paris.")))
    assert masked_text(tokenizer, row) == "<think>\n\n</think>\n\nParis.<|im_end|>"
    assert unmasked_text(tokenizer, row) == (
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n\n"
    )
    assert (
        row.input_ids
        == tokenizer(
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
            "<think>\n\n</think>\n\nParis.<|im_end|>\n",
            add_special_tokens=False,
        )["input_ids"]
    )


def test_thinking_answer_masks_reasoning_and_answer(tokenizer: Any) -> None:
    completion = AssistantCompletion(content="Paris.", reasoning_content="France's capital is Paris.")
    row = tokenized(tokenizer, make_record(USER, completion, thinking=True))
    assert masked_text(tokenizer, row) == "<think>\nFrance's capital is Paris.\n</think>\n\nParis.<|im_end|>"


def test_non_thinking_answer_leaves_the_prefilled_think_block_unmasked(tokenizer: Any) -> None:
    row = tokenized(tokenizer, make_record(USER, AssistantCompletion(content="Paris."), thinking=False))
    assert masked_text(tokenizer, row) == "Paris.<|im_end|>"
    assert unmasked_text(tokenizer, row).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n\n")


def test_tool_call_completion_masks_the_call_and_not_the_tool_schemas(tokenizer: Any) -> None:
    completion = AssistantCompletion(
        tool_calls=[ToolCall(function=FunctionCall(name="get_weather", arguments={"city": "Berlin"}))]
    )
    row = tokenized(tokenizer, make_record(USER, completion, thinking=False, tools=TOOLS))
    assert masked_text(tokenizer, row) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin"}}\n</tool_call><|im_end|>'
    )
    assert '<tools>\n{"type": "function"' in unmasked_text(tokenizer, row)


def test_multi_turn_with_tools_trains_only_on_the_new_turn(tokenizer: Any) -> None:
    messages = [
        Message(role="system", content="Use tools."),
        Message(role="user", content="Weather in Berlin?"),
        Message(
            role="assistant",
            content="",
            reasoning_content="I should call the tool.",
            tool_calls=[
                ToolCall(id="c1", function=FunctionCall(name="get_weather", arguments={"city": "Berlin"}))
            ],
        ),
        Message(role="tool", content="sunny, 20C", tool_call_id="c1"),
    ]
    completion = AssistantCompletion(content="It is sunny and 20C.", reasoning_content="The tool answered.")
    row = tokenized(tokenizer, make_record(messages, completion, thinking=True, tools=TOOLS))
    assert (
        masked_text(tokenizer, row)
        == "<think>\nThe tool answered.\n</think>\n\nIt is sunny and 20C.<|im_end|>"
    )
    context = unmasked_text(tokenizer, row)
    assert "<tool_response>\nsunny, 20C\n</tool_response>" in context
    # The earlier tool step follows the last real user query: its reasoning stays in the (unmasked) context.
    assert "<think>\nI should call the tool.\n</think>\n\n<tool_call>" in context


def test_exact_output_ids_are_used_verbatim_with_end_of_turn_added(tokenizer: Any) -> None:
    output_ids = tokenizer("Paris is it", add_special_tokens=False)["input_ids"]
    record = make_record(
        USER, AssistantCompletion(content="ignored", output_token_ids=output_ids), thinking=False
    )
    row = tokenized(tokenizer, record)
    prompt = render_conversation(
        tokenizer,
        [m.to_chat_dict() for m in USER],
        tools=None,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert row.input_ids == [*prompt_ids, *output_ids, end_of_turn]
    assert row.loss_mask == [0] * len(prompt_ids) + [1] * (len(output_ids) + 1)


def test_exact_output_ids_ending_on_end_of_turn_are_not_extended(tokenizer: Any) -> None:
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    output_ids = [*tokenizer("Paris", add_special_tokens=False)["input_ids"], end_of_turn]
    record = make_record(USER, AssistantCompletion(content="Paris", output_token_ids=output_ids))
    row = tokenized(tokenizer, record)
    assert row.input_ids[-len(output_ids) :] == output_ids
    assert row.num_loss_tokens == len(output_ids)


def test_exact_output_ids_ending_on_end_of_text_get_no_invented_end_of_turn(tokenizer: Any) -> None:
    # The model stopped on <|endoftext|> (a stop token too): the row ends where the model did.
    end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    output_ids = [*tokenizer("Paris", add_special_tokens=False)["input_ids"], end_of_text]
    record = make_record(USER, AssistantCompletion(content="Paris", output_token_ids=output_ids))
    row = tokenized(tokenizer, record)
    assert row.input_ids[-len(output_ids) :] == output_ids
    assert row.num_loss_tokens == len(output_ids)


def test_truncated_completion_does_not_train_on_an_end_of_turn_it_never_produced(tokenizer: Any) -> None:
    record = make_record(
        USER, AssistantCompletion(content="Paris is the"), thinking=False, finish_reason="length"
    )
    row = tokenized(tokenizer, record)
    assert masked_text(tokenizer, row) == "Paris is the"


def test_rows_over_the_length_limit_are_rejected_not_raised(tokenizer: Any) -> None:
    record = make_record(USER, AssistantCompletion(content="Paris."))
    full = tokenized(tokenizer, record)
    assert isinstance(tokenize_completion(tokenizer, record, max_length_tokens=full.num_tokens), TokenizedRow)
    rejected = tokenize_completion(tokenizer, record, max_length_tokens=full.num_tokens - 1)
    assert isinstance(rejected, RejectedRow)
    assert rejected.reason == "too_long"


def test_reasoning_in_non_thinking_mode_is_a_template_mismatch(tokenizer: Any) -> None:
    record = make_record(USER, AssistantCompletion(content="Paris.", reasoning_content="hmm"), thinking=False)
    with pytest.raises(TokenizeError, match="not a prefix"):
        tokenize_completion(tokenizer, record, max_length_tokens=None)


def test_missing_tokenizer_is_a_config_error_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.tokenizer_path"):
        load_tokenizer(str(tmp_path / "nowhere"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    content=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=40)
)
def test_every_answer_character_is_covered_and_nothing_else_is(tokenizer: Any, content: str) -> None:
    if "<|" in content or "<think>" in content or "</think>" in content or "<tool_" in content:
        return
    record = make_record(USER, AssistantCompletion(content=content), thinking=False)
    row = tokenized(tokenizer, record)
    prompt = render_conversation(
        tokenizer,
        [m.to_chat_dict() for m in USER],
        tools=None,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    full = render_conversation(
        tokenizer,
        [*(m.to_chat_dict() for m in USER), {"role": "assistant", "content": content}],
        tools=None,
        add_generation_prompt=False,
        enable_thinking=False,
    )
    region = full[len(prompt) : full.rindex("<|im_end|>") + len("<|im_end|>")]
    offsets = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    covered = set()
    for (start, stop), bit in zip(offsets, row.loss_mask, strict=True):
        overlaps = start < len(prompt) + len(region) and stop > len(prompt)
        assert bool(bit) == overlaps
        if bit:
            covered.update(range(start, stop))
    assert set(range(len(prompt), len(prompt) + len(region))) <= covered
    # Decoding the loss tokens gives the answer and its end of turn, preceded at most by prompt whitespace
    # that BPE merged with the answer's first characters.
    decoded = masked_text(tokenizer, row)
    assert decoded.endswith(region)
    merged_prefix = decoded[: len(decoded) - len(region)]
    assert merged_prefix.strip() == ""
    assert prompt.endswith(merged_prefix)


# A template whose assistant turn depends on the conversation before it (it numbers the turns): rendering the
# answer alone after a fixed context would be wrong, and the append probe must notice.
CONTEXT_DEPENDENT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.role == 'assistant' %} (turn {{ loop.index }}){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_answer_rendered_alone_only_when_the_template_passes_the_append_probe(tokenizer: Any) -> None:
    spec = TokenizerSpec.from_tokenizer(tokenizer)
    assert RowTokenizer(spec, max_length_tokens=None).renders_answer_alone
    odd = TokenizerSpec(spec.backend_json, CONTEXT_DEPENDENT_TEMPLATE, spec.special_tokens)
    rows = RowTokenizer(odd, max_length_tokens=None)
    assert not rows.renders_answer_alone
    messages = [Message(role="system", content="Be brief."), *USER]
    (row,) = rows.encode([make_record(messages, AssistantCompletion(content="Paris."))])
    assert isinstance(row, EncodedRow)
    generated = tokenizer.decode(row.input_ids[row.loss_start : row.loss_end])
    assert generated == "Paris. (turn 3)<|im_end|>"


def test_answer_rendered_alone_gives_the_same_rows_as_full_renders(tokenizer: Any) -> None:
    spec = TokenizerSpec.from_tokenizer(tokenizer)
    records = [
        make_record(USER, AssistantCompletion(content="Paris.", reasoning_content="Easy."), thinking=True),
        make_record(USER, AssistantCompletion(content="\nParis.\n"), thinking=False),
        make_record(
            USER,
            AssistantCompletion(
                tool_calls=[ToolCall(function=FunctionCall(name="get_weather", arguments={"city": "Paris"}))]
            ),
            tools=TOOLS,
            finish_reason="tool_calls",
        ),
        make_record(USER, AssistantCompletion(content="Paris is"), finish_reason="length"),
    ]
    alone = RowTokenizer(spec, max_length_tokens=None).encode(records)
    full = RowTokenizer(spec, max_length_tokens=None, answer_render="full").encode(records)
    assert alone == full
    assert all(isinstance(row, EncodedRow) for row in alone)
