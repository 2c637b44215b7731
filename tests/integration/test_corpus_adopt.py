"""`datagen corpus adopt` on a corpus under a protected prefix in a real S3-protocol server (moto)."""

from __future__ import annotations

import hashlib
import io
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from datagen.app.cli import app
from datagen.config import RunConfig
from datagen.dataset.merge import merge_and_tokenize
from datagen.dataset.tokenize import TokenizedRow, tokenize_completion
from datagen.dataset.tokenizer import load_tokenizer
from datagen.dataset.versions import DatasetVersion
from datagen.output.layout import RunLayout
from datagen.output.s3_client import make_s3_client
from datagen.output.store import Store
from datagen.records import (
    AssistantCompletion,
    CompletionRecord,
    Message,
    SamplingParams,
    ShardSummary,
    TokenUsage,
)
from datagen.settings import get_settings

CORPUS_PREFIX = "train"
# Two tokenized parts in two category folders, plus a completions file: what the existing corpus holds.
PARTS = {
    "train/code/part-00000.parquet": [([1, 2, 3, 4], [0, 0, 1, 1]), ([5, 6], [0, 1])],
    "train/math/part-00000.parquet": [([7, 8, 9], [0, 1, 1])],
}
COMPLETIONS_KEY = "train/chat/completions-00000.jsonl"


def part_bytes(rows: list[tuple[list[int], list[int]]], dataset: str) -> bytes:
    table = pa.table(
        {
            "input_ids": pa.array([ids for ids, _ in rows], type=pa.list_(pa.int32())),
            "loss_mask": pa.array([mask for _, mask in rows], type=pa.list_(pa.int8())),
            "dataset": [dataset] * len(rows),
        }
    )
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def completion(dataset: str, index: int) -> CompletionRecord:
    return CompletionRecord(
        prompt_id=f"{dataset}-{index:03d}",
        dataset=dataset,
        messages=[Message(role="user", content=f"Question {index}?")],
        completion=AssistantCompletion(content=f"Answer {index}."),
        finish_reason="stop",
        usage=TokenUsage(prompt_tokens=10, completion_tokens=5),
        model="tiny",
        engine="transformers",
        server="http://127.0.0.1:1",
        sampling=SamplingParams(enable_thinking=False),
        latency_s=0.1,
    )


@pytest.fixture()
def bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "DATAGEN_S3_ENDPOINT_URL": s3_endpoint,
    }.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    name = f"adopt-{uuid.uuid4().hex[:10]}"
    client = make_s3_client(endpoint_url=s3_endpoint, region="us-east-1")
    client.create_bucket(Bucket=name)
    # Versioning keeps every write: any write under the protected prefix would leave a second version behind.
    client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    for key, rows in PARTS.items():
        client.put_object(Bucket=name, Key=key, Body=part_bytes(rows, key.split("/")[1]))
    lines = "".join(completion("chat", index).model_dump_json() + "\n" for index in range(3))
    client.put_object(Bucket=name, Key=COMPLETIONS_KEY, Body=lines.encode())
    yield name
    get_settings.cache_clear()


def protected_versions(endpoint: str, bucket: str) -> list[tuple[str, str, str]]:
    """Every (key, version id, etag) under the protected prefix."""
    client = make_s3_client(endpoint_url=endpoint, region="us-east-1")
    versions: list[tuple[str, str, str]] = []
    for page in client.get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=CORPUS_PREFIX):
        for version in page.get("Versions", []):
            versions.append((version["Key"], version["VersionId"], version["ETag"]))
        assert not page.get("DeleteMarkers")
    return sorted(versions)


def object_bytes(endpoint: str, bucket: str, key: str) -> bytes:
    client = make_s3_client(endpoint_url=endpoint, region="us-east-1")
    return bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())


