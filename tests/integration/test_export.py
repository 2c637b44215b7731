"""The trainer export of a dataset version: rows equal to the Parquet parts, write-once, listed, streamed."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from datagen.app.cli import app
from datagen.config import RunConfig
from datagen.dataset.export import export_keys, find_export, training_commands
from datagen.dataset.versions import DatasetVersion, ExportRecord
from datagen.errors import OutputExistsError
from datagen.output.s3 import S3Backend
from datagen.output.s3_client import make_s3_client
from datagen.output.store import Store
from tests.support.qwen import build_qwen_tokenizer_dir
from tests.support.trainer_rows import merge_run, parquet_rows


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen_tokenizer_dir(tmp_path_factory.mktemp("qwen3"), "qwen3")


def tree(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def jsonl_rows(path: str) -> list[tuple[list[int], list[int]]]:
    with open(path) as handle:
        return [(row["input_ids"], row["loss_mask"]) for row in map(json.loads, handle)]


def test_merge_with_jsonl_writes_base_and_new_rows_as_the_parquet_holds_them_and_lists_the_export(
    tmp_path: Path, qwen3_dir: Path
) -> None:
    root = tmp_path / "store"
    first = merge_run(root, qwen3_dir, "run-a", "alpha", 0)
    second = merge_run(
        root,
        qwen3_dir,
        "run-b",
        "beta",
        100,
        base_version=first.dataset_version_url,
        formats=["parquet", "jsonl"],
    )
    store = Store(str(root))
    version = DatasetVersion.model_validate(store.read_json(second.dataset_version))
    assert [shard.source for shard in version.shards].count("run-b") == len(second.parts)
    assert len(version.shards) > len(second.parts) > 1  # base parts and several new parts
    (record,) = version.exports
    assert second.exports == [record]
    assert find_export(store, version) == record
    rows = parquet_rows(version)
    assert jsonl_rows(record.url) == rows
    assert record.rows == len(rows) == version.rows == first.rows + second.rows
    assert record.tokens == sum(len(ids) for ids, _ in rows)
    assert record.loss_tokens == sum(sum(mask) for _, mask in rows) == first.loss_tokens + second.loss_tokens
    assert record.longest_row_tokens == max(len(ids) for ids, _ in rows)
    assert record.parts == version.parquet_urls()
    data = Path(record.url).read_bytes()
    assert record.size_bytes == len(data) and record.sha256 == hashlib.sha256(data).hexdigest()
    # The export's folder holds only the rows: speculators' --data on the folder reads nothing else.
    assert [path.name for path in Path(record.url).parent.iterdir()] == ["train.jsonl"]
    # The first version was written without an export and still has none.
    assert find_export(store, DatasetVersion.model_validate(store.read_json(first.dataset_version))) is None


def test_datagen_export_adds_only_new_objects_and_a_second_export_is_a_no_op(
    tmp_path: Path, qwen3_dir: Path
) -> None:
    root = tmp_path / "store"
    summary = merge_run(root, qwen3_dir, "run-a", "alpha", 0)
    before = tree(root)

    result = CliRunner().invoke(app, ["export", summary.dataset_version_url, "--tokenizer", str(qwen3_dir)])
    assert result.exit_code == 0, result.output

    after = tree(root)
    assert {key: after[key] for key in before} == before  # nothing existing rewritten
    version = DatasetVersion.model_validate(Store(str(root)).read_json(summary.dataset_version))
    data_key, record_key = export_keys(version.name, version.shards)
    assert sorted(set(after) - set(before)) == sorted([data_key, record_key])
    assert jsonl_rows(str(root / data_key)) == parquet_rows(version)
    record = find_export(Store(str(root)), version)
    assert record is not None
    longest = max(len(ids) for ids, _ in parquet_rows(version))
    for line in training_commands(record, str(qwen3_dir)):
        assert line in result.output
    assert f"data.prompts_path={root / data_key} data.max_length={longest}" in result.output
    assert f"--seq-length {longest}" in result.output

    again = CliRunner().invoke(app, ["export", summary.dataset_version_url])
    assert again.exit_code == 0, again.output
    assert tree(root) == after


def test_an_export_interrupted_before_its_record_is_checked_and_finished(
    tmp_path: Path, qwen3_dir: Path
) -> None:
    root = tmp_path / "store"
    summary = merge_run(root, qwen3_dir, "run-a", "alpha", 0)
    store = Store(str(root))
    version = DatasetVersion.model_validate(store.read_json(summary.dataset_version))
    data_key, record_key = export_keys(version.name, version.shards)
    rows = parquet_rows(version)
    lines = "".join(
        json.dumps({"input_ids": ids, "loss_mask": mask}, separators=(",", ":")) + "\n" for ids, mask in rows
    )
    store.write_text(data_key, lines)  # the rows landed, the record did not

    result = CliRunner().invoke(app, ["export", summary.dataset_version_url])
    assert result.exit_code == 0, result.output
    assert store.exists(record_key)
    assert (root / data_key).read_text() == lines


def test_an_export_whose_rows_differ_from_the_parts_is_refused(tmp_path: Path, qwen3_dir: Path) -> None:
    root = tmp_path / "store"
    summary = merge_run(root, qwen3_dir, "run-a", "alpha", 0)
    store = Store(str(root))
    version = DatasetVersion.model_validate(store.read_json(summary.dataset_version))
    data_key, record_key = export_keys(version.name, version.shards)
    store.write_text(data_key, '{"input_ids":[1],"loss_mask":[1]}\n')

    result = CliRunner().invoke(app, ["export", summary.dataset_version_url])
    assert result.exit_code == 1
    assert "holds other rows than the version's parts" in result.output
    assert not store.exists(record_key)


def test_a_part_with_other_rows_than_the_version_lists_is_refused(tmp_path: Path, qwen3_dir: Path) -> None:
    root = tmp_path / "store"
    summary = merge_run(root, qwen3_dir, "run-a", "alpha", 0)
    store = Store(str(root))
    version = DatasetVersion.model_validate(store.read_json(summary.dataset_version))
    wrong = [version.shards[0].model_copy(update={"rows": version.shards[0].rows + 1}), *version.shards[1:]]
    bad = version.model_copy(update={"shards": wrong, "version": 9})
    store.write_json("datasets/drafter-expansion/v0009.json", bad)

    result = CliRunner().invoke(app, ["export", str(root / "datasets/drafter-expansion/v0009.json")])
    assert result.exit_code == 1
    assert "the version lists" in result.output
    assert not store.exists(export_keys(bad.name, bad.shards)[0])


def test_formats_keep_parquet_and_leave_older_config_hashes_alone(tmp_path: Path) -> None:
    base = {
        "run_id": "r",
        "model": {"path": str(tmp_path)},
        "datasets": [{"name": "a", "format": "openai_messages", "path": "unused"}],
        "output": str(tmp_path),
    }
    default = RunConfig.model_validate(base)
    assert default.tokenize.formats == ["parquet"]
    assert "formats" not in default.identity_dict()["tokenize"]
    with_jsonl = RunConfig.model_validate({**base, "tokenize": {"formats": ["jsonl", "parquet"]}})
    assert with_jsonl.tokenize.formats == ["parquet", "jsonl"]
    assert with_jsonl.config_hash() != default.config_hash()
    with pytest.raises(ValueError, match="keep `parquet`"):
        RunConfig.model_validate({**base, "tokenize": {"formats": ["jsonl"]}})


def test_streamed_writes_to_s3_are_multipart_write_once_and_whole(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    client = make_s3_client(endpoint_url=s3_endpoint, region="us-east-1")
    bucket = f"export-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=bucket)
    backend = S3Backend(f"s3://{bucket}/root", client=client)
    part = 5 * 1024 * 1024  # S3's smallest part
    data = os.urandom(2 * part + 12345)
    chunks = [data[start : start + 1_000_000] for start in range(0, len(data), 1_000_000)]

    assert backend.create_stream("big.jsonl", iter(chunks), part_bytes=part) == len(data)
    head = client.head_object(Bucket=bucket, Key="root/big.jsonl")
    # A multipart object: two parts of 5 MiB, then the rest.
    assert head["ETag"].strip('"').endswith("-3")
    assert backend.read("big.jsonl") == data
    with pytest.raises(OutputExistsError):
        backend.create_stream("big.jsonl", iter([b"other"] * 3 + chunks), part_bytes=part)
    assert backend.read("big.jsonl") == data
    assert (
        client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    )  # the refused one was aborted

    assert backend.create_stream("small.jsonl", iter([b"a\n", b"b\n"]), part_bytes=part) == 4
    assert backend.read("small.jsonl") == b"a\nb\n"
    with pytest.raises(OutputExistsError):
        backend.create_stream("small.jsonl", iter([b"c\n"]), part_bytes=part)


def test_s3_export_prints_a_download_before_the_trainer_commands() -> None:
    record_url = "s3://bucket/out/datasets/d/exports/abc/train.jsonl"
    lines = training_commands(
        ExportRecord(
            key="datasets/d/exports/abc/train.jsonl",
            url=record_url,
            parts=[],
            rows=1,
            tokens=5,
            loss_tokens=2,
            longest_row_tokens=5,
            size_bytes=10,
            sha256="0" * 64,
        )
    )
    assert lines[0].startswith(f"aws s3 cp {record_url} ./train.jsonl")
    assert any("data.prompts_path=./train.jsonl data.max_length=5" in line for line in lines)


def test_the_report_shows_each_trainers_command_or_how_to_export(tmp_path: Path, qwen3_dir: Path) -> None:
    from datagen.dataset.report import COMMAND_BLOCK_CHARS, build_report

    root = tmp_path / "store"
    plain = merge_run(root, qwen3_dir, "run-a", "alpha", 0)
    exported = merge_run(root, qwen3_dir, "run-b", "beta", 100, formats=["parquet", "jsonl"])
    config = RunConfig.model_validate(
        {
            "run_id": "run-b",
            "model": {"path": str(qwen3_dir)},
            "datasets": [{"name": "beta", "format": "openai_messages", "path": "unused"}],
            "output": str(root),
        }
    )

    def markdown(summary: dict[str, object]) -> str:
        report = build_report(
            run_id="run-b",
            config=config,
            prepared=[],
            shards=[],
            tokenize_summary=summary,
            servers=1,
            generation_wall_s=1.0,
            dataset_mix=[],
            mix_by_category=[],
        )
        return report.to_markdown()

    (record,) = exported.exports
    text = markdown(exported.model_dump(mode="json"))
    assert "## Training on this version" in text
    # Each command wraps an option per line (Prefect's UI cuts a long line of a code block off) and still
    # pastes as the same command: the backslash continuations joined give the CLI's one line back.
    block = text.split("## Training on this version", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert max(len(line) for line in block.splitlines()) <= COMMAND_BLOCK_CHARS
    joined = block.replace(" \\\n    ", " ").replace("\\\n", "")  # what the shell reads
    for line in training_commands(record, str(config.model.tokenizer or qwen3_dir)):
        if not line.startswith("#"):
            assert line.partition("   # ")[0].strip() in joined.splitlines(), line
    assert "\n    --seq-length " in block and "\nspeculators train \\\n    --verifier-name-or-path " in block
    hint = markdown(plain.model_dump(mode="json"))
    assert f"\ndatagen export {plain.dataset_version_url}\n" in hint.replace("\\\n", "")


def test_corpus_adopt_with_jsonl_exports_the_adopted_parts_and_prints_the_commands(
    tmp_path: Path, qwen3_dir: Path
) -> None:
    import shutil

    run_root = tmp_path / "run"
    summary = merge_run(run_root, qwen3_dir, "run-a", "alpha", 0)
    corpus = tmp_path / "corpus"
    for part in summary.parts:
        assert part.key is not None
        target = corpus / "chat" / Path(part.key).name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(run_root / part.key, target)
    corpus_before = tree(corpus)
    output = tmp_path / "out"

    result = CliRunner().invoke(app, ["corpus", "adopt", str(corpus), "--output", str(output), "--jsonl"])
    assert result.exit_code == 0, result.output
    store = Store(str(output))
    version = DatasetVersion.model_validate(store.read_json("datasets/existing-corpus/v0001.json"))
    record = find_export(store, version)
    assert record is not None
    assert jsonl_rows(record.url) == parquet_rows(version)
    assert f"data.prompts_path={record.url} data.max_length={record.longest_row_tokens}" in result.output
    assert tree(corpus) == corpus_before


def test_export_of_a_missing_version_is_one_clear_line(tmp_path: Path) -> None:
    missing = tmp_path / "store" / "datasets" / "d" / "v0007.json"
    result = CliRunner().invoke(app, ["export", str(missing)])
    assert result.exit_code == 1
    assert (
        f"export failed: {missing} does not exist; give the URL of a dataset version manifest"
        in result.output
    )
    assert "base_version" not in result.output
    refused = CliRunner().invoke(app, ["export", "v0007.json"])
    assert refused.exit_code == 2
    assert "give the store root with --output" in refused.output
