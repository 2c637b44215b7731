"""prepare_prompts: shards and summary written once, resumable, deduplicated, sampled, filtered."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from datagen.config import RunConfig, parse_run_config
from datagen.config.prompts import DEFAULT_SHARD_SIZE, LEGACY_SHARD_SIZE
from datagen.errors import DatasetError
from datagen.output.layout import RunLayout
from datagen.output.store import Store
from datagen.prompts.prepare import inspect_dataset, iter_prompt_shard, load_prompt_ids, prepare_prompts
from datagen.records import PreparedDataset
from datagen.samples import sample_path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "datasets"


def make_config(datasets: list[dict[str, Any]], *, model: str = "unused-model", seed: int = 0) -> RunConfig:
    return parse_run_config(
        {"run_id": "r1", "model": {"path": model}, "datasets": datasets, "output": "unused", "seed": seed}
    )


def write_metamath(path: Path, queries: list[str]) -> str:
    rows = [
        {"query": q, "response": "The answer is: 1", "type": "GSM_AnsAug", "original_question": q}
        for q in queries
    ]
    path.write_text(json.dumps(rows))
    return str(path)


def all_ids(store: Store, prepared: PreparedDataset) -> list[str]:
    return [record.prompt_id for shard in prepared.shards for record in iter_prompt_shard(store, shard)]


def test_prepare_writes_shards_then_summary_with_rejection_counts(store_root: Path) -> None:
    store = Store(str(store_root))
    layout = RunLayout("r1")
    config = make_config(
        [{"name": "metamath", "format": "metamath", "path": sample_path("metamath"), "shard_size": 2}]
    )
    prepared = prepare_prompts(store, layout, config, "metamath")
    assert (prepared.rows_read, prepared.prompts) == (7, 5)
    assert prepared.rejections == {"duplicate": 1, "malformed": 1}
    assert {sample["reason"] for sample in prepared.rejection_samples} == {"duplicate", "malformed"}
    assert [shard.prompts for shard in prepared.shards] == [2, 2, 1]
    assert [shard.path for shard in prepared.shards] == [layout.prompt_shard("metamath", i) for i in range(3)]
    records = [record for shard in prepared.shards for record in iter_prompt_shard(store, shard)]
    assert [record.source_index for record in records] == [0, 1, 2, 3, 4]
    assert all(record.dataset == "metamath" and len(record.prompt_id) == 16 for record in records)
    assert PreparedDataset.model_validate(store.read_json(layout.prompts_summary("metamath"))) == prepared


def test_rerun_returns_the_summary_without_reading_the_dataset(store_root: Path) -> None:
    store = Store(str(store_root))
    layout = RunLayout("r1")
    config = make_config([{"name": "web", "format": "webinstruct", "path": sample_path("webinstruct")}])
    first = prepare_prompts(store, layout, config, "web")
    keys = store.list("runs")
    gone = make_config([{"name": "web", "format": "webinstruct", "path": str(store_root / "gone.parquet")}])
    assert prepare_prompts(store, layout, gone, "web") == first
    assert store.list("runs") == keys


def test_interrupted_attempt_resumes_by_verifying_existing_shards(store_root: Path) -> None:
    store = Store(str(store_root))
    layout = RunLayout("r1")
    config = make_config(
        [{"name": "cf", "format": "code_feedback", "path": sample_path("code_feedback"), "shard_size": 1}]
    )
    first = prepare_prompts(store, layout, config, "cf")
    # Simulate a crash after the shards and before the summary.
    (store_root / layout.prompts_summary("cf")).unlink()
    (store_root / layout.prompt_shard("cf", 3)).unlink()
    assert prepare_prompts(store, layout, config, "cf") == first


def test_a_shard_that_differs_from_the_recomputed_one_is_refused(store_root: Path, tmp_path: Path) -> None:
    store = Store(str(store_root))
    layout = RunLayout("r1")
    data = write_metamath(tmp_path / "m.json", ["a?", "b?", "c?"])
    config = make_config([{"name": "m", "format": "metamath", "path": data, "shard_size": 2}])
    prepare_prompts(store, layout, config, "m")
    (store_root / layout.prompts_summary("m")).unlink()
    write_metamath(tmp_path / "m.json", ["a?", "changed?", "c?"])
    with pytest.raises(DatasetError, match="exists with different content"):
        prepare_prompts(store, layout, config, "m")


def test_an_unset_shard_size_cuts_the_default_and_a_run_begun_under_the_old_one_resumes_with_its_shards(
    store_root: Path, tmp_path: Path
) -> None:
    layout = RunLayout("r1")
    data = write_metamath(
        tmp_path / "m.json", [f"question {index}?" for index in range(DEFAULT_SHARD_SIZE + 76)]
    )
    unset = make_config([{"name": "m", "format": "metamath", "path": data}])
    old = make_config([{"name": "m", "format": "metamath", "path": data, "shard_size": LEGACY_SHARD_SIZE}])
    explicit = make_config(
        [{"name": "m", "format": "metamath", "path": data, "shard_size": DEFAULT_SHARD_SIZE}]
    )
    assert unset.config_hash() == old.config_hash(), "the hash an unset size always had: older runs resume"
    assert explicit.config_hash() != unset.config_hash()

    fresh = prepare_prompts(Store(str(store_root)), layout, unset, "m")
    assert [shard.prompts for shard in fresh.shards] == [DEFAULT_SHARD_SIZE, 76]

    # A run begun while an unset size meant 256, stopped after two shards and before its summary.
    begun_root = tmp_path / "begun"
    store = Store(str(begun_root))
    begun = prepare_prompts(store, layout, old, "m")
    assert [shard.prompts for shard in begun.shards] == [256, 256, 256, 256, 76]
    (begun_root / layout.prompts_summary("m")).unlink()
    for index in range(2, len(begun.shards)):
        (begun_root / layout.prompt_shard("m", index)).unlink()
    assert prepare_prompts(store, layout, unset, "m") == begun


def test_duplicates_across_datasets_are_excluded_and_ids_are_stable_across_runs(
    store_root: Path, tmp_path: Path
) -> None:
    store = Store(str(store_root))
    first = write_metamath(tmp_path / "first.json", ["Shared question?", "Only first?"])
    second = write_metamath(tmp_path / "second.json", ["  shared   QUESTION? ", "Only second?"])
    config = make_config(
        [
            {"name": "first", "format": "metamath", "path": first},
            {"name": "second", "format": "metamath", "path": second},
        ]
    )
    run1 = RunLayout("r1")
    prepared_first = prepare_prompts(store, run1, config, "first")
    taken = load_prompt_ids(store, prepared_first)
    prepared_second = prepare_prompts(store, run1, config, "second", exclude_prompt_ids=taken)
    assert prepared_second.prompts == 1
    assert prepared_second.rejections == {"duplicate": 1}
    assert taken.isdisjoint(all_ids(store, prepared_second))
    # Another run and another dataset name: the same content gets the same id.
    other = make_config([{"name": "again", "format": "metamath", "path": first}])
    again = prepare_prompts(store, RunLayout("r2"), other, "again")
    assert all_ids(store, again) == all_ids(store, prepared_first)


def test_max_prompts_sample_is_seeded_deterministic_and_independent_of_row_order(
    store_root: Path, tmp_path: Path
) -> None:
    store = Store(str(store_root))
    queries = [f"Question number {i}?" for i in range(40)]
    ordered = write_metamath(tmp_path / "ordered.json", queries)
    shuffled_queries = list(queries)
    random.Random(7).shuffle(shuffled_queries)
    shuffled = write_metamath(tmp_path / "shuffled.json", shuffled_queries)

    def sample(path: str, seed: int, run: str) -> tuple[PreparedDataset, set[str]]:
        config = make_config(
            [{"name": "m", "format": "metamath", "path": path, "max_prompts": 10, "shard_size": 4}], seed=seed
        )
        prepared = prepare_prompts(store, RunLayout(run), config, "m")
        return prepared, set(all_ids(store, prepared))

    prepared, ids = sample(ordered, 0, "a")
    assert prepared.prompts == 10 and len(ids) == 10
    assert prepared.rejections == {"over_cap": 30}
    assert [shard.prompts for shard in prepared.shards] == [4, 4, 2]
    records = [record for shard in prepared.shards for record in iter_prompt_shard(store, shard)]
    assert [r.source_index for r in records] == sorted(r.source_index or 0 for r in records)
    assert sample(shuffled, 0, "b")[1] == ids
    assert sample(ordered, 1, "c")[1] != ids


def test_language_filter_keeps_listed_languages_and_rows_without_one(store_root: Path) -> None:
    store = Store(str(store_root))
    path = str(FIXTURES / "infinity_instruct_hostile.jsonl")
    config = make_config(
        [{"name": "ii", "format": "infinity_instruct", "path": path, "languages": ["en", "zh"]}]
    )
    prepared = prepare_prompts(store, RunLayout("r1"), config, "ii")
    languages = [
        record.metadata.get("language")
        for shard in prepared.shards
        for record in iter_prompt_shard(store, shard)
    ]
    assert languages == ["en", "zh-cn", "en"]
    assert prepared.rejections["wrong_language"] == 1  # the Korean row
    assert prepared.rows_read == 14


def test_length_filter_counts_tokens_of_the_target_template_render(
    store_root: Path, tiny_model_dir: Path
) -> None:
    store = Store(str(store_root))
    path = str(FIXTURES / "infinity_instruct_hostile.jsonl")
    config = make_config(
        [{"name": "ii", "format": "infinity_instruct", "path": path, "max_prompt_tokens": 200}],
        model=str(tiny_model_dir),
    )
    # No tokenizer passed: prepare loads the target's own from config.model.
    prepared = prepare_prompts(store, RunLayout("r1"), config, "ii")
    assert prepared.rejections["too_long"] == 1
    too_long = [sample for sample in prepared.rejection_samples if sample["reason"] == "too_long"]
    assert too_long[0]["source_index"] == 9
    assert prepared.prompts == 3


def test_a_tokenizer_that_cannot_load_is_one_dataset_error_naming_max_prompt_tokens(
    store_root: Path, tmp_path: Path
) -> None:
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    path = str(FIXTURES / "infinity_instruct_hostile.jsonl")
    config = make_config(
        [{"name": "ii", "format": "infinity_instruct", "path": path, "max_prompt_tokens": 200}],
        model=str(empty),
    )

    with pytest.raises(
        DatasetError, match=r"(?s)to count prompt tokens \(max_prompt_tokens\).*model.tokenizer_path"
    ):
        prepare_prompts(Store(str(store_root)), RunLayout("r1"), config, "ii")


def test_inspect_reports_counts_and_samples_without_writing(tmp_path: Path) -> None:
    report = inspect_dataset("hermes_fc", sample_path("hermes_fc"))
    assert (report.rows_read, report.prompts) == (5, 4)
    assert report.rejections == {"unparseable_tools": 1}
    assert report.samples and report.samples[0]["tools"]
    text = report.to_text()
    assert "unparseable_tools: 1" in text and "rows read: 5" in text
    assert json.loads(report.model_dump_json())["prompts"] == 4


def test_every_sample_prompt_renders_with_the_qwen3_template_of_the_target(
    store_root: Path, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    from datagen.prompts.datasets import FORMATS

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    store = Store(str(store_root))
    datasets = [
        {
            "name": format.replace("_", "-"),
            "format": format,
            "path": sample_path(format),
            "max_prompt_tokens": 100_000,
            "multi_turn": "every_turn",
        }
        for format in FORMATS
    ]
    config = make_config(datasets, model=str(tiny_model_dir))
    for dataset in datasets:
        prepared = prepare_prompts(store, RunLayout("r1"), config, dataset["name"], tokenizer=tokenizer)
        assert prepared.prompts >= 3
        assert "template_error" not in prepared.rejections
        assert "too_long" not in prepared.rejections
