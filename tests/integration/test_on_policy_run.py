"""Whole `datagen run`s of on-policy conversations against a stand-in server, SIGKILLed mid-conversation.

The stand-in answers every request with a text no other request gets (the question plus a serial number), so
a history can only hold an answer if that very answer was stored. The run is killed (the process group,
SIGKILL) twice, each time once more turns past the first are stored, then run again to the end. Then, from the stored records
alone: every turn of every conversation is stored exactly once; each turn's request held the system prompt,
then for each earlier turn the target's stored answer and the dataset's next user turn (never the dataset's own
answers); the server saw each conversation's turns in order; conversations interleaved on the server; the
conversation whose second turn the server refuses ends there, its last turn counted as `conversation_ended`.

Two conversations meet a failing server at a later turn (HTTP 500 on every try: a failure worth sending again),
which ends the run Failed (its failed share); `--retry-failed` then resumes each from its turns stored in the first
round: the failed turn and the turns its failure ended are sent once each, nothing stored is sent again, and their
histories hold the target's own earlier answers. The run's preflight priced exactly the turns the run sent.

A second dataset in the Hermes function-calling layout has tool conversations: where the target's call equals the
dataset's, the recorded result is spliced in after it and the conversation goes on; where it does not, the
conversation ends at the call, its unsent turns counted as `tool_call_diverged`.

The same stored turns, merged again with `tokenize.conversation_rows: per_conversation`, make one row per
conversation (its last stored turn, one loss run per assistant turn), every stored turn counted once.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from datagen.app.preview import CostPreview
from datagen.records import CompletionRecord, FailureRecord
from tests.support.fault_server import FaultPlan, FaultServer

CONVERSATIONS = 16
USER_TURNS = 3
# The conversation whose second user turn the server refuses (HTTP 400, not retried).
REFUSED = 5
# (conversation, turn) whose question fails with HTTP 500 until the retry round (retries exhausted: sent again).
FLAKY = {(9, 1), (12, 2)}
FLOW_TIMEOUT_S = 300
KILLS = 2
LATER_TURNS_PER_ATTEMPT = 4
GENERATION_START_TIMEOUT_S = 180

pytestmark = pytest.mark.usefixtures("prefect_api")


class _SerialServer(FaultServer):
    """Answers ``echo: <question> #<serial>``: no two answers alike, so a history shows which answer it holds."""

    def __init__(self, plan: FaultPlan) -> None:
        super().__init__(plan)
        self._serials = itertools.count()
        self._serial_lock = threading.Lock()
        # While set, a question marked #flaky is answered HTTP 500 on every try.
        self.flaky = True

    def _choose_fault(self, body: dict[str, Any] | None) -> str:
        fault = super()._choose_fault(body)
        return "500" if self.flaky and "#flaky" in self._content(body) else fault

    def _success(self, fault: str, body: dict[str, Any], content: str) -> dict[str, Any]:
        answer = super()._success(fault, body, content)
        with self._serial_lock:
            serial = next(self._serials)
        message = answer["choices"][0]["message"]
        if message["content"] is not None:  # a tool call has no text
            message["content"] += f" #{serial}"
        return answer


def _question(conversation: int, turn: int) -> str:
    # Refused on every attempt the run may make of it (the stand-in counts attempts by question).
    refuse = " [[400,400,400,400]]" if conversation == REFUSED and turn == 1 else ""
    flaky = " #flaky" if (conversation, turn) in FLAKY else ""
    return f"Conversation {conversation:02d}, question {turn}?{refuse}{flaky}"


def _write_dataset(path: Path) -> Path:
    rows = []
    for conversation in range(CONVERSATIONS):
        messages: list[dict[str, Any]] = [{"role": "system", "content": f"You are bot {conversation}."}]
        for turn in range(USER_TURNS):
            messages.append({"role": "user", "content": _question(conversation, turn)})
            messages.append({"role": "assistant", "content": f"DATASET ANSWER {conversation}/{turn}"})
        rows.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(rows) + "\n")
    return path


WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
HERMES_SYSTEM = "You may call functions.\n<tools>\n{tools}\n</tools>\nCall them in <tool_call> tags."
TOOL_ROWS = 4
# The row whose dataset called the tool for another city than the target will (the stand-in calls Paris).
DIVERGING = 3


def _write_tool_dataset(path: Path) -> Path:
    """Hermes rows: ask (the stand-in answers `#toolcall` with get_weather Paris), the call, its result, a thank-you."""
    rows = []
    for row in range(TOOL_ROWS):
        city = "London" if row == DIVERGING else "Paris"
        call = json.dumps({"name": "get_weather", "arguments": {"city": city}})
        rows.append(
            {
                "id": f"fc-{row}",
                "conversations": [
                    {"from": "system", "value": HERMES_SYSTEM.format(tools=json.dumps(WEATHER_TOOLS))},
                    {"from": "human", "value": f"Weather for trip {row}? #toolcall"},
                    {"from": "gpt", "value": f"<tool_call>\n{call}\n</tool_call>"},
                    {
                        "from": "tool",
                        "value": f"<tool_response>\nsunny in {city} (row {row})\n</tool_response>",
                    },
                    {"from": "gpt", "value": "DATASET ANSWER: sunny."},
                    {"from": "human", "value": f"Thanks for trip {row}."},
                    {"from": "gpt", "value": "DATASET ANSWER: welcome."},
                ],
                "category": "Weather",
            }
        )
    path.write_text(json.dumps(rows))
    return path


def _config(tmp_path: Path, server_url: str, model_dir: Path) -> Path:
    config = {
        "run_id": "onpolicy-1",
        "model": {"path": str(model_dir)},
        "fleet": {"engine": "external", "external_urls": [server_url], "max_inflight_per_server": 6},
        "sampling": {"temperature": 0.7, "max_tokens": 8},
        "datasets": [
            {
                "name": "chat",
                "format": "openai_messages",
                "path": str(_write_dataset(tmp_path / "chat.jsonl")),
                "shard_size": 8,
                "multi_turn": "on_policy",
            },
            {
                "name": "fc",
                "format": "hermes_fc",
                "path": str(_write_tool_dataset(tmp_path / "fc.json")),
                "shard_size": 8,
                "multi_turn": "on_policy",
            },
        ],
        "output": str(tmp_path / "out"),
        "protected_prefixes": [str(tmp_path / "train")],
        "generation": {
            "checkpoint_every": 4,
            "checkpoint_interval_s": 0.2,
            "backoff_initial_s": 0.05,
            # The failed share counts sent turns: the one 400 (1 of 57; the turns its conversation and the
            # diverged calls ended are not sent) passes; with the 2 flaky turns (3 of 56) the run fails.
            "max_failed_share": 0.03,
        },
        "training": {"kind": "none"},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _start(config: Path, tmp_path: Path, prefect_api: str, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api,
        "DATAGEN_STATE_DIR": str(tmp_path / "state"),
        # A SIGKILLed attempt cannot release its GPU lock: each attempt stands for its own box.
        "DATAGEN_GPU_LOCK": f"onpolicy-box-{time.monotonic_ns()}",
        "PYTHONUNBUFFERED": "1",
    }
    with log.open("ab") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "flows.cli_entry", "run", "--config", str(config), *extra],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stored_later_turns(run_root: Path) -> int:
    count = 0
    for part in run_root.glob("parts/**/completions-*.jsonl"):
        count += sum(1 for line in part.read_text().splitlines() if line and json.loads(line)["turn"])
    return count


def _records(run_root: Path, kind: str) -> list[dict[str, Any]]:
    """Every completion of every round; with ``failures``, those of each shard's latest round (still standing)."""
    files = sorted((run_root / kind).rglob("*.jsonl"))
    if kind == "failures":
        # <dataset>/shard-NNNNN[.retry-RRRR].jsonl, sorted: a shard's latest round comes last.
        latest = {(file.parent, file.name.split(".")[0]): file for file in files}
        files = [latest[shard] for shard in sorted(latest)]
    return [json.loads(line) for file in files for line in file.read_text().splitlines() if line]


