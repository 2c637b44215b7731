"""Exact-token mode end to end: `datagen run` against an SGLang-like /generate server, through merge-and-tokenize.

The run is the real command in a real process (the flow on Prefect's test API, the `external` engine pointed
at tests/support/generate_server.py, which answers deterministic pseudo-random ids from the tokenizer's
vocabulary: reasoning, tool calls, stops and truncations). Then, for every Parquet row:

* the ids under ``loss_mask == 1`` are exactly the ``output_ids`` the server sent for that request, plus
  ``<|im_end|>`` when it stopped on it and the ids leave it out (docs/tokenize.md, "Exact-token rows");
* the ids before them are exactly the ``input_ids`` the server received (one prompt render for both);
* ``tokenized_from`` is ``ids``;

and the same check fails on a mask shifted by one token either way. Both Qwen templates run: Qwen3 (the
model opens its own think block, JSON tool calls) and Qwen3.6 (the template pre-fills ``<think>``, XML tool
calls), on the tiny model's vocabulary.

A dataset of on-policy conversations (``multi_turn: on_policy``) runs in the same mode: each later turn is rendered
from the target's own earlier answers as it is sent, each turn's record keeps its served ``output_ids``, and its
row passes the same check; a conversation whose first turn the template refuses fails there, unsent, and ends.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from tests.support.generate_server import SERVED_MODEL, GenerateServer, ServedAnswer
from tests.support.qwen import tokenizer_with_template

REPO = Path(__file__).resolve().parents[2]
RUN_ID = "exact-run"
FLOW_TIMEOUT_S = 400
END_OF_TURN = "<|im_end|>"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ONLY_TOOL_RESPONSE = "<tool_response>\n21 degrees\n</tool_response>"

pytestmark = pytest.mark.usefixtures("prefect_api")


TALKS = 4
TALK_TURNS = 3


def _write_prompts(directory: Path) -> tuple[Path, Path, Path]:
    chat, tools, talk = directory / "chat.jsonl", directory / "tools.jsonl", directory / "talk.jsonl"
    with chat.open("w") as handle:
        for index in range(10):
            messages: list[dict[str, Any]] = [
                {"role": "user", "content": f"Question {index}: why is the sky blue?"}
            ]
            if index % 3 == 0:
                messages.insert(0, {"role": "system", "content": "You are terse."})
            if index % 4 == 1:
                messages[-1:-1] = [
                    {"role": "user", "content": f"Earlier question {index}."},
                    {"role": "assistant", "content": "An earlier answer."},
                ]
            handle.write(json.dumps({"messages": messages}) + "\n")
        # Only a wrapped tool response, no user query: Qwen3.6's template refuses it, Qwen3's renders it.
        only_tool_response = [{"role": "user", "content": ONLY_TOOL_RESPONSE}]
        handle.write(json.dumps({"messages": only_tool_response}) + "\n")
    with tools.open("w") as handle:
        for index in range(10):
            message = {"role": "user", "content": f"What is the weather in city {index}?"}
            handle.write(json.dumps({"messages": [message], "tools": [WEATHER_TOOL]}) + "\n")
    with talk.open("w") as handle:
        # On-policy conversations; the last one opens with only a tool response (Qwen3.6 cannot render it).
        for index in range(TALKS + 1):
            messages = [{"role": "system", "content": "You are terse."}] if index % 2 == 0 else []
            for turn in range(TALK_TURNS):
                question = (
                    ONLY_TOOL_RESPONSE if index == TALKS and turn == 0 else f"Talk {index}, question {turn}?"
                )
                messages += [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": "DATASET ANSWER"},
                ]
            handle.write(json.dumps({"messages": messages}) + "\n")
    return chat, tools, talk


def _config(tmp_path: Path, tokenizer_dir: Path, url: str) -> Path:
    chat, tools, talk = _write_prompts(tmp_path)
    config = {
        "run_id": RUN_ID,
        # External servers: only the tokenizer is read here; they serve the model under their own name.
        "model": {"path": str(tokenizer_dir), "served_name": SERVED_MODEL},
        "fleet": {"engine": "external", "external_urls": [url], "max_inflight_per_server": 4},
        "sampling": {"temperature": 0.7, "max_tokens": 40},
        "datasets": [
            {
                "name": "chat",
                "format": "openai_messages",
                "path": str(chat),
                "shard_size": 4,
                "sampling": {"samples_per_prompt": 2},
            },
            {
                "name": "tools",
                "format": "openai_messages",
                "path": str(tools),
                "shard_size": 4,
                "sampling": {"enable_thinking": False},
            },
            {"name": "talk", "format": "openai_messages", "path": str(talk), "multi_turn": "on_policy"},
        ],
        "output": str(tmp_path / "out"),
        "generation": {
            "exact_tokens": True,
            "max_attempts": 4,
            "backoff_initial_s": 0.05,
            "backoff_max_s": 0.2,
            "request_timeout_s": 30,
            "checkpoint_every": 4,
            "checkpoint_interval_s": 0.5,
            # The one unrenderable prompt fails on purpose, and conversations end at answers cut at max_tokens (a
            # fifth of them) or at a turn the template refuses (the turns they never sent are not failed
            # requests): the run must still publish.
            "max_failed_share": 0.1,
        },
        "tokenize": {"rows_per_part": 16, "include_truncated": True, "workers": 1},
    }
    path = tmp_path / "exact.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _run(config: Path, tmp_path: Path, prefect_api: str) -> None:
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api,
        "DATAGEN_STATE_DIR": str(tmp_path / "state"),
        "DATAGEN_GPU_LOCK": f"exact-box-{secrets.token_hex(4)}",
        "PYTHONUNBUFFERED": "1",
    }
    log = tmp_path / "run.log"
    with log.open("wb") as handle:
        result = subprocess.run(
            [sys.executable, "-m", "flows.cli_entry", "run", "--config", str(config)],
            cwd=REPO,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            timeout=FLOW_TIMEOUT_S,
            check=False,
        )
    assert result.returncode == 0, f"datagen run failed; its output:\n{log.read_text()[-6000:]}"


def expected_loss_ids(answer: ServedAnswer, end_of_turn_id: int) -> list[int]:
    """The served ids, plus the end of turn when the server stopped on it but left it out (the documented rule)."""
    ids = list(answer.output_ids)
    if answer.finish == "stop" and (not ids or ids[-1] != end_of_turn_id):
        ids.append(end_of_turn_id)
    return ids


def check_row(input_ids: list[int], loss_mask: list[int], answer: ServedAnswer, end_of_turn_id: int) -> None:
    """Assert that a row trains exactly on what the server generated, after exactly what it was sent."""
    assert len(input_ids) == len(loss_mask) and set(loss_mask) <= {0, 1}
    trained = [token for token, bit in zip(input_ids, loss_mask, strict=True) if bit]
    assert trained == expected_loss_ids(answer, end_of_turn_id), "loss-masked ids differ from the served ids"
    first = loss_mask.index(1)
    assert input_ids[:first] == answer.input_ids, "the row's prompt differs from the ids sent to /generate"
    assert all(loss_mask[first:]), "the trained tokens are not one run to the end of the row"


def _key(record: dict[str, Any]) -> str:
    """A record's request key, as the server saw it in the ``rid``."""
    turn = record.get("turn")
    return f"{record['prompt_id']}/{record['sample_index']}" + ("" if turn is None else f"/{turn}")