def adopt(bucket: str) -> DatasetVersion:
    result = CliRunner().invoke(
        app,
        [
            "corpus",
            "adopt",
            f"s3://{bucket}/{CORPUS_PREFIX}",
            "--output",
            f"s3://{bucket}/expansion",
            "--category-key-pattern",
            "^(?P<category>[^/]+)/",
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"s3://{bucket}/expansion/datasets/existing-corpus/v0001.json" in result.output
    store = Store(f"s3://{bucket}/expansion")
    return DatasetVersion.model_validate(store.read_json("datasets/existing-corpus/v0001.json"))


def write_finished_shard(store: Store, layout: RunLayout, records: list[CompletionRecord]) -> None:
    store.write_jsonl(layout.completions("fresh", 0), records)
    store.write_jsonl(layout.failures("fresh", 0), [])
    summary = ShardSummary(
        dataset="fresh",
        shard_index=0,
        requests=len(records),
        completions=len(records),
        failures=0,
        prompt_tokens=0,
        completion_tokens=0,
        generation_s=1.0,
        completions_path=layout.completions("fresh", 0),
        failures_path=layout.failures("fresh", 0),
    )
    store.write_json(layout.shard_done("fresh", 0), summary)


def test_adopt_references_every_object_in_place_and_a_later_run_builds_on_it(
    bucket: str, s3_endpoint: str, tiny_model_dir: Path
) -> None:
    before = protected_versions(s3_endpoint, bucket)
    assert len(before) == 3

    base = adopt(bucket)

    part_keys = sorted(PARTS)
    assert [shard.url for shard in base.shards] == [f"s3://{bucket}/{key}" for key in part_keys]
    for shard, key in zip(base.shards, part_keys, strict=True):
        data = object_bytes(s3_endpoint, bucket, key)
        assert shard.size_bytes == len(data)
        assert shard.sha256 == hashlib.sha256(data).hexdigest()
        assert shard.rows == len(PARTS[key])
        assert shard.tokens == sum(len(ids) for ids, _ in PARTS[key])
        assert shard.loss_tokens == sum(sum(mask) for _, mask in PARTS[key])
        assert shard.source == f"adopted:s3://{bucket}/{CORPUS_PREFIX}"
    (source,) = base.completion_sources
    lines = object_bytes(s3_endpoint, bucket, COMPLETIONS_KEY)
    assert source.url == f"s3://{bucket}/{COMPLETIONS_KEY}"
    assert (source.rows, source.size_bytes, source.usage_tokens) == (3, len(lines), 3 * 15)
    assert source.sha256 == hashlib.sha256(lines).hexdigest()
    assert base.rows == 3
    assert base.categories == {"chat": 3, "code": 2, "math": 1}
    assert base.adopted_from == f"s3://{bucket}/{CORPUS_PREFIX}"

    # A following generation run names the adopted version as its base.
    store = Store(f"s3://{bucket}/expansion", protected_prefixes=[f"s3://{bucket}/{CORPUS_PREFIX}"])
    layout = RunLayout("after-adopt")
    write_finished_shard(store, layout, [completion("fresh", index) for index in range(2)])
    config = RunConfig.model_validate(
        {
            "run_id": "after-adopt",
            "model": {"path": str(tiny_model_dir)},
            "datasets": [{"name": "fresh", "format": "openai_messages", "path": "unused"}],
            "output": f"s3://{bucket}/expansion",
            "protected_prefixes": [f"s3://{bucket}/{CORPUS_PREFIX}"],
            "tokenize": {"base_version": f"s3://{bucket}/expansion/datasets/existing-corpus/v0001.json"},
        }
    )
    summary = merge_and_tokenize(store, layout, config)
    following = DatasetVersion.model_validate(store.read_json(summary.dataset_version))
    assert following.base_version == f"s3://{bucket}/expansion/datasets/existing-corpus/v0001.json"
    assert following.shards[: len(base.shards)] == base.shards
    assert following.completion_sources == base.completion_sources
    assert following.rows == base.rows + 2
    # One list of Parquet parts for the whole mix: the adopted parts, then the run's.
    urls = following.parquet_urls()
    assert urls[:2] == [f"s3://{bucket}/{key}" for key in part_keys]
    assert urls[2:] == [f"s3://{bucket}/expansion/{layout.tokenized_part(0)}"]

    # Zero writes under the protected prefix: the same objects, each still at its only version.
    assert protected_versions(s3_endpoint, bucket) == before


def test_adopting_the_same_corpus_again_reuses_its_version(bucket: str, s3_endpoint: str) -> None:
    first = adopt(bucket)
    result = CliRunner().invoke(
        app,
        [
            "corpus",
            "adopt",
            f"s3://{bucket}/{CORPUS_PREFIX}",
            "--output",
            f"s3://{bucket}/expansion",
            "--category-key-pattern",
            "^(?P<category>[^/]+)/",
        ],
    )
    assert result.exit_code == 0, result.output
    store = Store(f"s3://{bucket}/expansion")
    assert store.list("datasets/existing-corpus") == ["datasets/existing-corpus/v0001.json"]
    assert DatasetVersion.model_validate(store.read_json("datasets/existing-corpus/v0001.json")) == first


def test_a_corpus_without_parts_or_completions_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "corpus"
    empty.mkdir()
    (empty / "notes.txt").write_text("nothing to adopt")
    result = CliRunner().invoke(app, ["corpus", "adopt", str(empty), "--output", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "No *.parquet or *.jsonl" in result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.json"))


def test_a_part_whose_mask_and_ids_differ_in_length_is_refused(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "bad.parquet").write_bytes(part_bytes([([1, 2, 3], [0, 1])], "bad"))
    result = CliRunner().invoke(app, ["corpus", "adopt", str(corpus), "--output", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "differ in length" in result.output


def test_adopt_with_the_tokenizer_makes_the_completions_training_parts_of_the_version(
    bucket: str, s3_endpoint: str, tiny_model_dir: Path
) -> None:
    before = protected_versions(s3_endpoint, bucket)
    command = [
        "corpus",
        "adopt",
        f"s3://{bucket}/{CORPUS_PREFIX}",
        "--output",
        f"s3://{bucket}/expansion",
        "--category-key-pattern",
        "^(?P<category>[^/]+)/",
        "--tokenizer",
        str(tiny_model_dir),
        "--workers",
        "1",
    ]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    assert "3 rows, 3 tokenized into parts" in result.output
    store = Store(f"s3://{bucket}/expansion", protected_prefixes=[f"s3://{bucket}/{CORPUS_PREFIX}"])
    base = DatasetVersion.model_validate(store.read_json("datasets/existing-corpus/v0001.json"))

    # The adopted parts where they are, then the completions tokenized into a part in the output store.
    adopted_part_urls = [f"s3://{bucket}/{key}" for key in sorted(PARTS)]
    assert [shard.url for shard in base.shards[:2]] == adopted_part_urls
    (tokenized,) = base.shards[2:]
    assert tokenized.key is not None and tokenized.key.startswith("runs/adopted-")
    assert tokenized.url == f"s3://{bucket}/expansion/{tokenized.key}"
    assert tokenized.rows == 3
    assert base.rows == 3 + 3
    (source,) = base.completion_sources
    assert (source.rows, source.tokenized_rows) == (3, 3)

    # Rows exactly as a run's merge makes them.
    tokenizer = load_tokenizer(str(tiny_model_dir))
    table = pq.read_table(io.BytesIO(store.read_bytes(tokenized.key)))
    for index, row in enumerate(table.to_pylist()):
        expected = tokenize_completion(tokenizer, completion("chat", index), max_length_tokens=None)
        assert isinstance(expected, TokenizedRow)
        assert (row["input_ids"], row["loss_mask"]) == (expected.input_ids, expected.loss_mask)
        assert row["prompt_id"] == f"chat-{index:03d}"

    # Adopting again reuses the version and its parts: nothing new is written.
    objects = store.list("")
    again = CliRunner().invoke(app, command)
    assert again.exit_code == 0, again.output
    assert store.list("") == objects

    # A following run builds on it: one list of Parquet parts for the whole corpus and the new rows.
    layout = RunLayout("after-tokenized-adopt")
    write_finished_shard(store, layout, [completion("fresh", index) for index in range(2)])
    config = RunConfig.model_validate(
        {
            "run_id": layout.run_id,
            "model": {"path": str(tiny_model_dir)},
            "datasets": [{"name": "fresh", "format": "openai_messages", "path": "unused"}],
            "output": f"s3://{bucket}/expansion",
            "protected_prefixes": [f"s3://{bucket}/{CORPUS_PREFIX}"],
            "tokenize": {"base_version": f"s3://{bucket}/expansion/datasets/existing-corpus/v0001.json"},
        }
    )
    summary = merge_and_tokenize(store, layout, config)
    following = DatasetVersion.model_validate(store.read_json(summary.dataset_version))
    assert following.parquet_urls() == [
        *adopted_part_urls,
        tokenized.url,
        f"s3://{bucket}/expansion/{layout.tokenized_part(0)}",
    ]
    assert following.rows == 3 + 3 + 2
    assert protected_versions(s3_endpoint, bucket) == before
