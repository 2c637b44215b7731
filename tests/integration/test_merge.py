"""merge_and_tokenize over a real local store laid out like a run, read back with pyarrow."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from datagen.config import RunConfig
from datagen.dataset.merge import merge_and_tokenize
from datagen.dataset.merge_rounds import TokenizeSummary
from datagen.dataset.tokenizer import load_tokenizer
from datagen.dataset.versions import DatasetVersion, TokenizedPartRef
from datagen.errors import NoTrainingRowsError, TokenizeError
from datagen.output.layout import RunLayout, dataset_version
from datagen.output.objects import size_text
from datagen.output.store import Store
from datagen.processes import usable_cores
from datagen.records import (
    AssistantCompletion,
    CompletionRecord,
    Message,
    SamplingParams,
    ShardSummary,
    TokenUsage,
)
from tests.support.children import ChildWatch

RUN_ID = "merge-test"


def completion(dataset: str, index: int, content: str, finish_reason: str = "stop") -> CompletionRecord:
    return CompletionRecord(
        prompt_id=f"{dataset}-{index:03d}",
        sample_index=0,
        dataset=dataset,
        messages=[Message(role="user", content=f"Question {index} of {dataset}?")],
        completion=AssistantCompletion(content=content),
        finish_reason=finish_reason,  # type: ignore[arg-type]
        usage=TokenUsage(prompt_tokens=12, completion_tokens=6),
        model="tiny",
        engine="transformers",
        server="http://127.0.0.1:1",
        sampling=SamplingParams(enable_thinking=False),
        latency_s=0.2,
    )


def write_shard(
    store: Store, layout: RunLayout, dataset: str, index: int, records: list[CompletionRecord]
) -> None:
    """Write a shard the way generate_shard does: completions, failures, then the done marker."""
    store.write_jsonl(layout.completions(dataset, index), records)
    store.write_jsonl(layout.failures(dataset, index), [])
    summary = ShardSummary(
        dataset=dataset,
        shard_index=index,
        requests=len(records),
        completions=len(records),
        failures=0,
        prompt_tokens=0,
        completion_tokens=0,
        generation_s=1.0,
        completions_path=layout.completions(dataset, index),
        failures_path=layout.failures(dataset, index),
    )
    store.write_json(layout.shard_done(dataset, index), summary)


def make_config(root: Path, model_dir: Path, **tokenize: Any) -> RunConfig:
    return RunConfig.model_validate(
        {
            "run_id": RUN_ID,
            "model": {"path": str(model_dir)},
            "datasets": [
                {"name": "alpha", "format": "openai_messages", "path": "unused"},
                {"name": "beta", "format": "openai_messages", "path": "unused"},
            ],
            "output": str(root),
            "tokenize": {"rows_per_part": 3, **tokenize},
        }
    )


def populate(store: Store, layout: RunLayout) -> dict[str, str]:
    """Two finished shards of alpha, one of beta, one unfinished shard; returns expected answer per prompt."""
    alpha0 = [completion("alpha", i, f"Answer {i} from alpha.") for i in range(3)]
    alpha0.append(completion("alpha", 3, "cut off mid", finish_reason="length"))
    alpha1 = [completion("alpha", i, f"Answer {i} from alpha.") for i in range(4, 7)]
    alpha1.append(completion("alpha", 7, "   "))
    beta0 = [completion("beta", i, f"Beta says {i}.") for i in range(2)]
    write_shard(store, layout, "alpha", 0, alpha0)
    write_shard(store, layout, "alpha", 1, alpha1)
    write_shard(store, layout, "beta", 0, beta0)
    # A shard whose marker is missing (its task died after writing the file) must not be read.
    store.write_jsonl(layout.completions("beta", 1), [completion("beta", 9, "Never merged.")])
    return {
        record.prompt_id: record.completion.content or "" for record in [*alpha0[:3], *alpha1[:3], *beta0]
    }


def read_rows(root: Path, summary: TokenizeSummary) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for part in summary.parts:
        assert part.key is not None
        table = pq.read_table(root / part.key)
        assert table.schema.field("input_ids").type.value_type.bit_width == 32
        assert table.schema.field("loss_mask").type.value_type.bit_width == 8
        assert table.num_rows == part.rows
        rows.extend(table.to_pylist())
    return rows


def tree(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


@pytest.fixture()
def run(store_root: Path, tiny_model_dir: Path) -> tuple[Store, RunLayout, RunConfig, dict[str, str]]:
    store = Store(str(store_root))
    layout = RunLayout(RUN_ID)
    expected = populate(store, layout)
    return store, layout, make_config(store_root, tiny_model_dir), expected


def test_merge_writes_parquet_whose_masks_decode_to_the_answers(
    run: tuple[Store, RunLayout, RunConfig, dict[str, str]], store_root: Path, tiny_model_dir: Path
) -> None:
    store, layout, config, expected = run
    summary = merge_and_tokenize(store, layout, config)

    assert summary.rows == len(expected) == 8
    assert summary.completions_read == 10
    assert summary.shards_read == 3
    assert summary.shards_incomplete == [layout.completions("beta", 1)]
    assert summary.dropped_by_reason == {"empty_completion": 1, "truncated": 1}
    assert summary.rows_by_dataset == {"alpha": 6, "beta": 2}
    assert [part.rows for part in summary.parts] == [3, 3, 2]
    assert [part.key for part in summary.parts] == [layout.tokenized_part(i) for i in range(3)]

    tokenizer = load_tokenizer(str(tiny_model_dir))
    rows = read_rows(store_root, summary)
    assert [row["prompt_id"] for row in rows] == sorted(expected)
    for row in rows:
        assert len(row["input_ids"]) == len(row["loss_mask"]) == row["num_tokens"]
        assert sum(row["loss_mask"]) == row["num_loss_tokens"]
        loss_ids = [token for token, bit in zip(row["input_ids"], row["loss_mask"], strict=True) if bit]
        assert tokenizer.decode(loss_ids) == expected[row["prompt_id"]] + "<|im_end|>"
        assert row["finish_reason"] == "stop"
    assert summary.total_tokens == sum(row["num_tokens"] for row in rows)
    assert summary.loss_tokens == sum(row["num_loss_tokens"] for row in rows)

    version = DatasetVersion.model_validate(store.read_json(summary.dataset_version))
    assert summary.dataset_version == dataset_version("drafter-expansion", 1)
    assert version.rows == 8
    assert [shard.key for shard in version.shards] == [part.key for part in summary.parts]
    assert TokenizeSummary.model_validate(store.read_json(layout.tokenized_summary)) == summary


def test_rerun_of_a_finished_merge_writes_nothing(
    run: tuple[Store, RunLayout, RunConfig, dict[str, str]], store_root: Path
) -> None:
    store, layout, config, _ = run
    first = merge_and_tokenize(store, layout, config)
    before = tree(store_root)
    assert merge_and_tokenize(store, layout, config) == first
    assert tree(store_root) == before


def test_interrupted_merge_keeps_written_parts_and_finishes_identically(
    run: tuple[Store, RunLayout, RunConfig, dict[str, str]], store_root: Path
) -> None:
    store, layout, config, _ = run
    complete = merge_and_tokenize(store, layout, config)
    first_part = (store_root / layout.tokenized_part(0)).read_bytes()
    # Simulate a crash after the first part: only part 0 survives.
    for key in [
        layout.tokenized_summary,
        complete.dataset_version,
        layout.tokenized_part(1),
        layout.tokenized_part(2),
    ]:
        (store_root / key).unlink()

    resumed = merge_and_tokenize(store, layout, config)

    assert resumed.resumed_parts == 1
    assert (store_root / layout.tokenized_part(0)).read_bytes() == first_part
    same = {"created_at", "resumed_parts"}
    assert resumed.model_dump(exclude=same) == complete.model_dump(exclude=same)
    assert tree(store_root)[layout.tokenized_part(2)]


def test_resume_refuses_parts_that_no_longer_match_the_completions(
    run: tuple[Store, RunLayout, RunConfig, dict[str, str]], store_root: Path, tiny_model_dir: Path
) -> None:
    store, layout, config, _ = run
    complete = merge_and_tokenize(store, layout, config)
    for key in [layout.tokenized_summary, complete.dataset_version, layout.tokenized_part(2)]:
        (store_root / key).unlink()
    # The filters changed since the parts were written: the truncated answer is a row now, the rows they cover shift.
    with pytest.raises(TokenizeError, match="changed since"):
        merge_and_tokenize(store, layout, make_config(store_root, tiny_model_dir, include_truncated=True))


def _finish_beta_1(store: Store, layout: RunLayout) -> None:
    """beta/1's done marker: its completions file (written by populate) is finished now."""
    store.write_json(
        layout.shard_done("beta", 1),
        ShardSummary(
            dataset="beta",
            shard_index=1,
            requests=1,
            completions=1,
            failures=0,
            prompt_tokens=0,
            completion_tokens=0,
            generation_s=1.0,
            completions_path=layout.completions("beta", 1),
            failures_path=layout.failures("beta", 1),
        ),
    )


