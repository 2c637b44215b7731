"""generate_shard end to end: two real `transformers serve` processes, a real local store."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from datagen.config import DatasetConfig, GenerationConfig, ModelConfig, RunConfig
from datagen.errors import NoLiveServersError, WindowClosingError, is_transient
from datagen.generation.dispatcher import Dispatcher
from datagen.generation.shard import generate_shard
from datagen.output.layout import RunLayout
from datagen.output.store import Store
from datagen.records import (
    AssistantCompletion,
    CompletionRecord,
    FailureRecord,
    Message,
    PromptRecord,
    PromptShardRef,
    SamplingParams,
    ShardSummary,
    TokenUsage,
)
from tests.support.fault_server import FaultServer
from tests.support.transformers_servers import TransformersServerPool

DATASET = "demo"
PROMPTS = 30
CHECKPOINT_EVERY = 7
LAYOUT = RunLayout("it-run")


def make_config(model_dir: Path, output: Path) -> RunConfig:
    return RunConfig(
        model=ModelConfig(path=str(model_dir)),
        sampling=SamplingParams(max_tokens=8, temperature=0.7),
        datasets=[DatasetConfig(name=DATASET, format="openai_messages", path="unused")],
        output=str(output),
        generation=GenerationConfig(
            checkpoint_every=CHECKPOINT_EVERY,
            backoff_initial_s=0.05,
            backoff_max_s=0.5,
            request_timeout_s=60,
            no_live_server_timeout_s=60,
        ),
    )


def write_prompt_shard(store: Store) -> PromptShardRef:
    prompts = [
        PromptRecord(
            prompt_id=f"p{i:03d}",
            dataset=DATASET,
            messages=[Message(role="user", content=f"Question {i}: what is {i} + {i}?")],
        )
        for i in range(PROMPTS)
    ]
    key = LAYOUT.prompt_shard(DATASET, 0)
    store.write_jsonl(key, prompts)
    return PromptShardRef(dataset=DATASET, shard_index=0, path=key, prompts=PROMPTS)


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()
    }


def final_keys(store: Store) -> tuple[list[str], list[str]]:
    completions = [
        CompletionRecord.model_validate(row).key for row in store.iter_jsonl(LAYOUT.completions(DATASET, 0))
    ]
    failures = [
        FailureRecord.model_validate(row).key for row in store.iter_jsonl(LAYOUT.failures(DATASET, 0))
    ]
    return completions, failures


def sent_so_far(dispatcher: Dispatcher) -> int:
    stats = dispatcher.stats()
    return stats.completed + stats.failed


@pytest.fixture()
def dispatcher(transformers_pool: TransformersServerPool, tiny_model_dir: Path) -> Iterator[Dispatcher]:
    config = make_config(tiny_model_dir, tiny_model_dir)
    with Dispatcher(
        transformers_pool.urls,
        model=config.model.served_name or config.model.path,
        engine="transformers",
        max_inflight_per_server=2,
        generation=config.generation,
        liveness=transformers_pool.liveness,
    ) as running:
        wait_until(lambda: len(running.stats().servers_up) == len(transformers_pool.urls))
        yield running


@pytest.fixture()
def complete_run(tmp_path: Path, tiny_model_dir: Path, dispatcher: Dispatcher) -> tuple[Store, ShardSummary]:
    store = Store(str(tmp_path / "first"))
    shard = write_prompt_shard(store)
    summary = generate_shard(
        store, LAYOUT, make_config(tiny_model_dir, tmp_path / "first"), shard, dispatcher
    )
    return store, summary


def test_interrupted_shard_resends_only_the_requests_missing_from_its_parts(
    tmp_path: Path, tiny_model_dir: Path, dispatcher: Dispatcher, complete_run: tuple[Store, ShardSummary]
) -> None:
    first, first_summary = complete_run
    assert first_summary.completions + first_summary.failures == PROMPTS
    kept_parts = [LAYOUT.completions_part(DATASET, 0, 0), LAYOUT.completions_part(DATASET, 0, 1)]
    resumed = Store(str(tmp_path / "resumed"))
    for key in [LAYOUT.prompt_shard(DATASET, 0), *kept_parts]:
        resumed.write_bytes(key, first.read_bytes(key))
    kept = {
        record.key: record
        for key in kept_parts
        for record in (CompletionRecord.model_validate(row) for row in first.iter_jsonl(key))
    }
    # A part is flushed once a checkpoint's worth of results has arrived; results that arrive together (a busy
    # machine) land in the same part, so two parts hold at least 2 x CHECKPOINT_EVERY, and some are still missing.
    assert 2 * CHECKPOINT_EVERY <= len(kept) < PROMPTS
    shard = PromptShardRef(
        dataset=DATASET, shard_index=0, path=LAYOUT.prompt_shard(DATASET, 0), prompts=PROMPTS
    )
    progress: list[tuple[int, int]] = []
    before = sent_so_far(dispatcher)

    summary = generate_shard(
        resumed,
        LAYOUT,
        make_config(tiny_model_dir, tmp_path / "resumed"),
        shard,
        dispatcher,
        progress=lambda done, total, _conversations: progress.append((done, total)),
    )

    missing = PROMPTS - len(kept)
    assert sent_so_far(dispatcher) - before == missing
    assert summary.resent_requests == missing
    # First call: the requests are handed to the dispatcher (what the flow's scheduler waits for); then
    # once per batch of results, counting the requests the kept parts already hold.
    assert progress[0] == (len(kept), PROMPTS)
    assert all(earlier[0] < later[0] for earlier, later in itertools.pairwise(progress))
    assert progress[-1] == (PROMPTS, PROMPTS)
    completions, failures = final_keys(resumed)
    assert len(completions) + len(failures) == PROMPTS
    assert sorted(completions + failures) == sorted(f"p{i:03d}/0" for i in range(PROMPTS))
    final = {
        record.key: record
        for record in (
            CompletionRecord.model_validate(row) for row in resumed.iter_jsonl(LAYOUT.completions(DATASET, 0))
        )
    }
    assert all(final[key] == record for key, record in kept.items()), "records from kept parts were replaced"
    assert ShardSummary.model_validate(resumed.read_json(LAYOUT.shard_done(DATASET, 0))) == summary


def test_final_files_from_an_interrupted_attempt_are_verified_not_rewritten(
    tmp_path: Path, tiny_model_dir: Path, dispatcher: Dispatcher, complete_run: tuple[Store, ShardSummary]
) -> None:
    first, first_summary = complete_run
    crashed = Store(str(tmp_path / "crashed"))
    for key in first.list(LAYOUT.root):
        if key != LAYOUT.shard_done(DATASET, 0):
            crashed.write_bytes(key, first.read_bytes(key))
    before_bytes = snapshot(tmp_path / "crashed")
    before = sent_so_far(dispatcher)
    shard = PromptShardRef(
        dataset=DATASET, shard_index=0, path=LAYOUT.prompt_shard(DATASET, 0), prompts=PROMPTS
    )

    summary = generate_shard(
        crashed, LAYOUT, make_config(tiny_model_dir, tmp_path / "crashed"), shard, dispatcher
    )

    assert sent_so_far(dispatcher) == before
    assert not summary.skipped
    assert (summary.completions, summary.failures) == (first_summary.completions, first_summary.failures)
    after_bytes = snapshot(tmp_path / "crashed")
    assert set(after_bytes) - set(before_bytes) == {LAYOUT.shard_done(DATASET, 0)}
    assert all(after_bytes[key] == value for key, value in before_bytes.items())


def test_shard_survives_a_killed_server_and_a_rerun_is_skipped(
    tmp_path: Path,
    tiny_model_dir: Path,
    dispatcher: Dispatcher,
    transformers_pool: TransformersServerPool,
) -> None:
    root = tmp_path / "store"
    store = Store(str(root))
    shard = write_prompt_shard(store)
    config = make_config(tiny_model_dir, root)
    victim = transformers_pool.servers[1]
    killed_at: list[int] = []

    def kill_mid_run(done: int, total: int, _conversations: int | None) -> None:
        if done >= 8 and not killed_at:
            victim.kill()
            killed_at.append(done)

    summary = generate_shard(store, LAYOUT, config, shard, dispatcher, progress=kill_mid_run)

    assert len(killed_at) == 1 and 8 <= killed_at[0] < PROMPTS
    assert summary.requests == PROMPTS and not summary.skipped
    completions, failures = final_keys(store)
    assert len(completions) == len(set(completions)) and len(failures) == len(set(failures))
    assert not set(completions) & set(failures)
    assert sorted(completions + failures) == sorted(f"p{i:03d}/0" for i in range(PROMPTS))
    assert (summary.completions, summary.failures) == (len(completions), len(failures))
    assert all(row["reason"] for row in store.iter_jsonl(LAYOUT.failures(DATASET, 0)))
    # The last requests may have finished on the other server before the victim's /health probe failed: a
    # reset only makes it suspect (still counted up) until the probe says it is gone.
    wait_until(lambda: victim.url not in dispatcher.stats().servers_up)
    servers_used = {
        CompletionRecord.model_validate(row).server
        for row in store.iter_jsonl(LAYOUT.completions(DATASET, 0))
    }
    assert servers_used == {transformers_pool.servers[0].url, victim.url}

    before = snapshot(root)
    sent = sent_so_far(dispatcher)
    rerun = generate_shard(store, LAYOUT, config, shard, dispatcher)
    assert rerun.skipped
    assert rerun.model_copy(update={"skipped": False}) == summary
    assert snapshot(root) == before
    assert sent_so_far(dispatcher) == sent


def test_parts_are_deduplicated_and_a_completion_beats_a_failure(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    root = tmp_path / "store"
    store = Store(str(root))
    prompts = [
        PromptRecord(
            prompt_id=f"q{i}",
            dataset=DATASET,
            messages=[Message(role="user", content=("[[400]] " if i == 5 else "") + f"q{i}")],
        )
        for i in range(10)
    ]
    store.write_jsonl(LAYOUT.prompt_shard(DATASET, 0), prompts)
    shard = PromptShardRef(dataset=DATASET, shard_index=0, path=LAYOUT.prompt_shard(DATASET, 0), prompts=10)
    config = make_config(tmp_path / "model", root).model_copy(
        update={"generation": GenerationConfig(checkpoint_every=3, backoff_initial_s=0.01)}
    )

    def earlier_completion(index: int, server: str) -> CompletionRecord:
        return CompletionRecord(
            prompt_id=f"q{index}",
            dataset=DATASET,
            messages=prompts[index].messages,
            completion=AssistantCompletion(content=f"earlier {server}"),
            finish_reason="stop",
            usage=TokenUsage(prompt_tokens=3, completion_tokens=2),
            model="m",
            engine="transformers",
            server=server,
            sampling=config.sampling,
            latency_s=0.1,
        )

    def earlier_failure(index: int) -> FailureRecord:
        return FailureRecord(
            prompt_id=f"q{index}", dataset=DATASET, reason="earlier", error_type="http_400", attempts=1
        )

    store.write_jsonl(
        LAYOUT.completions_part(DATASET, 0, 0), [earlier_completion(1, "a"), earlier_completion(2, "a")]
    )
    store.write_jsonl(LAYOUT.completions_part(DATASET, 0, 1), [earlier_completion(2, "b")])
    store.write_jsonl(LAYOUT.failures_part(DATASET, 0, 0), [earlier_failure(1), earlier_failure(3)])

    with FaultServer() as server:
        with Dispatcher(
            [server.url],
            model="m",
            engine="transformers",
            max_inflight_per_server=4,
            generation=config.generation,
        ) as dispatcher:
            summary = generate_shard(store, LAYOUT, config, shard, dispatcher)
        seen = server.contents_seen()

    assert sorted(seen) == sorted(["q0", "q4", "[[400]] q5", "q6", "q7", "q8", "q9"])
    assert all(count == 1 for count in seen.values())
    assert summary.resent_requests == 7
    completions = [
        CompletionRecord.model_validate(row) for row in store.iter_jsonl(LAYOUT.completions(DATASET, 0))
    ]
    failures = [FailureRecord.model_validate(row) for row in store.iter_jsonl(LAYOUT.failures(DATASET, 0))]
    assert [record.prompt_id for record in completions] == ["q0", "q1", "q2", "q4", "q6", "q7", "q8", "q9"]
    assert {record.prompt_id: record.server for record in completions}["q2"] == "a"
    assert [record.prompt_id for record in failures] == ["q3", "q5"]
    assert summary.failure_reasons == {"http_400": 2}
    assert (summary.completions, summary.failures, summary.requests) == (8, 2, 10)
    new_parts = [
        key for key in store.list(LAYOUT.shard_parts_prefix(DATASET, 0)) if key.endswith("-00002.jsonl")
    ]
    assert new_parts == [LAYOUT.completions_part(DATASET, 0, 2)], "new parts start after the existing ones"


def test_requests_that_found_no_server_are_not_final_and_a_rerun_sends_only_them(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = Store(str(root))
    # b, c, d are slow so the server is stopped (right after a) while b is still in flight.
    contents = ["a", "#sleep=0.5 b", "#sleep=0.5 c", "#sleep=0.5 d"]
    prompts = [
        PromptRecord(prompt_id=f"n{i}", dataset=DATASET, messages=[Message(role="user", content=content)])
        for i, content in enumerate(contents)
    ]
    store.write_jsonl(LAYOUT.prompt_shard(DATASET, 0), prompts)
    shard = PromptShardRef(dataset=DATASET, shard_index=0, path=LAYOUT.prompt_shard(DATASET, 0), prompts=4)
    generation = GenerationConfig(
        checkpoint_every=1,
        backoff_initial_s=0.01,
        backoff_max_s=0.02,
        max_attempts=3,
        no_live_server_timeout_s=0.5,
    )
    config = make_config(tmp_path / "model", root).model_copy(update={"generation": generation})

    server = FaultServer()
    server.start()
    with Dispatcher(
        [server.url], model="m", engine="transformers", max_inflight_per_server=1, generation=generation
    ) as dispatcher:
        wait_until(lambda: dispatcher.stats().servers_up == [server.url])

        def stop_after_first(done: int, total: int, _conversations: int | None) -> None:
            if done == 1:
                server.stop()

        with pytest.raises(NoLiveServersError, match="rerun"):
            generate_shard(store, LAYOUT, config, shard, dispatcher, progress=stop_after_first)
        first_attempt = server.contents_seen()

    assert not store.exists(LAYOUT.completions(DATASET, 0))
    assert not store.exists(LAYOUT.shard_done(DATASET, 0))
    assert store.list(LAYOUT.shard_parts_prefix(DATASET, 0)) == [LAYOUT.completions_part(DATASET, 0, 0)]

    with FaultServer() as revived:
        with Dispatcher(
            [revived.url], model="m", engine="transformers", max_inflight_per_server=1, generation=generation
        ) as dispatcher:
            summary = generate_shard(store, LAYOUT, config, shard, dispatcher)
        second_attempt = revived.contents_seen()

    assert first_attempt["a"] == 1
    assert sorted(second_attempt) == sorted(contents[1:])
    assert all(count == 1 for count in second_attempt.values())
    assert (summary.completions, summary.failures, summary.resent_requests) == (4, 0, 3)


def test_a_closing_window_ends_the_shard_with_a_non_transient_error_and_the_next_attempt_sends_the_rest(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    store = Store(str(root))
    contents = ["a", "#sleep=0.5 b", "c", "d"]
    prompts = [
        PromptRecord(prompt_id=f"w{i}", dataset=DATASET, messages=[Message(role="user", content=content)])
        for i, content in enumerate(contents)
    ]
    store.write_jsonl(LAYOUT.prompt_shard(DATASET, 0), prompts)
    shard = PromptShardRef(dataset=DATASET, shard_index=0, path=LAYOUT.prompt_shard(DATASET, 0), prompts=4)
    generation = GenerationConfig(checkpoint_every=1, backoff_initial_s=0.01, backoff_max_s=0.02)
    config = make_config(tmp_path / "model", root).model_copy(update={"generation": generation})

    with FaultServer() as server:
        with Dispatcher(
            [server.url], model="m", engine="transformers", max_inflight_per_server=1, generation=generation
        ) as dispatcher:
            wait_until(lambda: dispatcher.stats().servers_up == [server.url])

            def close_after_first(done: int, _total: int, _conversations: int | None) -> None:
                if done == 1:  # b is in flight now; c and d wait
                    dispatcher.stop_admission(WindowClosingError("the generation window is closing"))

            with pytest.raises(
                WindowClosingError, match="window closed with 2 requests unanswered"
            ) as closed:
                generate_shard(store, LAYOUT, config, shard, dispatcher, progress=close_after_first)
        first_attempt = server.contents_seen()
        assert not is_transient(closed.value)  # Prefect's task retries leave it alone
        assert not store.exists(LAYOUT.shard_done(DATASET, 0))

        with Dispatcher(
            [server.url], model="m", engine="transformers", max_inflight_per_server=1, generation=generation
        ) as dispatcher:
            summary = generate_shard(store, LAYOUT, config, shard, dispatcher)
        second_attempt = {
            content: count - first_attempt.get(content, 0)
            for content, count in server.contents_seen().items()
            if count - first_attempt.get(content, 0)
        }

    # In flight at the stop, b finished and was kept; the next attempt sends exactly what was never sent.
    assert first_attempt == {"a": 1, "#sleep=0.5 b": 1}
    assert second_attempt == {"c": 1, "d": 1}
    assert (summary.completions, summary.failures) == (4, 0)
