"""Streaming rows out of dataset files: JSONL, JSON arrays, Parquet; paths, globs, directories, s3://."""

from __future__ import annotations

import gzip
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datagen.errors import DatasetError
from datagen.prompts.datasets import iter_rows, resolve_files
from datagen.prompts.datasets.jsonstream import CHUNK_CHARS
from datagen.settings import get_settings

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "datasets"


def test_jsonl_broken_line_is_reported_as_a_row_error_and_reading_continues(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n\n{"a": \n{"a": 3}\n')
    rows = list(iter_rows(str(path)))
    assert [(row.index, row.data) for row in rows] == [(0, {"a": 1}), (1, None), (2, {"a": 3})]
    assert rows[1].error is not None and "line 3" in rows[1].error


def test_json_array_elements_spanning_chunk_boundaries_are_read_exactly(tmp_path: Path) -> None:
    # Elements of many sizes, top-level numbers and escaped strings, so boundaries fall everywhere.
    elements: list[object] = []
    for i in range(6000):
        elements.append({"query": f"q{i} " + "x" * (i % 997), "quote": 'say "hi" \\ \u00e9\u4e2d', "n": i})
        elements.append(i * 1234567)
    path = tmp_path / "big.json"
    path.write_text(json.dumps(elements, ensure_ascii=False), encoding="utf-8")
    assert path.stat().st_size > 2 * CHUNK_CHARS
    assert [row.data for row in iter_rows(str(path))] == elements


def test_json_file_whose_top_level_is_an_object_is_a_clear_error() -> None:
    with pytest.raises(DatasetError, match="top level of this JSON file is an object"):
        list(iter_rows(str(FIXTURES / "not_an_array.json")))


def test_truncated_json_array_is_a_clear_error_after_the_complete_elements() -> None:
    rows = iter_rows(str(FIXTURES / "truncated_array.json"))
    assert next(rows).data == {"query": "a"}
    with pytest.raises(DatasetError, match=r"not valid JSON|truncated"):
        next(rows)


def test_empty_json_array_has_no_rows() -> None:
    assert list(iter_rows(str(FIXTURES / "empty_array.json"))) == []


def test_directory_and_glob_read_parquet_parts_in_sorted_order_with_running_indices(tmp_path: Path) -> None:
    data = tmp_path / "infinity"
    data.mkdir()
    for part in (1, 0):
        rows = [
            {"id": part * 10 + i, "conversations": [{"from": "human", "value": f"p{part}-{i}"}]}
            for i in range(3)
        ]
        pq.write_table(pa.Table.from_pylist(rows), data / f"train-{part:05d}.parquet")
    (data / "README.md").write_text("not data")
    by_directory = list(iter_rows(str(data)))
    by_glob = list(iter_rows(str(data / "train-*.parquet")))
    assert [row.data["id"] for row in by_directory] == [0, 1, 2, 10, 11, 12]
    assert [row.index for row in by_directory] == list(range(6))
    assert [row.data for row in by_glob] == [row.data for row in by_directory]


def test_compressed_jsonl_is_decompressed_while_streaming(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl.gz"
    with gzip.open(path, "wt") as handle:
        handle.write('{"query": "a"}\n{"query": "b"}\n')
    assert [row.data for row in iter_rows(str(path))] == [{"query": "a"}, {"query": "b"}]


def test_limit_stops_reading_early() -> None:
    rows = list(iter_rows(str(FIXTURES / "infinity_instruct_hostile.jsonl"), limit=3))
    assert [row.index for row in rows] == [0, 1, 2]


@pytest.mark.parametrize(
    "path", ["BAAI/Infinity-Instruct", "BAAI/Infinity-Instruct:0625", "hf://datasets/x/y"]
)
def test_hub_ids_are_refused_with_advice_to_use_a_local_copy(path: str) -> None:
    with pytest.raises(DatasetError, match=r"Hub is not reachable.*local disk or S3"):
        resolve_files(path)


def test_missing_path_and_unsupported_file_type_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="No dataset files found"):
        resolve_files(str(tmp_path / "missing" / "*.parquet"))
    with pytest.raises(DatasetError, match="No dataset files found"):
        resolve_files("data/missing.jsonl")
    other = tmp_path / "data.csv"
    other.write_text("a,b\n")
    with pytest.raises(DatasetError, match="unsupported type"):
        resolve_files(str(other))


def test_a_file_that_is_not_parquet_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "fake.parquet"
    path.write_bytes(b"definitely not parquet")
    with pytest.raises(DatasetError, match="Cannot read Parquet file"):
        list(iter_rows(str(path)))


@pytest.fixture()
def s3_bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("DATAGEN_S3_ENDPOINT_URL", s3_endpoint)
    get_settings.cache_clear()
    bucket = f"data-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    yield bucket
    get_settings.cache_clear()


def test_s3_prefix_streams_parquet_json_array_and_jsonl(s3_bucket: str, s3_endpoint: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    table = pa.Table.from_pylist([{"question": "p0"}, {"question": "p1"}])
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    client.put_object(Bucket=s3_bucket, Key="web/a.parquet", Body=sink.getvalue().to_pybytes())
    client.put_object(Bucket=s3_bucket, Key="web/b.json", Body=b'[{"question": "j0"}]')
    client.put_object(Bucket=s3_bucket, Key="web/c.jsonl", Body=b'{"question": "l0"}\n')
    rows = list(iter_rows(f"s3://{s3_bucket}/web"))
    assert [row.data["question"] for row in rows] == ["p0", "p1", "j0", "l0"]
    assert rows[0].file == f"s3://{s3_bucket}/web/a.parquet"
    globbed = list(iter_rows(f"s3://{s3_bucket}/web/*.json"))
    assert [row.data for row in globbed] == [{"question": "j0"}]


@pytest.mark.parametrize(
    "path", ["BAAI/Infinity-Instruct:0625", "hf://datasets/NousResearch/hermes-function-calling-v1"]
)
def test_reading_a_hub_id_without_the_hub_is_a_clear_error_with_the_way_out(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No Hub here: either the `datasets` library is absent (the error names the extra to install) or it is
    # present but offline (the error says the Hub is not reachable). Both say how to use a local copy.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DatasetError, match=r"(datagen\[hub\]|not reachable).*local disk or S3"):
        list(iter_rows(path, limit=1))