def own_rows(root: Path, version: DatasetVersion) -> list[str]:
    """The prompt ids of a version's own parts (those its run wrote, not its base's)."""
    return [
        row["prompt_id"]
        for shard in version.shards
        if shard.source == RUN_ID
        for row in pq.read_table(root / str(shard.key), columns=["prompt_id"]).to_pylist()
    ]


def test_shards_finished_after_a_merge_are_published_by_the_next_round_on_top_of_it(
    run: tuple[Store, RunLayout, RunConfig, dict[str, str]], store_root: Path
) -> None:
    store, layout, config, expected = run
    published = merge_and_tokenize(store, layout, config)  # beta/1 unfinished (a window ended, say)
    before = tree(store_root)
    assert merge_and_tokenize(store, layout, config) == published  # nothing new: the merge stands
    assert tree(store_root) == before
    _finish_beta_1(store, layout)  # the continuation finishes beta/1

    merged = merge_and_tokenize(store, layout, config)

    assert published.merge_round == 0 and published.shards_merged == [
        layout.completions("alpha", 0),
        layout.completions("alpha", 1),
        layout.completions("beta", 0),
    ]
    assert TokenizeSummary.model_validate(store.read_json(layout.tokenized_summary)) == published
    second = TokenizeSummary.model_validate(store.read_json(layout.merge_summary(1)))
    assert second.shards_merged == [layout.completions("beta", 1)] and second.rows == 1
    assert [part.key for part in second.parts] == [layout.tokenized_part(0, 1)]
    assert second.base_version == published.dataset_version == dataset_version("drafter-expansion", 1)
    assert second.dataset_version == dataset_version("drafter-expansion", 2)
    # The run's merge: both rounds' rows, the last round's version.
    assert (merged.rows, merged.merge_round, merged.dataset_version) == (9, 1, second.dataset_version)
    assert merged.rows_by_dataset == {"alpha": 6, "beta": 3}
    v1 = DatasetVersion.model_validate(store.read_json(published.dataset_version))
    v2 = DatasetVersion.model_validate(store.read_json(second.dataset_version))
    assert (v1.rows, v2.rows, v2.merge_round) == (8, 9, 1)
    assert v2.base_version == store.url(published.dataset_version)
    assert v2.parquet_urls()[:3] == v1.parquet_urls()
    # Every answer in exactly one version's own parts.
    assert sorted(own_rows(store_root, v1)) == sorted(expected)
    assert own_rows(store_root, v2) == ["beta-009"]
    assert merge_and_tokenize(store, layout, config) == merged


