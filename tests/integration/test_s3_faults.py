"""The store through a flaky network: a real moto S3 server behind a fault-injecting proxy (boto3, s3fs).

The proxy answers 500/503/409, resets connections before forwarding, and resets them after S3 has
executed the request (the write landed, the client saw an error). Every write must land exactly once
with its bytes, our own lost-response write must be recognised, a different write must still be refused,
retries must show in the logs, and no secret may reach an error or a log line.
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from datagen.errors import OutputExistsError, StorageError, TransientStorageError
from datagen.output.s3_client import (
    S3Credentials,
    make_s3_client,
    s3_storage_options,
)
from datagen.output.store import Store
from datagen.settings import get_settings
from tests.support.s3_proxy import S3FaultProxy
from tests.support.s3_server import S3Server

WRITES = 200
WRITER_THREADS = 32
# One request in five goes wrong, with every kind of fault that botocore retries on its own.
FAULT_RATES = {"500": 0.04, "503": 0.04, "reset_before": 0.04, "reset_after": 0.05, "truncate": 0.03}
ACCESS_KEY_ID = "AKIADATAGENTEST0001"
SECRET_ACCESS_KEY = "Sup3rSecret/NeverLog+ThisValue0123456789"


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    with S3Server() as server:
        yield server.endpoint


@pytest.fixture()
def credentials() -> S3Credentials:
    return S3Credentials(access_key_id=ACCESS_KEY_ID, secret_access_key=SECRET_ACCESS_KEY, region="us-east-1")


@pytest.fixture()
def direct_client(moto_endpoint: str, credentials: S3Credentials) -> Any:
    """A client that talks to moto without the proxy, to set up and to check what really landed."""
    return make_s3_client(endpoint_url=moto_endpoint, credentials=credentials)


@pytest.fixture()
def bucket(direct_client: Any) -> str:
    name = f"faults-{uuid.uuid4().hex[:12]}"
    direct_client.create_bucket(Bucket=name)
    # Versioning keeps every write: a put that landed twice would leave two versions behind.
    direct_client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    return name


@pytest.fixture()
def proxy(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3FaultProxy]:
    with S3FaultProxy(moto_endpoint, seed=7) as running:
        monkeypatch.setenv("DATAGEN_S3_ENDPOINT_URL", running.url)
        get_settings.cache_clear()
        yield running
    get_settings.cache_clear()


@pytest.fixture()
def store(proxy: S3FaultProxy, bucket: str, credentials: S3Credentials) -> Store:
    """A store built the production way (from its URL), reaching S3 through the proxy."""
    return Store(
        f"s3://{bucket}/expansion", protected_prefixes=[f"s3://{bucket}/train"], credentials=credentials
    )


def _versions(client: Any, bucket: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for page in client.get_paginator("list_object_versions").paginate(Bucket=bucket):
        for version in page.get("Versions", []):
            counts[version["Key"]] = counts.get(version["Key"], 0) + 1
    return counts


def _payload(index: int) -> bytes:
    generator = random.Random(index)
    return f"object {index}\n".encode() + generator.randbytes(generator.randrange(10, 64_000))


def test_two_hundred_writes_through_every_fault_land_exactly_once_with_their_bytes(
    store: Store, proxy: S3FaultProxy, direct_client: Any, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="datagen.output.store")
    expected = {f"runs/r/parts/object-{index:05d}.bin": _payload(index) for index in range(WRITES)}
    proxy.set_rates(FAULT_RATES)

    with ThreadPoolExecutor(WRITER_THREADS) as pool:
        written = list(pool.map(lambda item: store.write_bytes(*item), expected.items()))
        read_back = dict(zip(expected, pool.map(store.read_bytes, expected), strict=True))

    assert [info.size_bytes for info in written] == [len(data) for data in expected.values()]
    assert read_back == expected
    assert store.list("runs/r") == sorted(expected)
    assert all(store.exists(key) for key in list(expected)[:20])

    import fsspec

    filesystem = fsspec.filesystem(
        "s3", skip_instance_cache=True, use_listings_cache=False, **s3_storage_options(store.credentials)
    )
    through_s3fs = filesystem.find(f"{bucket}/expansion/runs/r")
    assert len(through_s3fs) == WRITES
    sample = sorted(expected)[:: WRITES // 20]
    for key in sample:
        assert filesystem.cat_file(f"{bucket}/expansion/{key}") == expected[key]
    proxy.set_rates({})

    versions = _versions(direct_client, bucket)
    assert versions == {f"expansion/{key}": 1 for key in expected}
    assert all(proxy.injected[fault] > 0 for fault in FAULT_RATES)
    retries = [record for record in caplog.records if record.getMessage().startswith("s3 retry ")]
    assert retries and any("operation=PutObject" in record.getMessage() for record in retries)
    assert any("operation=GetObject" in r.getMessage() or "HeadObject" in r.getMessage() for r in retries)
    assert any("earlier attempt of this write landed" in record.getMessage() for record in caplog.records)


def test_lost_response_of_a_conditional_write_is_recognised_as_our_own(
    store: Store, proxy: S3FaultProxy, direct_client: Any, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="datagen.output.store")
    proxy.inject_next("reset_after", method="PUT")

    info = store.write_text("runs/r/config.json", '{"hash": "abc"}\n')

    assert info.size_bytes == len('{"hash": "abc"}\n')
    assert proxy.injected["reset_after"] == 1
    puts = [seen for seen in proxy.seen if seen.method == "PUT"]
    assert len(puts) == 2, "the put was forwarded, its answer lost, and botocore's retry met 412"
    assert store.read_text("runs/r/config.json") == '{"hash": "abc"}\n'
    assert _versions(direct_client, bucket) == {"expansion/runs/r/config.json": 1}
    messages = [record.getMessage() for record in caplog.records]
    assert any(m.startswith("s3 retry operation=PutObject attempt=2") for m in messages)
    assert any("earlier attempt of this write landed" in m for m in messages)


@pytest.mark.parametrize("second", [b"other bytes, other size", b"first write! (same size)"])
def test_a_different_second_write_is_refused_even_when_its_response_was_lost(
    store: Store, proxy: S3FaultProxy, direct_client: Any, bucket: str, second: bytes
) -> None:
    first = b"first write! (original)"
    store.write_bytes("runs/r/shard.jsonl", first)
    proxy.inject_next("reset_after", method="PUT")

    with pytest.raises(OutputExistsError):
        store.write_bytes("runs/r/shard.jsonl", second)

    assert proxy.injected["reset_after"] == 1
    assert store.read_bytes("runs/r/shard.jsonl") == first
    assert _versions(direct_client, bucket) == {"expansion/runs/r/shard.jsonl": 1}


def test_a_download_cut_short_resumes_where_it_stopped(
    store: Store, proxy: S3FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="datagen.output.store")
    data = b"".join(f'{{"i": {index}}}\n'.encode() for index in range(50_000))
    store.write_bytes("runs/r/shard.jsonl", data)

    proxy.inject_next("truncate", method="GET")
    assert store.read_bytes("runs/r/shard.jsonl") == data
    proxy.inject_next("truncate", method="GET")
    assert [row["i"] for row in store.iter_jsonl("runs/r/shard.jsonl")] == list(range(50_000))

    assert proxy.injected["truncate"] == 2
    assert len([seen for seen in proxy.seen if seen.method == "GET"]) == 4, (
        "each cut is resumed by one ranged GET"
    )
    resumed = [r.getMessage() for r in caplog.records if "operation=GetObjectBody" in r.getMessage()]
    assert len(resumed) == 2 and all("offset=" in message for message in resumed)


def test_a_concurrent_create_conflict_is_transient_and_the_retry_lands(
    store: Store, proxy: S3FaultProxy
) -> None:
    proxy.inject_next("409", method="PUT")

    with pytest.raises(TransientStorageError) as raised:
        store.write_text("runs/r/done.json", "{}")
    assert raised.value.transient
    store.write_text("runs/r/done.json", "{}")

    assert store.read_text("runs/r/done.json") == "{}"


def test_preflight_of_a_resumed_run_rides_out_transient_s3_errors(
    store: Store,
    proxy: S3FaultProxy,
    bucket: str,
    credentials: S3Credentials,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # S3 answers 500 and 503 SlowDown under load as a matter of course, and resets a connection now and then:
    # a few in a row on the bucket or on the run's stored config (a chaos run met two) must not refuse a resume
    # before anything has started. Only an endpoint where nothing answers is refused in seconds.
    from datagen.app.preflight import check_output_reachable, run_preflight
    from datagen.config import RunConfig
    from datagen.output.runs import open_run
    from datagen.samples import sample_path

    config = RunConfig.model_validate(
        {
            "run_id": "flaky-resume",
            "model": {"path": str(tiny_model_dir)},
            "datasets": [{"name": "metamath", "format": "metamath", "path": sample_path("metamath")}],
            "output": f"s3://{bucket}/expansion",
            "protected_prefixes": [f"s3://{bucket}/train"],
        }
    )
    open_run(store, config)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # The command line's probe before Prefect starts: two resets are an answer, not an unreachable endpoint.
    for fault in ("reset_before", "reset_after"):
        proxy.inject_next(fault, method="HEAD")
    check_output_reachable(config)
    # The flow's preflight: the bucket and the stored config each fail more often than the quick probe tries.
    for fault in ("503", "reset_before", "500"):
        proxy.inject_next(fault, method="HEAD")
    for fault in ("500", "503", "reset_before"):
        proxy.inject_next(fault, method="GET", path_contains="runs/flaky-resume/config.json")

    report = run_preflight(config, credentials=credentials)

    assert all(check.ok for check in report.checks)
    assert proxy.injected == {"500": 2, "503": 2, "reset_before": 3, "reset_after": 1}


def test_requests_are_signed_with_the_configured_credentials_and_no_error_or_log_names_the_secret(
    store: Store, proxy: S3FaultProxy, credentials: S3Credentials, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="datagen")
    proxy.inject_next("503", method="PUT")
    store.write_text("runs/r/a.txt", "a")
    missing_bucket = Store(f"s3://missing-{uuid.uuid4().hex[:8]}/expansion", credentials=credentials)

    with pytest.raises(StorageError) as raised:
        missing_bucket.write_text("runs/r/a.txt", "a")

    assert {seen.access_key_id for seen in proxy.seen} == {ACCESS_KEY_ID}
    error = raised.value
    assert "NoSuchBucket" in str(error)
    texts = [str(error), repr(error), str(error.__cause__), repr(store.backend), repr(missing_bucket.backend)]
    texts += [repr(credentials), str(credentials), credentials.model_dump_json(), caplog.text]
    assert not any(SECRET_ACCESS_KEY in text for text in texts)


def test_credentials_and_endpoint_come_from_the_prefect_block_named_in_the_settings(
    prefect_api: str, moto_endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.blocks.core import Block
    from pydantic import BaseModel, SecretStr

    from datagen.config import RunConfig
    from tasks.context import open_run_store

    class AwsClientParameters(BaseModel):
        endpoint_url: str | None = None

    # The shape of prefect-aws's AwsCredentials block (same type slug and field names), registered for real.
    class AwsCredentials(Block):
        _block_type_slug = "aws-credentials"
        aws_access_key_id: str | None = None
        aws_secret_access_key: SecretStr | None = None
        aws_session_token: str | None = None
        profile_name: str | None = None
        region_name: str | None = None
        aws_client_parameters: AwsClientParameters = AwsClientParameters()

    block_key_id = "AKIAFROMPREFECTBLOCK"
    block_name = f"datagen-s3-{uuid.uuid4().hex[:8]}"
    with S3FaultProxy(moto_endpoint) as proxy:
        AwsCredentials(
            aws_access_key_id=block_key_id,
            aws_secret_access_key=SecretStr(SECRET_ACCESS_KEY),
            region_name="us-east-1",
            aws_client_parameters=AwsClientParameters(endpoint_url=proxy.url),
        ).save(block_name)
        monkeypatch.delenv("DATAGEN_S3_ENDPOINT_URL", raising=False)
        monkeypatch.setenv("DATAGEN_AWS_CREDENTIALS_BLOCK", block_name)
        get_settings.cache_clear()
        try:
            # The way the flows open a run's store: every task then writes through it (its run context).
            config = RunConfig.model_validate(
                {
                    "model": {"path": "/models/unused"},
                    "datasets": [{"name": "d", "format": "metamath", "path": "unused.json"}],
                    "output": f"s3://{bucket}/expansion",
                }
            )
            store = open_run_store(config)
            installed = store.credentials
            store.write_text("runs/r/config.json", "{}")
        finally:
            get_settings.cache_clear()

    assert installed is not None and installed.endpoint_url == proxy.url
    assert SECRET_ACCESS_KEY not in repr(installed)
    assert [seen.access_key_id for seen in proxy.seen if seen.method == "PUT"] == [block_key_id]