def _answer_of(row: dict[str, Any], served: dict[str, list[ServedAnswer]]) -> ServedAnswer:
    """The served answer a row was made from: of its prompt sample, the one whose prompt ids the row begins with.

    Rows carry no turn: a conversation's turns share the prompt id and are told apart by their prompts.
    """
    prefix = row["input_ids"][: row["loss_mask"].index(1)]
    sample = f"{row['prompt_id']}/{row['sample_index']}"
    (answer,) = [
        answers[-1]
        for key, answers in served.items()
        if sample in (key, key.rsplit("/", 1)[0]) and answers[-1].input_ids == prefix
    ]
    return answer


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("template", ["qwen3", "qwen3.6"])
def test_an_exact_token_run_trains_on_exactly_the_output_ids_the_server_sent(
    tmp_path: Path, tiny_model_dir: Path, prefect_api: str, template: str
) -> None:
    tokenizer_dir = tokenizer_with_template(tiny_model_dir, tmp_path / "tokenizer", template)
    with GenerateServer(tokenizer_dir, seed=11, omit_stop_share=0.25) as server:
        _run(_config(tmp_path, tokenizer_dir, server.url), tmp_path, prefect_api)
        end_of_turn_id = server.ids[END_OF_TURN]
        served = server.answers_by_key()
        assert server.generate_requests() and not server.chat_requests()

    run_root = tmp_path / "out" / "runs" / RUN_ID
    completions = {
        _key(row): row
        for path in sorted((run_root / "completions").rglob("*.jsonl"))
        for row in _read_jsonl(path)
    }
    failures = [row for path in sorted((run_root / "failures").rglob("*.jsonl")) for row in _read_jsonl(path)]
    assert len(completions) + len(failures) == 11 * 2 + 10 + (TALKS + 1) * TALK_TURNS
    single = [(row["error_type"], row["attempts"]) for row in failures if row["dataset"] != "talk"]
    ended = sorted((row["turn"], row["error_type"]) for row in failures if row["dataset"] == "talk")
    if template == "qwen3.6":
        # The template refuses the prompt without a user query: its two samples fail without being sent; so does
        # the conversation opening with one, its later turns ended with it.
        assert single == [("unrenderable_prompt", 0)] * 2
        assert (0, "unrenderable_prompt") in ended
        assert not any("21 degrees" in server.decode(answer.input_ids) for (answer, *_) in served.values())
    else:
        assert single == []
        assert any(
            row["turn"] == 0 and row["messages"][-1]["content"] == ONLY_TOOL_RESPONSE
            for row in completions.values()
        ), "Qwen3 renders the conversation opening with a tool response"
    assert {kind for _, kind in ended} <= {"unrenderable_prompt", "conversation_ended"}
    assert all(turn > 0 for turn, kind in ended if kind == "conversation_ended")

    for key, record in completions.items():
        answers = served[key]
        assert all(answer.output_ids == answers[0].output_ids for answer in answers)
        answer = answers[-1]
        assert record["completion"]["output_token_ids"] == answer.output_ids
        assert record["completion"]["reasoning_content"] == answer.reasoning
        calls = record["completion"]["tool_calls"] or []
        assert [call["function"] for call in calls] == ([answer.tool_call] if answer.tool_call else [])
        if record["turn"]:
            # A later turn was rendered from the target's own answer of the turn before, as its record holds it.
            before = completions[f"{record['prompt_id']}/{record['sample_index']}/{record['turn'] - 1}"]
            said = record["messages"][-2]
            assert record["messages"][:-2] == before["messages"] and said["role"] == "assistant"
            assert said["content"] == before["completion"]["content"]
            assert said.get("reasoning_content") == before["completion"]["reasoning_content"]
            # As the template renders an earlier assistant turn (Qwen3.6 trims its content).
            assert before["completion"]["content"].strip() in server.decode(answer.input_ids)
    assert any(record["turn"] == TALK_TURNS - 1 for record in completions.values()), "conversations went on"

    rows = [
        row
        for part in sorted((run_root / "tokenized").glob("part-*.parquet"))
        for row in pq.read_table(part).to_pylist()
    ]
    answered = [_answer_of(row, served) for row in rows]
    assert sorted(answer.key for answer in answered) == sorted(completions), "one row per completion"
    for row, answer in zip(rows, answered, strict=True):
        assert row["tokenized_from"] == "ids"
        check_row(row["input_ids"], row["loss_mask"], answer, end_of_turn_id)
    finishes = {row["finish_reason"] for row in rows}
    assert {"stop", "length"} <= finishes and "tool_calls" in finishes
    assert any(
        answer.output_ids[-1] != end_of_turn_id and answer.finish == "stop"
        for (answer, *_) in served.values()
    ), "some stopped answers leave the stop token out of their ids (the end-of-turn rule is exercised)"

    # The check is sharp: the same rows with the mask shifted by one token either way fail it.
    for row, answer in list(zip(rows, answered, strict=True))[:8]:
        mask = row["loss_mask"]
        for shifted in ([0, *mask[:-1]], [*mask[1:], 0]):
            with pytest.raises(AssertionError):
                check_row(row["input_ids"], shifted, answer, end_of_turn_id)