def layout_parts(layout: RunLayout, first: int, end: int) -> list[str]:
    return [layout.tokenized_part(index) for index in range(first, end)]


def test_an_interrupted_round_finishes_with_its_own_files_and_a_shard_finished_meanwhile_goes_to_the_next(
    run: tuple[Store, RunLayout, RunConfig, dict[str, str]], store_root: Path
) -> None:
    store, layout, config, _ = run
    complete = merge_and_tokenize(store, layout, config)
    # A crash after round 0's first part; beta/1 finishes before the merge runs again.
    for key in [layout.tokenized_summary, complete.dataset_version, *layout_parts(layout, 1, 3)]:
        (store_root / key).unlink()
    _finish_beta_1(store, layout)

    merged = merge_and_tokenize(store, layout, config)

    resumed = TokenizeSummary.model_validate(store.read_json(layout.tokenized_summary))
    same = {"created_at", "resumed_parts", "shards_incomplete"}  # beta/1 was unfinished when round 0 began
    assert resumed.model_dump(exclude=same) == complete.model_dump(exclude=same)
    assert resumed.resumed_parts == 1
    second = TokenizeSummary.model_validate(store.read_json(layout.merge_summary(1)))
    assert second.shards_merged == [layout.completions("beta", 1)]
    assert merged.rows == complete.rows + 1 and merged.dataset_version == dataset_version(
        "drafter-expansion", 2
    )


