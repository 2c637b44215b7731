"""The cost preview: prompts from the mix, answer lengths and rate from the box's history, hours and GPU-hours."""

from __future__ import annotations

import datetime as dt
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from datagen.app.history import BoxRecord, DatasetAnswers, append_record, plan_key, read_history, tune_record
from datagen.app.preview import (
    ASSUMED_ANSWER_SHARE_OF_MAX_TOKENS,
    DEFAULT_FLEET_START_S,
    DEFAULT_TRAINING_HALT_S,
    DEFAULT_TRAINING_RESTART_S,
    PLANNER_OUTPUT_TOKENS_PER_S_PER_GPU,
    count_prompts_and_turns,
    estimate_cost,
)
from datagen.config import RunConfig, parse_run_config
from datagen.engines.tune_result import TunePoint, TuneResult

MODEL = "/models/qwen"


def config(**extra: Any) -> RunConfig:
    return parse_run_config(
        {
            "model": {"path": MODEL},
            "fleet": {"engine": "sglang"},
            "sampling": {"max_tokens": 4096},
            "mix": {"total_prompts": 1000},
            "datasets": [
                {"name": "chat", "format": "metamath", "path": "/d/chat.json", "share": 0.6},
                {
                    "name": "math",
                    "format": "metamath",
                    "path": "/d/math.json",
                    "share": 0.4,
                    "sampling": {"max_tokens": 2048, "samples_per_prompt": 2},
                },
            ],
            "output": "/out",
            # A box whose training job is halted for the run and started again after it.
            "training": {
                "kind": "pidfile",
                "pidfile": "/run/trainer.pid",
                "restart_after_run": True,
                "restart_command": ["true"],
            },
            **extra,
        }
    )


def run_record(
    rate: float,
    *,
    model: str = MODEL,
    chat: tuple[int, int] = (100, 150_000),
    day: int = 1,
    fleet_start_s: float = 300.0,
) -> BoxRecord:
    return BoxRecord(
        kind="run",
        recorded_at=dt.datetime(2026, 1, day, tzinfo=dt.UTC),
        model=model,
        engine="sglang",
        plan=plan_key("dp", 8, 1),
        gpus=8,
        output_tokens_per_s=rate,
        answers={"chat": DatasetAnswers(completions=chat[0], output_tokens=chat[1], max_tokens=4096)},
        training_halt_s=60.0,
        fleet_start_s=fleet_start_s,
        fleet_stop_s=10.0,
        training_restart_s=30.0,
    )


def test_first_preview_uses_the_mix_quotas_max_tokens_and_the_planner_rate_marked_as_such() -> None:
    preview = estimate_cost(config(), [], gpus=8)

    assert [(item.dataset, item.prompts) for item in preview.datasets] == [("chat", 600), ("math", 400)]
    assert preview.rate_source == "planner"
    assert preview.output_tokens_per_s == pytest.approx(8 * PLANNER_OUTPUT_TOKENS_PER_S_PER_GPU)
    assert "planner's estimate" in preview.lines()[3]
    assert preview.lines()[1] == "requests: 1,400"
    expected_tokens = ASSUMED_ANSWER_SHARE_OF_MAX_TOKENS * (600 * 4096 + 400 * 2 * 2048)
    assert preview.output_tokens == pytest.approx(expected_tokens)
    assert not preview.overheads.measured
    assert preview.overheads.fleet_start_s == DEFAULT_FLEET_START_S
    paused = expected_tokens / preview.output_tokens_per_s + preview.overheads.total_s
    assert preview.training_paused_s == pytest.approx(paused)
    assert preview.gpu_hours == pytest.approx(8 * paused / 3600)


def test_steps_a_run_skips_cost_nothing_and_the_others_keep_their_defaults() -> None:
    external = config(
        fleet={"engine": "external", "external_urls": ["http://127.0.0.1:30000"]},
        training={"kind": "none", "restart_after_run": True, "restart_command": ["true"]},
    )

    overheads = estimate_cost(external, [], gpus=0).overheads

    # Nothing launched, nothing halted: only the restart it was asked for (a default: no history).
    assert (overheads.fleet_start_s, overheads.fleet_stop_s, overheads.training_halt_s) == (0.0, 0.0, 0.0)
    assert overheads.training_restart_s == DEFAULT_TRAINING_RESTART_S
    assert overheads.total_s == DEFAULT_TRAINING_RESTART_S
    # What this box measured for its external servers (checking they answer) counts; a trainer's halt does not.
    checked = run_record(500.0).model_copy(update={"engine": "external", "fleet_start_s": 1.5})
    measured = estimate_cost(external, [checked], gpus=0).overheads
    assert (measured.fleet_start_s, measured.fleet_stop_s, measured.training_halt_s) == (1.5, 10.0, 0.0)
    halted = config(training={"kind": "pidfile", "pidfile": "/run/trainer.pid"})
    launched = estimate_cost(halted, [], gpus=8).overheads
    assert (
        launched.training_halt_s == DEFAULT_TRAINING_HALT_S
        and launched.fleet_start_s == DEFAULT_FLEET_START_S
    )
    assert launched.training_restart_s == 0.0  # restart_after_run is off: training is not started again


