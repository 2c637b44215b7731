"""The prompt ledger of a series: earlier runs' prompts excluded, written once, parallel runs detected."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest

from datagen.config import RunConfig, parse_run_config
from datagen.dataset.merge_rounds import TokenizeSummary
from datagen.errors import SeriesConflictError
from datagen.output.layout import RunLayout, dataset_version
from datagen.output.runs import open_run
from datagen.output.store import Store
from datagen.prompts.ledger import (
    find_open_series_run,
    held_by_category,
    ledger_key,
    open_series_entry,
    taken_prompt_ids,
    write_ledger,
)
from datagen.prompts.prepare import prepare_prompts


def _prompts(path: Path, count: int) -> Path:
    with path.open("w") as handle:
        for index in range(count):
            handle.write(json.dumps({"messages": [{"role": "user", "content": f"question {index}"}]}) + "\n")
    return path


def _config(tmp_path: Path, run_id: str, **changes: Any) -> RunConfig:
    data: dict[str, Any] = {
        "run_id": run_id,
        "series": "nightly",
        "model": {"path": "/m"},
        "datasets": [
            {
                "name": "q",
                "format": "openai_messages",
                "path": str(tmp_path / "q.jsonl"),
                "max_prompts": 4,
                "category": "chat",
            }
        ],
        "output": str(tmp_path / "store"),
        "tokenize": {"base_version": "/corpus/v0001.json"},
        **changes,
    }
    return parse_run_config(data)


def _prepare_night(store: Store, config: RunConfig) -> tuple[set[str], Any]:
    open_run(store, config)
    entry = open_series_entry(store, config)
    prepared = prepare_prompts(
        store,
        RunLayout(entry.run_id),
        config,
        "q",
        corpus_ids=taken_prompt_ids(store, entry),
        held_by_category=held_by_category(store, entry),
    )
    write_ledger(store, config, entry, [prepared])
    ids = {line["prompt_id"] for line in store.iter_jsonl(prepared.shards[0].path)}
    return ids, entry


def test_each_run_of_a_series_takes_prompts_no_earlier_run_took(tmp_path: Path) -> None:
    _prompts(tmp_path / "q.jsonl", 10)
    store = Store(str(tmp_path / "store"))
    first, entry1 = _prepare_night(store, _config(tmp_path, "night-1"))
    second, entry2 = _prepare_night(store, _config(tmp_path, "night-2"))
    third, _ = _prepare_night(store, _config(tmp_path, "night-3"))

    assert len(first) == len(second) == 4 and len(third) == 2  # 10 prompts in all
    assert not first & second and not (first | second) & third
    assert entry1.earlier_runs == [] and entry1.base_version == "/corpus/v0001.json"
    assert entry2.earlier_runs == ["night-1"]
    assert held_by_category(store, entry2) == {"chat": 4}


def test_a_resumed_run_recomputes_the_same_ledger_and_the_later_series_runs_stay_excluded(
    tmp_path: Path,
) -> None:
    _prompts(tmp_path / "q.jsonl", 10)
    store = Store(str(tmp_path / "store"))
    first, _ = _prepare_night(store, _config(tmp_path, "night-1"))
    _prepare_night(store, _config(tmp_path, "night-2"))
    # night-1 again (a crash after its ledger): same entry, same prompts, same ledger bytes.
    again, entry = _prepare_night(store, _config(tmp_path, "night-1"))
    assert again == first and entry.earlier_runs == []


def _published(store: Store, run_id: str, merge_round: int, version: int, created_at: str) -> None:
    """A merge round of ``run_id`` that published ``version`` (the summary it writes last)."""
    key = dataset_version("drafter-expansion", version)
    summary = TokenizeSummary(
        run_id=run_id,
        tokenizer="/m",
        shards_read=1,
        completions_read=1,
        rows=1,
        total_tokens=1,
        loss_tokens=1,
        dataset_name="drafter-expansion",
        dataset_version=key,
        dataset_version_url=f"/store/{key}",
        dataset_version_rows=1,
        merge_round=merge_round,
        shards_merged=[],
        created_at=dt.datetime.fromisoformat(created_at),
    )
    store.write_json(RunLayout(run_id).merge_summary(merge_round), summary)


def test_the_next_run_builds_on_the_series_last_published_version(tmp_path: Path) -> None:
    _prompts(tmp_path / "q.jsonl", 10)
    store = Store(str(tmp_path / "store"))
    _prepare_night(store, _config(tmp_path, "night-1"))
    _published(store, "night-1", 0, 1, "2026-12-01T01:00:00+00:00")
    _, entry = _prepare_night(store, _config(tmp_path, "night-2"))
    assert entry.base_version == "datasets/drafter-expansion/v0001.json"


def test_a_run_published_in_rounds_is_built_on_at_its_last_rounds_version(tmp_path: Path) -> None:
    _prompts(tmp_path / "q.jsonl", 10)
    store = Store(str(tmp_path / "store"))
    _prepare_night(store, _config(tmp_path, "night-1"))
    # A window ended night-1 (round 0: v0001); its continuation published the rest (round 1: v0002 on v0001).
    _published(store, "night-1", 0, 1, "2026-12-01T07:00:00+00:00")
    _published(store, "night-1", 1, 2, "2026-12-02T03:00:00+00:00")
    _, entry = _prepare_night(store, _config(tmp_path, "night-2"))
    assert entry.base_version == "datasets/drafter-expansion/v0002.json"


def test_two_runs_of_one_series_at_once_are_stopped_before_generating(tmp_path: Path) -> None:
    _prompts(tmp_path / "q.jsonl", 10)
    store = Store(str(tmp_path / "store"))
    # Both open before either has written its ledger: each misses the other.
    configs = [_config(tmp_path, name) for name in ("box-a", "box-b")]
    entries = []
    for config in configs:
        open_run(store, config)
        entries.append(open_series_entry(store, config))
    prepared = [
        prepare_prompts(store, RunLayout(entry.run_id), config, "q")
        for config, entry in zip(configs, entries, strict=True)
    ]
    write_ledger(store, configs[0], entries[0], [prepared[0]])
    with pytest.raises(SeriesConflictError, match="took 4 of the same prompts"):
        write_ledger(store, configs[1], entries[1], [prepared[1]])
    assert store.exists(ledger_key("nightly", "box-a"))


def test_files_nested_below_a_series_ledger_are_no_runs_of_the_series(tmp_path: Path) -> None:
    _prompts(tmp_path / "q.jsonl", 12)
    store = Store(str(tmp_path / "store"))
    first, _ = _prepare_night(store, _config(tmp_path, "night-1"))
    # A run whose output was the ledger folder: its own runs/... files land below the ledger.
    nested = Store(str(tmp_path / "store" / "series" / "nightly" / "ledger"))
    nested.write_text("runs/intruder/prompts/q/shard-00000.jsonl", '{"prompt_id": "x"}\n')
    nested.write_text("intruder.jsonl.partial", "")

    second, entry = _prepare_night(store, _config(tmp_path, "night-2"))

    assert entry.earlier_runs == ["night-1"]
    assert len(second) == 4 and not first & second


def test_a_run_of_the_series_is_open_from_its_ledger_until_its_manifest_oldest_first(tmp_path: Path) -> None:
    _prompts(tmp_path / "q.jsonl", 12)
    store = Store(str(tmp_path / "store"))
    assert find_open_series_run(store, "nightly") is None
    _prepare_night(store, _config(tmp_path, "night-1"))
    _prepare_night(store, _config(tmp_path, "night-2"))
    # Both took prompts and published nothing: the older is continued first.
    assert find_open_series_run(store, "nightly") == "night-1"
    store.write_json(RunLayout("night-1").manifest, {"objects": []})
    assert find_open_series_run(store, "nightly") == "night-2"
    store.write_json(RunLayout("night-2").manifest, {"objects": []})
    assert find_open_series_run(store, "nightly") is None
    assert find_open_series_run(store, "weekly") is None
    # A run that opened its entry but crashed before its ledger took nothing: it is no open run.
    config = _config(tmp_path, "night-3")
    open_run(store, config)
    open_series_entry(store, config)
    assert find_open_series_run(store, "nightly") is None
