"""Dedupe against the existing corpus: id files, prompt files in any layout, a previous run, a version."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from datagen.config import RunConfig, parse_run_config
from datagen.errors import ConfigError, DatasetError
from datagen.output.layout import RunLayout
from datagen.output.store import Store
from datagen.prompts.datasets.corpus import iter_corpus_ids, load_corpus_ids
from datagen.prompts.datasets.identity import canonical_content
from datagen.prompts.prepare import iter_prompt_shard, prepare_prompts
from datagen.records import Message

QUESTIONS = [f"How many legs do {n} spiders have?" for n in range(1, 9)]


def write_metamath(path: Path, queries: list[str]) -> str:
    rows = [
        {"query": q, "response": "The answer is: 8", "type": "GSM_AnsAug", "original_question": q}
        for q in queries
    ]
    path.write_text(json.dumps(rows))
    return str(path)


def make_config(data: str, sources: list[dict[str, Any]], **dataset: Any) -> RunConfig:
    return parse_run_config(
        {
            "run_id": "r2",
            "model": {"path": "unused"},
            "datasets": [{"name": "m", "format": "metamath", "path": data, **dataset}],
            "output": "unused",
            "existing_corpus": {"dedupe_against": sources},
        }
    )


def prepared_questions(store: Store, config: RunConfig, run: str = "r2") -> tuple[list[str], dict[str, int]]:
    prepared = prepare_prompts(store, RunLayout(run), config, "m")
    texts = [
        str(record.messages[-1].content)
        for shard in prepared.shards
        for record in iter_prompt_shard(store, shard)
    ]
    return texts, prepared.rejections


def test_prompts_listed_by_id_or_full_sha256_are_rejected_as_in_existing_corpus(
    store_root: Path, tmp_path: Path
) -> None:
    data = write_metamath(tmp_path / "m.json", QUESTIONS)
    first = make_config(data, [])
    prepare_prompts(Store(str(store_root)), RunLayout("r1"), first, "m")
    ids = [
        record["prompt_id"]
        for record in Store(str(store_root)).iter_jsonl(RunLayout("r1").prompt_shard("m", 0))
    ]
    full_sha = hashlib.sha256(
        canonical_content([Message(role="user", content=QUESTIONS[1])], None).encode()
    ).hexdigest()
    id_file = tmp_path / "corpus-ids.txt"
    id_file.write_text(f"# ids of the existing corpus\n{ids[0]}\n\n{full_sha.upper()}\n")
    config = make_config(data, [{"kind": "prompt_ids", "path": str(id_file)}])
    texts, rejections = prepared_questions(Store(str(store_root)), config)
    assert texts == QUESTIONS[2:]
    assert rejections == {"in_existing_corpus": 2}


def test_prompt_files_in_another_layout_are_hashed_like_new_prompts(store_root: Path, tmp_path: Path) -> None:
    data = write_metamath(tmp_path / "m.json", QUESTIONS)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"  {q.upper()} "},
                        {"role": "assistant", "content": "8"},
                    ]
                }
            )
            + "\n"
            for q in QUESTIONS[:3]
        )
        + "not json\n"
    )
    config = make_config(data, [{"kind": "prompts", "path": str(corpus), "format": "openai_messages"}])
    texts, rejections = prepared_questions(Store(str(store_root)), config)
    assert texts == QUESTIONS[3:]
    assert rejections == {"in_existing_corpus": 3}


def test_a_previous_runs_prompts_are_not_taken_again(store_root: Path, tmp_path: Path) -> None:
    store = Store(str(store_root))
    data = write_metamath(tmp_path / "m.json", QUESTIONS)
    first = make_config(data, [], max_prompts=3)
    taken, _ = prepared_questions(store, first, run="r1")
    second = make_config(data, [{"kind": "run", "path": str(store_root / "runs" / "r1")}])
    texts, rejections = prepared_questions(store, second)
    assert sorted(texts + taken) == sorted(QUESTIONS) and not set(texts) & set(taken)
    assert rejections == {"in_existing_corpus": 3}


def test_a_dataset_version_is_read_through_its_shards_prompt_id_column(
    store_root: Path, tmp_path: Path
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    store = Store(str(store_root))
    data = write_metamath(tmp_path / "m.json", QUESTIONS)
    prepare_prompts(store, RunLayout("r1"), make_config(data, []), "m")
    ids = [record["prompt_id"] for record in store.iter_jsonl(RunLayout("r1").prompt_shard("m", 0))]
    shards = []
    for index, chunk in enumerate([ids[:2], ids[6:]]):
        part = tmp_path / f"part-{index}.parquet"
        pq.write_table(pa.table({"prompt_id": chunk, "input_ids": [[1, 2]] * len(chunk)}), part)
        shards.append({"url": str(part), "rows": len(chunk), "source": "r0"})
    manifest = tmp_path / "v0001.json"
    manifest.write_text(json.dumps({"name": "d", "version": 1, "run_id": "r0", "rows": 4, "shards": shards}))
    config = make_config(data, [{"kind": "dataset_version", "path": str(manifest)}])
    texts, rejections = prepared_questions(store, config)
    assert texts == QUESTIONS[2:6]
    assert rejections == {"in_existing_corpus": 4}

    foreign = tmp_path / "foreign.parquet"
    pq.write_table(pa.table({"input_ids": [[1]]}), foreign)
    manifest.write_text(
        json.dumps(
            {
                "name": "d",
                "version": 1,
                "run_id": "r0",
                "rows": 1,
                "shards": [{"url": str(foreign), "rows": 1, "source": "x"}],
            }
        )
    )
    with pytest.raises(DatasetError, match="no prompt_id column"):
        list(iter_corpus_ids(config.existing_corpus.dedupe_against[0]))


def test_several_sources_make_one_id_set(tmp_path: Path) -> None:
    first = tmp_path / "a.txt"
    first.write_text("0123456789abcdef\n")
    second = tmp_path / "b.txt"
    second.write_text("0123456789ABCDEF\nfedcba9876543210\n")
    config = make_config(
        "unused.json",
        [
            {"kind": "prompt_ids", "path": str(first)},
            {"kind": "prompt_ids", "path": str(tmp_path / "b*.txt")},
        ],
    )
    assert load_corpus_ids(config.existing_corpus) == {"0123456789abcdef", "fedcba9876543210"}


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"kind": "prompt_ids", "path": "/no/such/ids.txt"}, "no prompt id file"),
        ({"kind": "run", "path": "/no/such/run"}, "no prompt shards"),
        ({"kind": "dataset_version", "path": "/no/such/v0001.json"}, "does not exist"),
        (
            {"kind": "prompts", "path": "/no/such/corpus.jsonl", "format": "sharegpt"},
            "No dataset files found",
        ),
    ],
)
def test_a_missing_corpus_source_is_a_clear_error(source: dict[str, Any], message: str) -> None:
    config = make_config("unused.json", [source])
    with pytest.raises(DatasetError, match=message):
        load_corpus_ids(config.existing_corpus)


def test_a_line_that_is_not_an_id_is_an_error_naming_the_line(tmp_path: Path) -> None:
    ids = tmp_path / "ids.txt"
    ids.write_text("0123456789abcdef\nWhat is 2+2?\n")
    config = make_config("unused.json", [{"kind": "prompt_ids", "path": str(ids)}])
    with pytest.raises(DatasetError, match="line 2 of"):
        load_corpus_ids(config.existing_corpus)


def test_a_prompts_source_needs_its_format() -> None:
    with pytest.raises(ConfigError, match="needs `format`"):
        make_config("unused.json", [{"kind": "prompts", "path": "/corpus.jsonl"}])