def test_history_of_the_same_model_gives_the_rate_answer_lengths_and_overheads() -> None:
    history = [
        run_record(9000.0, day=1, fleet_start_s=200.0),
        run_record(10000.0, day=2, fleet_start_s=400.0),
        run_record(11000.0, day=3, fleet_start_s=300.0),
        run_record(99999.0, model="/models/other", chat=(10, 40_000), day=4),
    ]

    preview = estimate_cost(config(), history)

    assert preview.rate_source == "measured"
    assert preview.output_tokens_per_s == pytest.approx(10000.0)  # the median, the other model left out
    assert preview.gpus == 8  # the last run's fleet
    chat, math = preview.datasets
    assert (chat.mean_answer_tokens, chat.answer_source) == (pytest.approx(1500.0), "measured")
    assert (math.answer_source, math.mean_answer_tokens) == (
        "assumed",
        ASSUMED_ANSWER_SHARE_OF_MAX_TOKENS * 2048,
    )
    assert preview.overheads.measured
    assert preview.overheads.fleet_start_s == pytest.approx(300.0)
    assert preview.overheads.total_s == pytest.approx(60 + 300 + 10 + 30)


def test_prepared_counts_replace_the_quotas_and_a_dataset_without_quota_is_a_lower_bound() -> None:
    unbounded = parse_run_config(
        {
            "model": {"path": MODEL},
            "datasets": [
                {"name": "chat", "format": "metamath", "path": "/d/chat.json"},
                {"name": "math", "format": "metamath", "path": "/d/math.json"},
            ],
            "output": "/out",
        }
    )

    bound = estimate_cost(unbounded, [], gpus=1)
    exact = estimate_cost(unbounded, [], gpus=1, prompts_by_dataset={"chat": 10, "math": 5})

    assert not bound.complete and bound.output_tokens == 0
    assert "at least" in bound.lines()[0]
    assert exact.complete and exact.prompts == 15


def test_history_records_are_appended_by_concurrent_writers_and_read_back_whole(tmp_path: Path) -> None:
    def write(index: int) -> None:
        append_record(tmp_path, run_record(1000.0 + index))

    threads = [threading.Thread(target=write, args=(index,)) for index in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    (tmp_path / "history" / "garbage.json").write_text("{not json")

    records = read_history(tmp_path)

    assert sorted(record.output_tokens_per_s for record in records) == [1000.0 + index for index in range(16)]
    assert not [path for path in (tmp_path / "history").iterdir() if path.name.endswith(".tmp")]


def test_a_tune_of_the_served_name_gives_the_rate_when_no_run_measured_one() -> None:
    tuned = TuneResult(
        engine="sglang",
        urls=["http://a", "http://b"],
        max_tokens=512,
        best_inflight_per_server=64,
        best_output_tokens_per_s=7000.0,
        curve=[
            TunePoint(
                inflight_per_server=64,
                requests=10,
                output_tokens=5000,
                wall_s=1.0,
                output_tokens_per_s=7000.0,
            )
        ],
        measured_with="client",
    )
    served = config(model={"path": MODEL, "served_name": "qwen"})

    preview = estimate_cost(served, [tune_record(tuned, "qwen")], gpus=2)

    assert (preview.rate_source, preview.output_tokens_per_s) == ("measured", 7000.0)
    assert "tune" in preview.rate_detail


def test_the_paused_time_beyond_the_measured_steps_is_an_overhead_of_its_own() -> None:
    record = run_record(1000.0).model_copy(update={"training_paused_s": 1000.0, "generation_wall_s": 500.0})

    preview = estimate_cost(config(), [record])

    # 1000 s paused = 500 s generating + 60 halt + 300 start + 10 stop + 30 restart + 100 s of the rest.
    assert preview.overheads.other_s == 100.0
    assert preview.overheads.total_s == 500.0


def test_an_on_policy_dataset_is_priced_per_turn_from_its_own_conversations(tmp_path: Path) -> None:
    # Conversations of 2, 3 and 4 user turns, each ending with the dataset's answer (dropped: the target answers).
    rows = []
    for user_turns in (2, 3, 4):
        messages = [{"role": "system", "content": f"bot {user_turns}"}]
        for turn in range(user_turns):
            messages += [
                {"role": "user", "content": f"question {user_turns}/{turn}"},
                {"role": "assistant", "content": f"answer {user_turns}/{turn}"},
            ]
        rows.append(json.dumps({"messages": messages}))
    (tmp_path / "talk.jsonl").write_text("\n".join(rows) + "\n")
    on_policy = parse_run_config(
        {
            "model": {"path": MODEL},
            "sampling": {"max_tokens": 1000},
            "mix": {"total_prompts": 30},
            "datasets": [
                {
                    "name": "talk",
                    "format": "openai_messages",
                    "path": str(tmp_path / "talk.jsonl"),
                    "share": 1.0,
                    "multi_turn": "on_policy",
                    "sampling": {"samples_per_prompt": 2},
                }
            ],
            "output": "/out",
        }
    )

    prompts, turns = count_prompts_and_turns(on_policy)
    priced = estimate_cost(on_policy, [], turns_by_dataset=turns, gpus=1)
    unread = estimate_cost(on_policy, [], gpus=1)

    assert (prompts, turns) == ({}, {"talk": 3.0}), "a quota's prompts are not read; its turns are"
    (talk,) = priced.datasets
    assert (talk.conversations, talk.requests) == (60, 180)
    assert priced.output_tokens == pytest.approx(180 * ASSUMED_ANSWER_SHARE_OF_MAX_TOKENS * 1000)
    assert priced.complete
    assert priced.lines()[1] == "requests: 180 (talk: 60 conversations, 180 turns)"
    assert priced.lines()[-1].endswith("x 2 sample(s) x 3.00 turns per conversation")
    assert not unread.complete and unread.requests == 60
    assert unread.lines()[1] == "requests: at least 60 (talk: 60 conversations, turns unknown)"