def test_on_policy_conversations_are_answered_turn_by_turn_exactly_once_through_sigkills(
    tmp_path: Path, prefect_api: str, tiny_model_dir: Path
) -> None:
    log = tmp_path / "flow.log"
    run_root = tmp_path / "out" / "runs" / "onpolicy-1"
    with _SerialServer(FaultPlan(base_delay_s=0.15)) as server:
        config = _config(tmp_path, server.url, tiny_model_dir)
        marks = [0]
        for _ in range(KILLS):
            # Each attempt is killed once it stored a few more later turns than the attempts before it.
            target = _stored_later_turns(run_root) + LATER_TURNS_PER_ATTEMPT
            process = _start(config, tmp_path, prefect_api, log)
            try:
                deadline = time.monotonic() + GENERATION_START_TIMEOUT_S
                while _stored_later_turns(run_root) < target:
                    assert process.poll() is None, log.read_text()[-4000:]
                    assert time.monotonic() < deadline, "no later turn was stored in time"
                    time.sleep(0.05)
            finally:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            marks.append(len(server.chat_requests()))
            stored_at_kill: dict[str, set[int]] = defaultdict(set)
            for part in run_root.glob("parts/**/completions-*.jsonl"):
                for line in part.read_text().splitlines():
                    if line:
                        row = json.loads(line)
                        stored_at_kill[row["prompt_id"]].add(row["turn"])
            assert any(len(turns) < USER_TURNS for turns in stored_at_kill.values()), (
                "killed mid-conversation"
            )
        resumed = _start(config, tmp_path, prefect_api, log)
        assert resumed.wait(FLOW_TIMEOUT_S) == 1, log.read_text()[-4000:]
        # The advice counts the turns the retry round sends: the two flaky turns and the one they ended.
        assert "send the 3 failed requests worth sending again" in log.read_text()[-3000:], log.read_text()[
            -4000:
        ]
        first_round = {(f["prompt_id"], f["turn"]): f for f in _records(run_root, "failures")}
        marks.append(len(server.chat_requests()))
        # The server is fixed: the retry round sends the flaky turns and the turns their failures ended.
        server.flaky = False
        retried = _start(config, tmp_path, prefect_api, log, "--retry-failed")
        assert retried.wait(FLOW_TIMEOUT_S) == 0, log.read_text()[-4000:]
        # The progress counts every turn as a request, and the conversations beside them.
        final = [line for line in log.read_text().splitlines() if "progress 100.0%" in line][-1]
        planned = (CONVERSATIONS + TOOL_ROWS) * USER_TURNS
        assert f"{planned}/{planned} answered · {CONVERSATIONS + TOOL_ROWS}/" in final, final
        seen = [request.body for request in server.chat_requests() if request.body is not None]
        max_in_flight = server.max_in_flight
    assert marks[-2] < marks[-1], "the resumed run sent the turns still to do"
    kinds = sorted(f["error_type"] for f in first_round.values() if f["dataset"] == "chat")
    assert kinds[:3] == ["conversation_ended", "conversation_ended", "http_400"], kinds
    assert len(kinds) == 5 and set(kinds[3:]) <= {"retries_exhausted", "repeated_internal_error"}, kinds
    resent = sorted(
        (
            int(body["messages"][1]["content"].split()[1].rstrip(",")),
            sum(m["role"] == "user" for m in body["messages"]) - 1,
        )
        for body in seen[marks[-1] :]
    )
    # Each flaky turn once, then conversation 9's last turn (its failure had ended it); nothing stored again.
    assert resent == [(9, 1), (9, 2), (12, 2)], resent

    records = [CompletionRecord.model_validate(row) for row in _records(run_root, "completions")]
    errors = [FailureRecord.model_validate(row) for row in _records(run_root, "failures")]
    keys = [record.key for record in [*records, *errors]]
    assert len(keys) == len(set(keys)) == (CONVERSATIONS + TOOL_ROWS) * USER_TURNS, "every turn stored once"
    _check_tool_conversations(
        [r for r in records if r.dataset == "fc"], [f for f in errors if f.dataset == "fc"]
    )
    completions = [record for record in records if record.dataset == "chat"]
    failures = [failure for failure in errors if failure.dataset == "chat"]
    assert {(f.turn, f.error_type) for f in failures} == {(1, "http_400"), (2, "conversation_ended")}
    assert {f.reason for f in failures if f.turn == 2} == {"turn 1 failed: http_400"}

    by_conversation: dict[str, dict[int, CompletionRecord]] = defaultdict(dict)
    for record in completions:
        assert record.turn is not None
        by_conversation[record.prompt_id][record.turn] = record
    assert len(by_conversation) == CONVERSATIONS
    for turns in by_conversation.values():
        first = turns[0]
        system, question = first.messages
        assert system.role == "system" and question.role == "user"
        conversation = int(question.content.split()[1].rstrip(","))  # type: ignore[union-attr]
        expected = [system.model_dump(), question.model_dump()]
        assert [m.model_dump() for m in first.messages] == expected
        for turn in range(1, USER_TURNS):
            if turn not in turns:
                assert conversation == REFUSED and turn >= 1
                break
            earlier = turns[turn - 1]
            # The history holds the target's stored answer of the turn before, then the dataset's next user turn.
            assert earlier.completion.content is not None and "#" in earlier.completion.content
            expected += [
                {
                    **earlier.messages[0].model_dump(),
                    "role": "assistant",
                    "content": earlier.completion.content,
                },
                {**question.model_dump(), "content": _question(conversation, turn)},
            ]
            assert [m.model_dump() for m in turns[turn].messages] == expected
        assert "DATASET ANSWER" not in json.dumps([r.model_dump(mode="json") for r in turns.values()])

    # The server saw each conversation's turns in order (a turn's request is sent after the one before landed).
    # Within each attempt (after a kill, a turn that landed but was not stored is sent again, before its next);
    # the retry round's turns each came after the answers of the first round, their history.
    bounds = [*marks, len(seen)]
    for attempt in (seen[start:end] for start, end in itertools.pairwise(bounds)):
        turn_seen: dict[str, list[int]] = defaultdict(list)
        for body in attempt:
            asked = body["messages"][1]["content"]
            turn_seen[asked].append(sum(m["role"] == "assistant" for m in body["messages"]))
        for order in turn_seen.values():
            assert order == sorted(order), order
    assert max_in_flight > 1, "conversations interleave on the server"
    report = json.loads((run_root / "report.json").read_text())
    assert report["totals"]["failure_reasons"] == {
        "http_400": 1,
        "conversation_ended": 1,
        "tool_call_diverged": 2,
    }
    # Every turn the target answered is a training row of its own (its history, loss on its answer).
    assert report["totals"]["tokenized_rows"] == len(records)
    totals = report["totals"]
    assert (totals["conversations"], totals["conversations_completed"]) == (CONVERSATIONS + TOOL_ROWS, 18)
    assert "- on-policy conversations: **20**" in (run_root / "report.md").read_text()
    # The preview each attempt's preflight showed priced the turns the run planned, conversation by conversation.
    for preflight in sorted(run_root.glob("attempts/*/preflight.json")):
        shown = json.loads(preflight.read_text())["preview"]
        assert shown is not None, f"{preflight}: no preview"
        preview = CostPreview.model_validate(shown)
        assert {(d.dataset, d.conversations, d.requests) for d in preview.datasets} == {
            ("chat", CONVERSATIONS, CONVERSATIONS * USER_TURNS),
            ("fc", TOOL_ROWS, TOOL_ROWS * USER_TURNS),
        }
        assert preview.requests == len(keys) and preview.complete
    _check_conversation_rows(config, tmp_path / "out", records)