def test_new_version_references_a_protected_base_and_never_overwrites_versions(
    run: tuple[Store, RunLayout, RunConfig, dict[str, str]], store_root: Path, tiny_model_dir: Path
) -> None:
    store, layout, _, _ = run
    # The existing training data: a version manifest under a protected prefix.
    protected = store_root / "existing"
    base_parts = [
        TokenizedPartRef(url=str(protected / f"part-{i}.parquet"), rows=451_000, source="legacy")
        for i in range(2)
    ]
    base = DatasetVersion(name="legacy", version=1, run_id="legacy", rows=902_000, shards=base_parts)
    Store(str(protected)).write_json("v0001.json", base)
    base_bytes = (protected / "v0001.json").read_bytes()
    # Another run already published version 1 of our dataset name.
    other = DatasetVersion(name="drafter-expansion", version=1, run_id="other-run", rows=0, shards=[])
    store.write_json(dataset_version("drafter-expansion", 1), other)
    other_bytes = (store_root / dataset_version("drafter-expansion", 1)).read_bytes()

    guarded = Store(str(store_root), protected_prefixes=[str(protected)])
    config = make_config(store_root, tiny_model_dir, base_version=str(protected / "v0001.json"))
    summary = merge_and_tokenize(guarded, layout, config)

    assert summary.dataset_version == dataset_version("drafter-expansion", 2)
    version = DatasetVersion.model_validate(json.loads((store_root / summary.dataset_version).read_text()))
    assert version.rows == 902_000 + summary.rows
    assert [shard.url for shard in version.shards[:2]] == [part.url for part in base_parts]
    assert all(shard.source == f"base:{protected / 'v0001.json'}" for shard in version.shards[:2])
    assert (protected / "v0001.json").read_bytes() == base_bytes
    assert sorted(path.name for path in protected.iterdir()) == ["v0001.json"]
    assert (store_root / dataset_version("drafter-expansion", 1)).read_bytes() == other_bytes


def test_truncated_rows_are_kept_when_configured(
    run: tuple[Store, RunLayout, RunConfig, dict[str, str]], store_root: Path, tiny_model_dir: Path
) -> None:
    store, layout, _, _ = run
    config = make_config(store_root, tiny_model_dir, include_truncated=True, max_length_tokens=10_000)
    summary = merge_and_tokenize(store, layout, config)
    assert summary.rows == 9
    assert summary.dropped_by_reason == {"empty_completion": 1}
    truncated = [row for row in read_rows(store_root, summary) if row["finish_reason"] == "length"]
    assert len(truncated) == 1


def test_worker_processes_write_the_same_parts_as_one_process(
    store_root: Path, tmp_path: Path, tiny_model_dir: Path
) -> None:
    parts: dict[int, dict[str, bytes]] = {}
    for workers in (1, 2):
        root = tmp_path / f"workers-{workers}"
        root.mkdir()
        store = Store(str(root))
        layout = RunLayout(RUN_ID)
        populate(store, layout)
        # tokenize.workers set: exactly that many processes, however small the shards.
        with ChildWatch() as watch:
            summary = merge_and_tokenize(store, layout, make_config(root, tiny_model_dir, workers=workers))
        assert len(watch.commands("spawn_main")) == (0 if workers == 1 else workers)
        parts[workers] = {part.key or "": (root / (part.key or "")).read_bytes() for part in summary.parts}
    assert parts[1] == parts[2]
    assert len(parts[1]) == 3


def finished_shard_bytes(root: Path, layout: RunLayout) -> int:
    """Bytes of the three finished completions shards :func:`populate` writes."""
    shards = [("alpha", 0), ("alpha", 1), ("beta", 0)]
    return sum((root / layout.completions(dataset, index)).stat().st_size for dataset, index in shards)


