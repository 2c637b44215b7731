"""Two dataset versions written by real merges on the real Qwen3 tokenizer, for the trainer export tests.

Version 1 is a run's parts; version 2 extends it (``tokenize.base_version``) with a second run's parts, so an
export of version 2 holds base and new rows. The completions cover what the loss mask depends on: thinking
and non-thinking answers, a system prompt, earlier assistant turns, tool calls and a tool response, a
truncated answer (kept), non-ASCII text, and every turn of on-policy conversations (:mod:`tests.support.on_policy`:
histories of the target's own answers with reasoning, a spliced tool result, a truncated last turn).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from datagen.config import RunConfig
from datagen.dataset.merge import merge_and_tokenize
from datagen.dataset.merge_rounds import TokenizeSummary
from datagen.dataset.versions import DatasetVersion
from datagen.output.layout import RunLayout
from datagen.output.store import Store
from datagen.records import (
    AssistantCompletion,
    CompletionRecord,
    FunctionCall,
    Message,
    SamplingParams,
    ShardSummary,
    TokenUsage,
    ToolCall,
)
from tests.support.on_policy import SCRIPTS, converse

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _record(
    index: int, dataset: str, messages: list[Message], answer: AssistantCompletion, **extra: Any
) -> CompletionRecord:
    thinking = answer.reasoning_content is not None
    return CompletionRecord(
        prompt_id=f"{dataset}-{index:03d}",
        dataset=dataset,
        messages=messages,
        completion=answer,
        finish_reason=extra.pop("finish_reason", "stop"),
        usage=TokenUsage(prompt_tokens=20, completion_tokens=20),
        model="qwen3",
        engine="sglang",
        server="http://127.0.0.1:1",
        sampling=SamplingParams(enable_thinking=thinking),
        latency_s=0.1,
        **extra,
    )


def completions(dataset: str, offset: int) -> list[CompletionRecord]:
    """Seven varied completions of one dataset (prompt ids from ``offset``), then on-policy conversations' turns."""
    user = Message(role="user", content=f"What is {offset} + 2? Explain briefly.")
    records = [
        _record(
            offset,
            dataset,
            [user],
            AssistantCompletion(
                reasoning_content=f"{offset} plus 2 is {offset + 2}.", content=f"It is {offset + 2}."
            ),
        ),
        _record(offset + 1, dataset, [user], AssistantCompletion(content=f"{offset + 2}.")),
        _record(
            offset + 2,
            dataset,
            [Message(role="system", content="You are terse."), Message(role="user", content="Name a prime.")],
            AssistantCompletion(content="Seven."),
        ),
        _record(
            offset + 3,
            dataset,
            [
                Message(role="user", content="Say hi."),
                Message(role="assistant", content="Hi! (written by the source dataset)"),
                Message(role="user", content="Now say bye in French, with accents: é, à."),
            ],
            AssistantCompletion(reasoning_content="Au revoir, à bientôt.", content="Au revoir, à bientôt !"),
        ),
        _record(
            offset + 4,
            dataset,
            [Message(role="user", content="Weather in Paris?")],
            AssistantCompletion(
                content="",
                tool_calls=[
                    ToolCall(id="c1", function=FunctionCall(name="get_weather", arguments={"city": "Paris"}))
                ],
            ),
            tools=[WEATHER_TOOL],
            finish_reason="tool_calls",
        ),
        _record(
            offset + 5,
            dataset,
            [
                Message(role="user", content="Weather in Oslo?"),
                Message(
                    role="assistant",
                    content="",
                    tool_calls=[
                        ToolCall(
                            id="c2", function=FunctionCall(name="get_weather", arguments={"city": "Oslo"})
                        )
                    ],
                ),
                Message(role="tool", content='{"temp_c": -3}', tool_call_id="c2"),
            ],
            AssistantCompletion(reasoning_content="The tool says -3.", content="It is -3 °C in Oslo."),
            tools=[WEATHER_TOOL],
        ),
        _record(
            offset + 6,
            dataset,
            [Message(role="user", content="Write a long poem.")],
            AssistantCompletion(
                reasoning_content="A poem about the sea, long", content="The sea, the sea, it"
            ),
            finish_reason="length",
        ),
    ]
    for index, name in enumerate(sorted(SCRIPTS), start=offset + len(records)):
        records += converse(name, dataset=dataset, prompt_id=f"{dataset}-{index:03d}", model="qwen3")
    return records


def _write_run(store: Store, layout: RunLayout, dataset: str, offset: int) -> None:
    for shard in range(2):
        records = completions(dataset, offset + 10 * shard)
        store.write_jsonl(layout.completions(dataset, shard), records)
        store.write_jsonl(layout.failures(dataset, shard), [])
        summary = ShardSummary(
            dataset=dataset,
            shard_index=shard,
            requests=len(records),
            completions=len(records),
            failures=0,
            prompt_tokens=0,
            completion_tokens=0,
            generation_s=1.0,
            completions_path=layout.completions(dataset, shard),
            failures_path=layout.failures(dataset, shard),
        )
        store.write_json(layout.shard_done(dataset, shard), summary)


def merge_run(
    root: Path, tokenizer_dir: Path, run_id: str, dataset: str, offset: int, **tokenize: Any
) -> TokenizeSummary:
    """Write a run's finished shards of ``dataset`` and merge them (5 rows per part: several parts)."""
    store = Store(str(root))
    layout = RunLayout(run_id)
    _write_run(store, layout, dataset, offset)
    config = RunConfig.model_validate(
        {
            "run_id": run_id,
            "model": {"path": str(tokenizer_dir)},
            "datasets": [{"name": dataset, "format": "openai_messages", "path": "unused"}],
            "output": str(root),
            "tokenize": {"rows_per_part": 5, "include_truncated": True, "workers": 1, **tokenize},
        }
    )
    return merge_and_tokenize(store, layout, config)


def parquet_rows(version: DatasetVersion) -> list[tuple[list[int], list[int]]]:
    """Every row of a version, read from its Parquet parts in order with pyarrow."""
    import pyarrow.parquet as pq

    rows: list[tuple[list[int], list[int]]] = []
    for url in version.parquet_urls():
        table = pq.read_table(url, columns=["input_ids", "loss_mask"])
        rows.extend(
            zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist(), strict=True)
        )
    return rows