def _check_conversation_rows(config_path: Path, output: Path, records: list[CompletionRecord]) -> None:
    """The same stored turns merged with `tokenize.conversation_rows: per_conversation`: a row per conversation.

    A row per conversation and completions file (the retry round's file holds the turns it sent): each row is the
    file's last stored turn of its conversation rendered whole, trained on the target's turns stored in that file,
    so every stored turn is counted once and trained once.
    """
    import pyarrow.parquet as pq

    from datagen.config import load_run_config
    from datagen.dataset.merge import merge_and_tokenize
    from datagen.output.layout import RunLayout
    from datagen.output.store import Store

    store, stored = Store(str(output)), RunLayout("onpolicy-1")
    layout = RunLayout("onpolicy-1-whole")
    files: dict[tuple[str, str], set[str]] = defaultdict(set)
    for folder in store.list_level(stored.completions_prefix).folders:
        for key in store.list_level(folder).objects:
            shard = stored.parse_completions(key)
            assert shard is not None
            store.write_bytes(layout.completions(*shard), store.read_bytes(key))
            store.write_bytes(layout.shard_done(*shard), store.read_bytes(stored.shard_done(*shard)))
            for line in store.read_bytes(key).splitlines():
                record = CompletionRecord.model_validate_json(line)
                files[(record.dataset, record.prompt_id)].add(key)
    overrides = {"run_id": "onpolicy-1-whole", "tokenize": {"conversation_rows": "per_conversation"}}
    config = load_run_config(config_path, overrides)
    summary = merge_and_tokenize(store, layout, config)
    turns: dict[tuple[str, str], int] = defaultdict(int)
    for record in records:
        turns[(record.dataset, record.prompt_id)] += 1
    assert len(turns) == CONVERSATIONS + TOOL_ROWS
    expected_rows = sum(len(keys) for keys in files.values())
    assert expected_rows > len(turns), "the retried conversations have turns in the retry round's file"
    assert (summary.completions_read, summary.rows) == (len(records), expected_rows)
    assert summary.turns_in_conversation_rows == len(records) - expected_rows
    assert summary.dropped_by_reason == {}
    trained: dict[tuple[str, str], int] = defaultdict(int)
    rows_of: dict[tuple[str, str], int] = defaultdict(int)
    for row in (row for part in summary.parts for row in pq.read_table(part.url).to_pylist()):
        conversation = (row["dataset"], row["prompt_id"])
        rows_of[conversation] += 1
        # One loss run per assistant turn the row trains.
        trained[conversation] += sum(
            1
            for index, bit in enumerate(row["loss_mask"])
            if bit and (index == 0 or not row["loss_mask"][index - 1])
        )
    assert rows_of == {conversation: len(keys) for conversation, keys in files.items()}
    assert trained == turns, "every stored turn trained exactly once"