def test_without_workers_set_small_shards_are_tokenized_in_this_process_and_larger_ones_in_workers(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    parts: dict[str, dict[str, bytes]] = {}
    started: dict[str, list[str | None]] = {}
    total = 0
    for name in ("default", "one byte short", "at the threshold"):
        root = tmp_path / name.replace(" ", "-")
        root.mkdir()
        store = Store(str(root))
        layout = RunLayout(RUN_ID)
        populate(store, layout)
        total = finished_shard_bytes(root, layout)
        threshold = {
            "one byte short": {"in_process_below": total + 1},
            "at the threshold": {"in_process_below": total},
        }
        with caplog.at_level(logging.INFO, logger="datagen.dataset.merge"), ChildWatch() as watch:
            summary = merge_and_tokenize(
                store, layout, make_config(root, tiny_model_dir), **threshold.get(name, {})
            )
        started[name] = (
            list(watch.started.values()) if name != "at the threshold" else watch.commands("spawn_main")
        )
        parts[name] = {part.key or "": (root / (part.key or "")).read_bytes() for part in summary.parts}
    messages = [record.getMessage() for record in caplog.records]
    assert started["default"] == [] and started["one byte short"] == []
    assert f"tokenizing in this process: 3 shards, {size_text(total)} (< 16 MiB)" in messages
    assert f"tokenizing in this process: 3 shards, {size_text(total)} (< {size_text(total + 1)})" in messages
    cores = usable_cores()
    if cores >= 2:  # one core: no worker would gain anything, so none starts
        assert len(started["at the threshold"]) == min(cores, 3)
        assert any(
            message.startswith(f"tokenizing in {min(cores, 3)} worker processes: 3 shards")
            for message in messages
        )
    assert parts["default"] == parts["one byte short"] == parts["at the threshold"]


def test_parts_are_written_in_row_groups_of_the_configured_size(
    run: tuple[Store, RunLayout, RunConfig, dict[str, str]], store_root: Path, tiny_model_dir: Path
) -> None:
    store, layout, _, _ = run
    config = make_config(store_root, tiny_model_dir, rows_per_part=5, row_group_rows=2)
    summary = merge_and_tokenize(store, layout, config)
    assert [part.rows for part in summary.parts] == [5, 3]
    metadata = pq.read_metadata(store_root / layout.tokenized_part(0))
    assert [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)] == [2, 2, 1]


def test_rows_record_how_they_were_tokenized_and_exact_ids_are_kept_verbatim(
    store_root: Path, tiny_model_dir: Path
) -> None:
    store = Store(str(store_root))
    layout = RunLayout(RUN_ID)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # Ids the engine generated, not what re-tokenizing the text would give ("Par" + "is").
    generated = [
        *tokenizer.encode("Par", add_special_tokens=False),
        *tokenizer.encode("is", add_special_tokens=False),
    ]
    exact = completion("alpha", 0, "Paris").model_copy(
        update={
            "completion": AssistantCompletion(content="Paris", output_token_ids=[*generated, end_of_turn])
        }
    )
    write_shard(store, layout, "alpha", 0, [exact, completion("alpha", 1, "Berlin.")])
    summary = merge_and_tokenize(store, layout, make_config(store_root, tiny_model_dir))
    rows = read_rows(store_root, summary)
    assert [row["tokenized_from"] for row in rows] == ["ids", "text"]
    ids_row = rows[0]
    loss_ids = [token for token, bit in zip(ids_row["input_ids"], ids_row["loss_mask"], strict=True) if bit]
    assert loss_ids == [*generated, end_of_turn]
    assert ids_row["input_ids"][-len(loss_ids) :] == loss_ids


def test_another_runs_layout_nested_in_this_runs_folders_is_never_read(
    run: tuple[Store, RunLayout, RunConfig, dict[str, str]], store_root: Path
) -> None:
    store, layout, config, expected = run
    # A run whose output was this run's completions folder, and a version nested in the dataset's folder that
    # names this run (what a later run of the dataset would adopt as its own).
    intruder = RunLayout("intruder")
    nested = f"{layout.completions_prefix}/"
    records = [completion("alpha", i, f"Intruder {i}.") for i in range(40, 46)]
    write_shard(Store(str(store_root / nested)), intruder, "alpha", 0, records)
    store.write_text(f"{layout.completions_prefix}/alpha/shard-00000.jsonl.bak", "{}\n")
    forged = DatasetVersion(name="drafter-expansion", version=1, run_id=RUN_ID, rows=0, shards=[])
    store.write_json(f"datasets/drafter-expansion/{dataset_version('drafter-expansion', 1)}", forged)

    summary = merge_and_tokenize(store, layout, config)

    assert summary.rows == len(expected) == 8 and summary.shards_read == 3
    assert summary.shards_incomplete == [layout.completions("beta", 1)]
    assert summary.dataset_version == dataset_version("drafter-expansion", 1)
    version = DatasetVersion.model_validate(store.read_json(summary.dataset_version))
    assert version.rows == 8 and [shard.key for shard in version.shards] == [p.key for p in summary.parts]


