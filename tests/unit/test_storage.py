"""The write-once store, local and S3 (a real moto server on loopback): no overwrite, no protected write."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from datagen.errors import OutputExistsError, ProtectedPrefixError, StorageError
from datagen.output.s3 import S3Backend
from datagen.output.s3_client import S3_MAX_ATTEMPTS, S3Credentials, make_s3_client, s3_storage_options
from datagen.output.store import Store, overlaps


@pytest.fixture()
def s3_store(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Store:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    client = make_s3_client(endpoint_url=s3_endpoint, region="us-east-1")
    bucket = f"bucket-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    root = f"s3://{bucket}"
    return Store(root, protected_prefixes=[f"s3://{bucket}/train"], backend=S3Backend(root, client=client))


@pytest.fixture()
def local_store(tmp_path: Path) -> Store:
    return Store(str(tmp_path / "out"), protected_prefixes=[str(tmp_path / "out" / "train")])


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest) -> Store:
    return request.getfixturevalue(f"{request.param}_store")


def test_second_write_of_a_key_is_refused_and_first_content_kept(store: Store) -> None:
    store.write_text("runs/a/config.json", "first")
    with pytest.raises(OutputExistsError) as raised:
        store.write_text("runs/a/config.json", "second")
    assert isinstance(raised.value, FileExistsError)
    assert store.read_text("runs/a/config.json") == "first"


def test_write_under_protected_prefix_is_refused_before_any_byte(store: Store) -> None:
    with pytest.raises(ProtectedPrefixError) as raised:
        store.write_text("train/part-0.parquet", "x")
    assert isinstance(raised.value, PermissionError)
    assert "protected" in str(raised.value)
    assert not store.exists("train/part-0.parquet")
    store.write_text("training-notes/a.txt", "a sibling prefix that merely starts alike is writable")


@pytest.mark.parametrize("key", ["../escape.txt", "/abs.txt", "runs//x", "runs/./x", "", "runs/a/.."])
def test_keys_that_could_escape_the_root_are_refused(store: Store, key: str) -> None:
    with pytest.raises(StorageError):
        store.write_text(key, "x")


def test_listing_returns_sorted_keys_and_jsonl_streams_back(store: Store) -> None:
    store.write_jsonl("runs/r/b.jsonl", [{"i": 2}, {"i": 3}])
    store.write_jsonl("runs/r/a.jsonl", [{"i": 1}])
    assert store.list("runs/r") == ["runs/r/a.jsonl", "runs/r/b.jsonl"]
    assert [row["i"] for row in store.iter_jsonl("runs/r/b.jsonl")] == [2, 3]
    assert store.exists("runs/r/a.jsonl") and not store.exists("runs/r/c.jsonl")


def test_listing_with_sizes_gives_each_objects_bytes_without_reading_it(store: Store) -> None:
    store.write_bytes("runs/r/b/part.jsonl", b"x" * 70_000)
    store.write_text("runs/r/a.jsonl", "abc\n")
    store.write_text("runs/other.jsonl", "not under the prefix")
    assert store.list_sizes("runs/r") == {"runs/r/a.jsonl": 4, "runs/r/b/part.jsonl": 70_000}
    assert list(store.list_sizes("runs/r")) == store.list("runs/r")
    assert store.list_sizes("runs/none") == {}


def test_concurrent_creates_of_one_key_have_exactly_one_winner(store: Store) -> None:
    outcomes: list[str] = []
    lock = threading.Lock()

    def attempt(index: int) -> None:
        try:
            store.write_text("runs/race/object.txt", f"writer-{index}")
            result = "won"
        except OutputExistsError:
            result = "lost"
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count("won") == 1
    assert store.read_text("runs/race/object.txt").startswith("writer-")


def test_local_store_leaves_no_temporary_or_partial_files(local_store: Store) -> None:
    local_store.write_bytes("runs/x/blob.bin", b"\0" * 100_000)
    root = Path(local_store.root)
    assert [p.name for p in (root / "runs" / "x").iterdir()] == ["blob.bin"]


def test_streamed_writes_are_write_once_refuse_protected_keys_and_leave_nothing_when_cut(
    store: Store,
) -> None:
    info = store.write_stream("runs/x/rows.jsonl", iter([b"a\n", b"b\n"]))
    assert (info.size_bytes, store.read_bytes("runs/x/rows.jsonl")) == (4, b"a\nb\n")
    with pytest.raises(OutputExistsError):
        store.write_stream("runs/x/rows.jsonl", iter([b"c\n"]))
    assert store.read_bytes("runs/x/rows.jsonl") == b"a\nb\n"
    produced: list[bytes] = []

    def chunks() -> Iterator[bytes]:
        produced.append(b"x")
        yield b"x"

    with pytest.raises(ProtectedPrefixError):
        store.write_stream("train/rows.jsonl", chunks())
    assert produced == []  # refused before the stream was read

    def broken() -> Iterator[bytes]:
        yield b"half a row"
        raise RuntimeError("source failed")

    with pytest.raises(RuntimeError):
        store.write_stream("runs/x/cut.jsonl", broken())
    assert not store.exists("runs/x/cut.jsonl")
    assert store.list("runs/x") == ["runs/x/rows.jsonl"]


def test_overlap_detects_nesting_in_both_directions() -> None:
    assert overlaps("s3://b/train", "s3://b/train/part")
    assert overlaps("s3://b/train/part", "s3://b/train")
    assert not overlaps("s3://b/training", "s3://b/train")
    assert not overlaps("s3://b/expansion", "s3://b/train")


def test_missing_object_reads_as_file_not_found(store: Store) -> None:
    with pytest.raises(FileNotFoundError):
        store.read_bytes("runs/a/missing.json")


def test_s3_rewrite_with_identical_bytes_is_an_idempotent_create(s3_store: Store) -> None:
    first = s3_store.write_bytes("runs/a/part-00000.jsonl", b'{"id": 1}\n')
    again = s3_store.write_bytes("runs/a/part-00000.jsonl", b'{"id": 1}\n')
    assert again == first
    with pytest.raises(OutputExistsError):
        s3_store.write_bytes("runs/a/part-00000.jsonl", b'{"id": 2}\n')
    assert s3_store.read_bytes("runs/a/part-00000.jsonl") == b'{"id": 1}\n'


def test_credentials_never_show_their_secrets() -> None:
    credentials = S3Credentials(
        access_key_id="AKIAEXAMPLE",
        secret_access_key="wJalrXUtnFEMI/K7MDENG",
        session_token="FwoGZXIvYXdzEJr",
    )
    shown = [repr(credentials), str(credentials), credentials.model_dump_json()]
    assert not any("wJalrXUtnFEMI" in text or "FwoGZXIvYXdzEJr" in text for text in shown)
    assert "AKIAEXAMPLE" in repr(credentials)


def test_credentials_need_both_halves_of_a_key_pair() -> None:
    with pytest.raises(ValueError, match="both"):
        S3Credentials(access_key_id="AKIAEXAMPLE")


def test_s3fs_options_carry_endpoint_credentials_and_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    from datagen.settings import get_settings

    monkeypatch.setenv("DATAGEN_S3_ENDPOINT_URL", "http://127.0.0.1:9000")
    get_settings.cache_clear()
    try:
        options = s3_storage_options(S3Credentials(access_key_id="AKIAEXAMPLE", secret_access_key="secret"))
    finally:
        get_settings.cache_clear()
    assert options["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:9000"
    assert (options["key"], options["secret"]) == ("AKIAEXAMPLE", "secret")
    assert options["config_kwargs"]["retries"] == {"mode": "standard", "total_max_attempts": S3_MAX_ATTEMPTS}


def test_aws_credentials_block_fields_map_onto_s3_credentials() -> None:
    from tasks.credentials import credentials_from_block_data

    credentials = credentials_from_block_data(
        {
            "aws_access_key_id": "AKIAEXAMPLE",
            "aws_secret_access_key": "secret",
            "aws_session_token": None,
            "profile_name": None,
            "region_name": "eu-west-1",
            "aws_client_parameters": {"endpoint_url": "https://s3.example.internal", "use_ssl": True},
        }
    )
    assert credentials.access_key_id == "AKIAEXAMPLE"
    assert credentials.secret_access_key is not None
    assert credentials.secret_access_key.get_secret_value() == "secret"
    assert (credentials.region, credentials.endpoint_url) == ("eu-west-1", "https://s3.example.internal")
    assert credentials.session_token is None


def test_clients_share_the_service_model_but_each_resolves_its_own_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Clients share one botocore data loader (the S3 model is parsed once per process); what each client
    # signs with must still come from its own arguments, profile or environment at the time it is made.
    shared = tmp_path / "credentials"
    shared.write_text("[archive]\naws_access_key_id = AKIAPROFILE\naws_secret_access_key = profile-secret\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(shared))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAENVFIRST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    first = make_s3_client(endpoint_url="http://127.0.0.1:9", region="us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAENVSECOND")
    second = make_s3_client(endpoint_url="http://127.0.0.1:9", region="us-east-1")
    explicit = make_s3_client(
        endpoint_url="http://127.0.0.1:9",
        region="us-east-1",
        credentials=S3Credentials(access_key_id="AKIAEXPLICIT", secret_access_key="explicit-secret"),
    )
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    profiled = make_s3_client(
        endpoint_url="http://127.0.0.1:9",
        region="us-east-1",
        credentials=S3Credentials(profile_name="archive"),
    )

    def access_key(client: object) -> str:
        return str(client._request_signer._credentials.get_frozen_credentials().access_key)  # type: ignore[attr-defined]

    assert [access_key(client) for client in (first, second, explicit, profiled)] == [
        "AKIAENVFIRST",
        "AKIAENVSECOND",
        "AKIAEXPLICIT",
        "AKIAPROFILE",
    ]
    assert first._loader is profiled._loader


def test_a_level_lists_one_folder_never_what_lies_deeper(store: Store) -> None:
    store.write_text("runs/r/completions/a/shard-00000.jsonl", "{}\n")
    store.write_text("runs/r/completions/a/runs/x/completions/a/shard-00000.jsonl", "{}\n")
    store.write_text("runs/r/completions/notes.txt", "stray")
    level = store.list_level("runs/r/completions")
    assert level.objects == {"runs/r/completions/notes.txt": 5}
    assert level.folders == ["runs/r/completions/a"]
    inner = store.list_level("runs/r/completions/a/")
    assert list(inner.objects) == ["runs/r/completions/a/shard-00000.jsonl"]
    assert inner.folders == ["runs/r/completions/a/runs"]
    assert store.list_level("runs/nothing-here").objects == {}