def _check_tool_conversations(completions: list[CompletionRecord], failures: list[FailureRecord]) -> None:
    """Matching calls get the recorded result spliced in and go on; the diverging one ends at its call."""
    assert {(f.turn, f.error_type) for f in failures} == {
        (1, "tool_call_diverged"),
        (2, "tool_call_diverged"),
    }
    assert all("called get_weather where the dataset called get_weather" in f.reason for f in failures)
    by_conversation: dict[str, dict[int, CompletionRecord]] = defaultdict(dict)
    for record in completions:
        assert record.turn is not None
        by_conversation[record.prompt_id][record.turn] = record
    assert sorted(len(turns) for turns in by_conversation.values()) == [1, 3, 3, 3]
    for turns in by_conversation.values():
        call = turns[0].completion.tool_calls
        assert (
            turns[0].finish_reason == "tool_calls"
            and call
            and call[0].function.arguments == {"city": "Paris"}
        )
        if len(turns) == 1:
            continue
        assert turns[1].messages[:-1] == [*turns[0].messages, turns[1].messages[-2]]
        called, result = turns[1].messages[-2:]
        assert called.role == "assistant" and called.tool_calls == call, "the target's own call"
        assert result.role == "tool" and result.content is not None and "sunny in Paris" in result.content
        assert turns[2].messages[-1].content is not None and turns[2].messages[-1].content.startswith(
            "Thanks"
        )
        assert turns[2].messages[-2].content == turns[1].completion.content
