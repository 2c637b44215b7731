"""A run's merge rounds: every finished completions file in exactly one round, each round on top of the last."""

from __future__ import annotations

from pathlib import Path

import pytest

from datagen.dataset.merge_rounds import (
    MergeRoundShards,
    TokenizeSummary,
    combine_rounds,
    finished_rounds,
    next_merge_round,
)
from datagen.dataset.versions import TokenizedPartRef
from datagen.errors import OutputExistsError, TokenizeError
from datagen.output.layout import RunLayout, dataset_version
from datagen.output.store import Store

RUN_ID = "rounds-1"
LAYOUT = RunLayout(RUN_ID)
BASE = "datasets/drafter-expansion/v0003.json"


def _files(*names: str) -> list[str]:
    return [LAYOUT.completions("alpha", int(name)) for name in names]


def _summary(merge_round: int, merged: list[str] | None, rows: int, version: int) -> TokenizeSummary:
    part = LAYOUT.tokenized_part(0, merge_round)
    return TokenizeSummary(
        run_id=RUN_ID,
        tokenizer="tiny",
        shards_read=len(merged) if merged is not None else 2,
        completions_read=rows + 1,
        rows=rows,
        total_tokens=10 * rows,
        loss_tokens=4 * rows,
        rows_by_dataset={"alpha": rows},
        tokens_by_dataset={"alpha": 10 * rows},
        dropped_by_reason={"truncated": 1},
        parts=[TokenizedPartRef(key=part, url=f"/out/{part}", rows=rows, source=RUN_ID)],
        dataset_name="drafter-expansion",
        dataset_version=dataset_version("drafter-expansion", version),
        dataset_version_url=f"/out/{dataset_version('drafter-expansion', version)}",
        dataset_version_rows=100 + rows,
        base_version=BASE,
        merge_round=merge_round,
        shards_merged=merged,
    )


def _finish(store: Store, summary: TokenizeSummary) -> None:
    store.write_json(LAYOUT.merge_summary(summary.merge_round), summary)


def test_round_zero_keeps_the_keys_of_a_run_merged_once_and_later_rounds_have_folders_of_their_own() -> None:
    assert LAYOUT.merge_summary(0) == LAYOUT.tokenized_summary == "runs/rounds-1/tokenized/summary.json"
    assert LAYOUT.tokenized_part(2) == "runs/rounds-1/tokenized/part-00002.parquet"
    assert LAYOUT.tokenized_part(0, 1) == "runs/rounds-1/tokenized/round-0001/part-00000.parquet"
    assert LAYOUT.merge_summary(1) == "runs/rounds-1/tokenized/round-0001/summary.json"
    assert LAYOUT.merge_shards(1) == "runs/rounds-1/tokenized/round-0001/shards.json"
    # A round's parts are only its own: round 1's part is no part of round 0, nor the other way round.
    assert LAYOUT.parse_tokenized_part(LAYOUT.tokenized_part(3, 1), 1) == 3
    assert LAYOUT.parse_tokenized_part(LAYOUT.tokenized_part(3, 1)) is None
    assert LAYOUT.parse_tokenized_part(LAYOUT.tokenized_part(3), 1) is None


def test_a_run_never_merged_gets_round_zero_with_every_finished_file_on_the_runs_base(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    first = next_merge_round(store, LAYOUT, _files("0", "1"), BASE)
    assert first == MergeRoundShards(
        run_id=RUN_ID, merge_round=0, shards=_files("0", "1"), base_version=BASE, created_at=first.created_at
    )
    assert MergeRoundShards.model_validate(store.read_json(LAYOUT.merge_shards(0))) == first
    # Even with nothing finished a run publishes its (empty) first version, as a run merged once always did.
    assert next_merge_round(Store(str(tmp_path / "empty")), LAYOUT, [], None) is not None


def test_an_interrupted_round_resumes_with_the_files_it_fixed_and_later_files_wait(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    fixed = next_merge_round(store, LAYOUT, _files("0"), BASE)
    # Interrupted before its summary; a shard finished meanwhile: the round is still the one it fixed.
    assert next_merge_round(store, LAYOUT, _files("0", "1"), BASE) == fixed
    _finish(store, _summary(0, _files("0"), rows=3, version=4))
    later = next_merge_round(store, LAYOUT, _files("0", "1"), BASE)
    assert later is not None and (later.merge_round, later.shards) == (1, _files("1"))


def test_a_later_round_takes_only_files_no_earlier_round_merged_and_builds_on_the_last_version(
    tmp_path: Path,
) -> None:
    store = Store(str(tmp_path))
    _finish(store, _summary(0, _files("0", "2"), rows=5, version=4))
    _finish(store, _summary(1, _files("1"), rows=2, version=5))
    third = next_merge_round(store, LAYOUT, _files("0", "1", "2", "3", "4"), BASE)
    assert third is not None
    assert (third.merge_round, third.shards) == (2, _files("3", "4"))
    assert third.base_version == dataset_version("drafter-expansion", 5)
    assert [summary.merge_round for summary in finished_rounds(store, LAYOUT)] == [0, 1]


def test_every_finished_file_merged_means_no_round_and_nothing_written(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    _finish(store, _summary(0, _files("0", "1"), rows=5, version=4))
    assert next_merge_round(store, LAYOUT, _files("0", "1"), BASE) is None
    assert not store.exists(LAYOUT.merge_shards(1))


def test_a_round_fixed_by_another_process_first_is_adopted(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    theirs = MergeRoundShards(run_id=RUN_ID, merge_round=0, shards=_files("0"), base_version=BASE)
    store.write_json(LAYOUT.merge_shards(0), theirs)
    assert next_merge_round(store, LAYOUT, _files("0", "1"), BASE) == theirs
    with pytest.raises(OutputExistsError):
        store.write_json(LAYOUT.merge_shards(0), theirs)


def test_a_merge_from_before_rounds_stands_alone_and_refuses_files_it_cannot_tell_apart(
    tmp_path: Path,
) -> None:
    store = Store(str(tmp_path))
    _finish(store, _summary(0, None, rows=5, version=4))  # shards_read=2, no list of files
    assert next_merge_round(store, LAYOUT, _files("0", "1"), BASE) is None
    with pytest.raises(TokenizeError, match="1 more finished since"):
        next_merge_round(store, LAYOUT, _files("0", "1", "2"), BASE)


def test_the_runs_merge_over_its_rounds_sums_counts_and_parts_and_names_the_last_version() -> None:
    first, second = (
        _summary(0, _files("0", "2"), rows=5, version=4),
        _summary(1, _files("1"), rows=2, version=6),
    )
    assert combine_rounds([first]) == first
    run = combine_rounds([first, second])
    assert (run.rows, run.total_tokens, run.loss_tokens, run.completions_read) == (7, 70, 28, 9)
    assert run.rows_by_dataset == {"alpha": 7} and run.dropped_by_reason == {"truncated": 2}
    assert run.parts == [*first.parts, *second.parts]
    assert run.shards_merged == _files("0", "2", "1") and run.shards_read == 3
    assert (run.dataset_version, run.dataset_version_rows) == (second.dataset_version, 102)
    assert (run.merge_round, run.base_version) == (1, BASE)
    with pytest.raises(ValueError, match="at least one round"):
        combine_rounds([])
