"""A storage fault costs only what was in flight: real S3 (moto behind a fault proxy), a real HTTP server.

One shard generates through the shared dispatcher while S3 answers every request with a transient error
(409 ConditionalRequestConflict, which botocore does not retry itself, so only datagen's own handling is
measured). While the fault lasts the shard keeps its results and goes on; when it outlasts the shard, the
results stay held for the shard's next attempt (a task retry), which stores them instead of generating them
again: only the requests in flight when the attempt ended are sent twice, and ``resent`` says how many.
"""

from __future__ import annotations

import errno
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import datagen.generation.shard_parts
from datagen.config import DatasetConfig, GenerationConfig, ModelConfig, RunConfig
from datagen.errors import StorageError, TransientStorageError, unfixable_storage_error
from datagen.generation.dispatcher import Dispatcher
from datagen.generation.shard import HeldResults, generate_shard
from datagen.output.layout import RunLayout
from datagen.output.s3_client import S3Credentials, make_s3_client
from datagen.output.store import Store
from datagen.records import CompletionRecord, Message, PromptRecord, PromptShardRef, SamplingParams
from datagen.settings import get_settings
from tests.support.fault_server import FaultPlan, FaultServer
from tests.support.s3_proxy import S3FaultProxy
from tests.support.s3_server import S3Server

DATASET = "faults"
PROMPTS = 80
IN_FLIGHT = 2  # max_inflight_per_server x one server: what an ended attempt may lose
FAULT_AFTER = 20
LAYOUT = RunLayout("storage-faults")
CREDENTIALS = S3Credentials(
    access_key_id="AKIADATAGENTEST0002", secret_access_key="s3cret", region="us-east-1"
)


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    with S3Server() as server:
        yield server.endpoint


@pytest.fixture()
def proxy(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3FaultProxy]:
    with S3FaultProxy(moto_endpoint, seed=3) as running:
        monkeypatch.setenv("DATAGEN_S3_ENDPOINT_URL", running.url)
        get_settings.cache_clear()
        yield running
    get_settings.cache_clear()


@pytest.fixture()
def store(moto_endpoint: str, proxy: S3FaultProxy) -> Store:
    bucket = f"faults-{uuid.uuid4().hex[:12]}"
    make_s3_client(endpoint_url=moto_endpoint, credentials=CREDENTIALS).create_bucket(Bucket=bucket)
    return Store(f"s3://{bucket}/out", protected_prefixes=[f"s3://{bucket}/train"], credentials=CREDENTIALS)


def _config(store: Store) -> RunConfig:
    return RunConfig(
        model=ModelConfig(path="unused"),
        sampling=SamplingParams(max_tokens=8, temperature=0.7),
        datasets=[DatasetConfig(name=DATASET, format="openai_messages", path="unused")],
        output=store.root,
        generation=GenerationConfig(
            checkpoint_every=4, checkpoint_interval_s=0.2, backoff_initial_s=0.01, request_timeout_s=30
        ),
    )


def _prompt_shard(store: Store) -> PromptShardRef:
    prompts = [
        PromptRecord(
            prompt_id=f"q{i:03d}", dataset=DATASET, messages=[Message(role="user", content=f"Q {i}?")]
        )
        for i in range(PROMPTS)
    ]
    store.write_jsonl(LAYOUT.prompt_shard(DATASET, 0), prompts)
    return PromptShardRef(
        dataset=DATASET, shard_index=0, path=LAYOUT.prompt_shard(DATASET, 0), prompts=PROMPTS
    )


def _when(condition: Callable[[], bool], then: Callable[[], None]) -> threading.Thread:
    def watch() -> None:
        deadline = time.monotonic() + 60
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.01)
        then()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _stored_keys(store: Store) -> list[str]:
    return [CompletionRecord.model_validate(r).key for r in store.iter_jsonl(LAYOUT.completions(DATASET, 0))]


def _dispatcher(server: FaultServer, config: RunConfig) -> Dispatcher:
    return Dispatcher(
        [server.url],
        model="m",
        engine="external",
        max_inflight_per_server=IN_FLIGHT,
        generation=config.generation,
    )


def test_s3_failing_mid_shard_costs_nothing_finished(store: Store, proxy: S3FaultProxy) -> None:
    config = _config(store)
    shard = _prompt_shard(store)
    with FaultServer(FaultPlan(base_delay_s=0.05)) as server, _dispatcher(server, config) as dispatcher:
        outage = _when(
            lambda: len(server.chat_requests()) >= FAULT_AFTER, lambda: proxy.set_rates({"409": 1.0})
        )
        back = _when(lambda: len(server.chat_requests()) >= FAULT_AFTER + 30, lambda: proxy.set_rates({}))
        summary = generate_shard(store, LAYOUT, config, shard, dispatcher)
        outage.join(5)
        back.join(5)
        sent = len(server.chat_requests())
    assert proxy.injected["409"] > 0, "the fault never hit a write"
    assert sent == PROMPTS, f"{sent - PROMPTS} finished answers were generated again"
    assert summary.resent_requests == 0 and summary.completions == PROMPTS
    assert (
        sorted(_stored_keys(store)) == sorted({*_stored_keys(store)}) and len(_stored_keys(store)) == PROMPTS
    )


def test_results_an_attempt_could_not_store_are_stored_by_the_next_not_generated_again(
    store: Store, proxy: S3FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(datagen.generation.shard_parts, "STORAGE_PATIENCE_S", 1.0)
    config = _config(store)
    shard = _prompt_shard(store)
    held = HeldResults()
    with FaultServer(FaultPlan(base_delay_s=0.02)) as server, _dispatcher(server, config) as dispatcher:
        outage = _when(
            lambda: len(server.chat_requests()) >= FAULT_AFTER, lambda: proxy.set_rates({"409": 1.0})
        )
        with pytest.raises(TransientStorageError):
            generate_shard(store, LAYOUT, config, shard, dispatcher, held=held)
        outage.join(5)
        first_sent = len(server.chat_requests())
        assert held.count() >= PROMPTS - FAULT_AFTER - IN_FLIGHT - 4, "the unstored results were dropped"

        proxy.set_rates({})  # S3 is back; the task retry runs the shard again
        summary = generate_shard(store, LAYOUT, config, shard, dispatcher, held=held)
        sent: Any = len(server.chat_requests())
    resent = sent - first_sent
    assert resent <= IN_FLIGHT, f"{resent} requests sent again; only the {IN_FLIGHT} in flight may be"
    assert summary.resent_requests == resent
    assert held.count() == 0
    assert summary.completions == PROMPTS and len(set(_stored_keys(store))) == PROMPTS


def test_a_bucket_that_is_gone_is_a_fault_no_retry_cures_named_with_its_bucket(proxy: S3FaultProxy) -> None:
    gone = Store(f"s3://gone-{uuid.uuid4().hex[:12]}/out", credentials=CREDENTIALS)
    with pytest.raises(StorageError) as failed:
        gone.write_bytes(LAYOUT.completions_part(DATASET, 0, 0), b"{}\n")
    where = gone.url(LAYOUT.shard_parts_prefix(DATASET, 0))
    unfixable = unfixable_storage_error(failed.value, where)
    assert unfixable is not None and not unfixable.transient
    assert "NoSuchBucket" in str(unfixable) and where in str(unfixable)
    assert unfixable_storage_error(OSError(errno.ENOSPC, "No space left on device"), "/data/out") is not None
    assert unfixable_storage_error(TransientStorageError("503 after retries"), "s3://b/x") is None
