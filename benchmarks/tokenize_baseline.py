"""The obvious way to tokenize completions for drafter training, as a user would write it without datagen.

Per batch: parse the JSON lines, render every conversation twice with ``apply_chat_template`` (the prompt with
the generation prompt, then prompt + answer), tokenize the full renders in one batched call with character
offsets, and mask the tokens that overlap the answer region (from the end of the prompt render through the
closing ``<|im_end|>``; not that token when the answer was truncated). Same filters as datagen (truncated and
empty completions dropped). Used by ``bench_tokenize.py`` through ``datasets.map`` and ``multiprocessing.Pool``.
"""

from __future__ import annotations

import json
from typing import Any

END_OF_TURN = "<|im_end|>"
ENDED = {"stop", "tool_calls"}

_tokenizer: Any = None


def load(path: str) -> Any:
    """Load (once per process) the tokenizer at ``path``."""
    global _tokenizer
    if _tokenizer is None:
        from transformers import AutoTokenizer

        _tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return _tokenizer


def _assistant(completion: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": completion.get("content") or ""}
    if completion.get("reasoning_content"):
        message["reasoning_content"] = completion["reasoning_content"]
    if completion.get("tool_calls"):
        message["tool_calls"] = [
            {key: value for key, value in call.items() if value is not None}
            for call in completion["tool_calls"]
        ]
    return message


def _message(raw: dict[str, Any]) -> dict[str, Any]:
    message = {"role": raw["role"], "content": raw.get("content") or ""}
    for key in ("reasoning_content", "tool_call_id", "name"):
        if raw.get(key):
            message[key] = raw[key]
    if raw.get("tool_calls"):
        message["tool_calls"] = [
            {key: value for key, value in call.items() if value is not None} for call in raw["tool_calls"]
        ]
    return message


def tokenize_lines(tokenizer_path: str, lines: list[str]) -> dict[str, list[Any]]:
    """Rows (columns) for a batch of completion JSON lines.

    Args:
        tokenizer_path: The tokenizer folder.
        lines: Completion records, one JSON document each.

    Returns:
        Columns ``input_ids``, ``loss_mask``, ``prompt_id``, ``sample_index``, ``dataset``, ``num_tokens``,
        ``num_loss_tokens``, ``finish_reason``.

    """
    tokenizer = load(tokenizer_path)
    prompts: list[str] = []
    fulls: list[str] = []
    kept: list[dict[str, Any]] = []
    for line in lines:
        record = json.loads(line)
        completion = record["completion"]
        if record["finish_reason"] == "length":
            continue
        if not (completion.get("content") or "").strip() and not completion.get("tool_calls"):
            continue
        messages = [_message(message) for message in record["messages"]]
        extra: dict[str, Any] = {}
        thinking = record["sampling"].get("enable_thinking")
        if thinking is not None:
            extra["enable_thinking"] = thinking
        tools = record.get("tools") or None
        prompt = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False, **extra
        )
        full = tokenizer.apply_chat_template(
            [*messages, _assistant(completion)], tools=tools, tokenize=False, **extra
        )
        prompts.append(prompt)
        fulls.append(full)
        kept.append(record)
    columns: dict[str, list[Any]] = {
        name: []
        for name in (
            "input_ids",
            "loss_mask",
            "prompt_id",
            "sample_index",
            "dataset",
            "num_tokens",
            "num_loss_tokens",
            "finish_reason",
        )
    }
    if not fulls:
        return columns
    encoded = tokenizer(fulls, add_special_tokens=False, return_offsets_mapping=True)
    for record, prompt, full, ids, offsets in zip(
        kept, prompts, fulls, encoded["input_ids"], encoded["offset_mapping"], strict=True
    ):
        start = len(prompt)
        end = full.rfind(END_OF_TURN)
        if record["finish_reason"] in ENDED:
            end += len(END_OF_TURN)
        mask = [1 if a < end and b > start else 0 for a, b in offsets]
        columns["input_ids"].append(ids)
        columns["loss_mask"].append(mask)
        columns["prompt_id"].append(record["prompt_id"])
        columns["sample_index"].append(record.get("sample_index", 0))
        columns["dataset"].append(record["dataset"])
        columns["num_tokens"].append(len(ids))
        columns["num_loss_tokens"].append(sum(mask))
        columns["finish_reason"].append(record["finish_reason"])
    return columns