def test_a_round_whose_every_completion_is_dropped_publishes_no_version_and_says_how_to_keep_them(
    store_root: Path, tiny_model_dir: Path
) -> None:
    store, layout = Store(str(store_root)), RunLayout(RUN_ID)
    write_shard(
        store,
        layout,
        "alpha",
        0,
        [completion("alpha", i, "cut off", finish_reason="length") for i in range(3)],
    )
    with pytest.raises(
        NoTrainingRowsError, match=r"every one of the 3 completions merged was dropped \(truncated 3\)"
    ) as refused:
        merge_and_tokenize(store, layout, make_config(store_root, tiny_model_dir))
    assert "tokenize.include_truncated: true" in str(refused.value)
    assert not (store_root / "datasets").exists(), "a version without a row would read as done"
    assert not store.exists(layout.merge_summary(0)), "the round is not finished"
    # The round was not spent: merged keeping truncated answers, the same files make its rows.
    kept = merge_and_tokenize(store, layout, make_config(store_root, tiny_model_dir, include_truncated=True))
    assert kept.rows == 3 and kept.dataset_version_rows == 3


def test_a_window_part_whose_every_completion_is_dropped_publishes_nothing_and_the_continuation_publishes_the_rest(
    store_root: Path, tiny_model_dir: Path
) -> None:
    store, layout = Store(str(store_root)), RunLayout(RUN_ID)
    base_key = str(store_root / "existing" / "v0001.json")
    Store(str(store_root / "existing")).write_json(
        "v0001.json", DatasetVersion(name="legacy", version=1, run_id="legacy", rows=0, shards=[])
    )
    config = make_config(store_root, tiny_model_dir, base_version=base_key)
    # The attempt a window ended finished one shard, every answer of it cut off at max_tokens.
    write_shard(
        store,
        layout,
        "alpha",
        0,
        [completion("alpha", i, "cut off", finish_reason="length") for i in range(3)],
    )

    part = merge_and_tokenize(store, layout, config, window_part=True)

    assert (part.dataset_version, part.dataset_version_url, part.rows) == (None, None, 0)
    assert part.completions_read == 3 and part.dropped_by_reason == {"truncated": 3}
    assert store.exists(layout.merge_summary(0)), "the round is finished: its files are spent"
    assert not (store_root / "datasets").exists(), "a version without a row would read as done"
    assert merge_and_tokenize(store, layout, config, window_part=True) == part  # nothing new: it stands
    # The run's end with nothing more finished: no row in the whole run, refused, no resume suggested.
    with pytest.raises(NoTrainingRowsError, match=r"every one of the 3 completions merged was dropped"):
        merge_and_tokenize(store, layout, config)

    # The continuation finishes the rest: the next round takes only its files, on the run's base.
    write_shard(store, layout, "alpha", 1, [completion("alpha", i, f"Answer {i}.") for i in (4, 5)])
    merged = merge_and_tokenize(store, layout, config)

    second = TokenizeSummary.model_validate(store.read_json(layout.merge_summary(1)))
    assert second.shards_merged == [layout.completions("alpha", 1)] and second.base_version == base_key
    assert merged.dataset_version == second.dataset_version == dataset_version("drafter-expansion", 1)
    assert (merged.rows, merged.completions_read, merged.dropped_by_reason) == (2, 5, {"truncated": 3})
    version = DatasetVersion.model_validate(store.read_json(second.dataset_version))
    assert version.rows == 2 and sorted(own_rows(store_root, version)) == ["alpha-004", "alpha-005"]
    assert merge_and_tokenize(store, layout, config) == merged
