"""Crash-proof runs: the real flow in a real process against a real S3-protocol server, SIGKILLed at random.

Generation goes to two fault-injecting OpenAI-compatible servers (the `external` engine) that record every
request they receive, so the test can tell exactly which requests were sent again after each kill. The
flow process (`datagen run`) is killed at least five times at random moments, then allowed to finish.
Then: every request appears exactly once across completions and failures; every object that existed at
a kill is unchanged at the end; every object parses (no partial object); the protected prefix is
untouched; and every request sent again after a kill was in flight at that kill (sent, no stored result).

A second test starts two flow processes on the same run id at once.
"""

from __future__ import annotations

import functools
import io
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from datagen.output.s3_client import make_s3_client
from tests.support.fault_server import FaultPlan, FaultServer
from tests.support.s3_proxy import S3FaultProxy

PROMPTS = 320
KILLS = 4
# The first kill lands at a random moment of start-up; the others at a random moment after the attempt
# sent its first request (a window short enough that several kills are needed to finish the run).
STARTUP_KILL_WINDOW_S = (0.5, 3.0)
GENERATION_KILL_WINDOW_S = (0.0, 2.0)
GENERATION_START_TIMEOUT_S = 90
# `datagen run`'s exit code for a run refused before anything started.
EXIT_REFUSED = 2
FLOW_TIMEOUT_S = 240

pytestmark = pytest.mark.usefixtures("prefect_api")


def _existing_parquet() -> bytes:
    import pyarrow as pa

    buffer = io.BytesIO()
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1, 1]]}), buffer)
    return buffer.getvalue()


# Stands in for the irreplaceable training data under the protected prefix.
EXISTING_PARQUET = _existing_parquet()


@pytest.fixture()
def bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    name = f"chaos-{uuid.uuid4().hex[:10]}"
    client = make_s3_client(endpoint_url=s3_endpoint, region="us-east-1")
    client.create_bucket(Bucket=name)
    client.put_object(Bucket=name, Key="train/existing-000.parquet", Body=EXISTING_PARQUET)
    return name


@functools.cache
def _client(endpoint: str) -> Any:
    return make_s3_client(endpoint_url=endpoint, region="us-east-1")


def _snapshot(endpoint: str, bucket: str) -> dict[str, str]:
    """Every object's key -> ETag (the MD5 of its bytes, or of its parts' MD5s): one listing, no downloads."""
    client = _client(endpoint)
    objects: dict[str, str] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for item in page.get("Contents", []):
            objects[item["Key"]] = f"{item['ETag']} {item['Size']}"
    return objects


@functools.cache
def _read(endpoint: str, bucket: str, key: str) -> bytes:
    # Cached: objects are write-once (a changed object is caught by the ETags of _snapshot).
    return bytes(_client(endpoint).get_object(Bucket=bucket, Key=key)["Body"].read())


def _write_inputs(tmp_path: Path, bucket: str, urls: list[str], model_dir: Path, run_id: str) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    with prompts.open("w") as handle:
        for index in range(PROMPTS):
            message = {"role": "user", "content": f"Chaos question {index:04d}: explain."}
            handle.write(json.dumps({"messages": [message]}) + "\n")
    config = {
        "run_id": run_id,
        "model": {"path": str(model_dir)},
        "fleet": {"engine": "external", "external_urls": urls, "max_inflight_per_server": 4},
        "sampling": {"temperature": 0.7, "max_tokens": 16},
        "datasets": [{"name": "chaos", "format": "openai_messages", "path": str(prompts), "shard_size": 40}],
        "output": f"s3://{bucket}/expansion",
        "protected_prefixes": [f"s3://{bucket}/train"],
        "generation": {
            "max_attempts": 6,
            "backoff_initial_s": 0.05,
            "backoff_max_s": 0.5,
            "checkpoint_every": 8,
            "checkpoint_interval_s": 0.5,
        },
        "tokenize": {"rows_per_part": 40},
    }
    path = tmp_path / "chaos.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _flow_env(tmp_path: Path, prefect_api: str, endpoint: str) -> dict[str, str]:
    return {
        **os.environ,
        "PREFECT_API_URL": prefect_api,
        "DATAGEN_S3_ENDPOINT_URL": endpoint,
        "DATAGEN_STATE_DIR": str(tmp_path / "state"),
        "PYTHONUNBUFFERED": "1",
    }


def _start_flow(config: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    # Each process stands for its own GPU box (its own host GPU lock): a SIGKILLed attempt cannot release its
    # lock, whose lease would hold the next attempt for up to a minute; the two-process test means two boxes.
    # The lock itself is tested in tests/integration/test_operations.py.
    env = {**env, "DATAGEN_GPU_LOCK": f"chaos-box-{secrets.token_hex(4)}"}
    with log.open("ab") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "flows.cli_entry", "run", "--config", str(config)],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _question(seen: Any) -> str:
    return str(seen.body["messages"][-1]["content"])


def _stored_questions(endpoint: str, bucket: str, prompt_questions: dict[str, str]) -> set[str]:
    """Questions whose result is durable: in a checkpoint part or a final file."""
    stored: set[str] = set()
    client = _client(endpoint)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="expansion/runs/"):
        for item in page.get("Contents", []):
            key = item["Key"]
            if key.endswith(".jsonl") and ("/parts/" in key or "/completions/" in key or "/failures/" in key):
                for line in _read(endpoint, bucket, key).decode().splitlines():
                    if line.strip():
                        stored.add(prompt_questions[json.loads(line)["prompt_id"]])
    return stored


def _check_every_object_parses(endpoint: str, bucket: str, keys: list[str]) -> None:
    for key in keys:
        body = _read(endpoint, bucket, key)
        if key.endswith(".jsonl"):
            for line in body.decode().splitlines():
                json.loads(line)
        elif key.endswith(".json"):
            json.loads(body)
        elif key.endswith(".parquet"):
            pq.read_table(io.BytesIO(body))


def _wait_for_generation(
    servers: list[FaultServer], marks: list[int], process: subprocess.Popen[bytes], log: Path
) -> None:
    """Block until this attempt has sent a request to a server (or fail if it never does)."""
    deadline = time.monotonic() + GENERATION_START_TIMEOUT_S
    while sum(len(server.chat_requests()) for server in servers) <= sum(marks):
        assert process.poll() is None, f"the flow exited before generating; see {log}"
        assert time.monotonic() < deadline, f"the flow never started generating; see {log}"
        time.sleep(0.02)


def _received(servers: list[FaultServer], marks: list[int]) -> tuple[set[str], list[int]]:
    """Questions the servers received since ``marks`` (request counts per server), and the new marks."""
    questions: set[str] = set()
    new_marks = []
    for server, mark in zip(servers, marks, strict=True):
        requests = server.chat_requests()
        questions |= {_question(seen) for seen in requests[mark:]}
        new_marks.append(len(requests))
    return questions, new_marks


def test_flow_killed_at_random_moments_loses_and_duplicates_nothing(
    tmp_path: Path, bucket: str, s3_endpoint: str, prefect_api: str, tiny_model_dir: Path
) -> None:
    rng = random.Random(20261130)
    plan = FaultPlan(rates={"500": 0.03, "reset": 0.02}, base_delay_s=0.3, seed=7)
    # The flow reaches S3 through a proxy that fails a share of requests (5xx, resets before and after the
    # write landed); the test itself reads S3 directly.
    s3_faults = {"500": 0.02, "503": 0.02, "reset_before": 0.02, "reset_after": 0.02}
    with (
        FaultServer(plan) as first,
        FaultServer(plan) as second,
        S3FaultProxy(s3_endpoint, rates=s3_faults, seed=11) as s3_proxy,
    ):
        servers = [first, second]
        config = _write_inputs(tmp_path, bucket, [first.url, second.url], tiny_model_dir, "chaos")
        env = _flow_env(tmp_path, prefect_api, s3_proxy.url)
        log = tmp_path / "flow.log"
        attempts: list[set[str]] = []
        snapshots: list[dict[str, str]] = []
        marks = [0, 0]
        for kill in range(KILLS):
            process = _start_flow(config, env, log)
            if kill == 0:
                # One kill during start-up (preflight, opening the run, preparing prompts)...
                delay_s = rng.uniform(*STARTUP_KILL_WINDOW_S)
            else:
                # ...the others at random moments once this attempt is generating.
                _wait_for_generation(servers, marks, process, log)
                delay_s = rng.uniform(*GENERATION_KILL_WINDOW_S)
            try:
                process.wait(timeout=delay_s)
                pytest.fail(f"the flow finished before it could be killed {KILLS} times; see {log}")
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            received, marks = _received(servers, marks)
            attempts.append(received)
            snapshots.append(_snapshot(s3_endpoint, bucket))
        assert sum(bool(received) for received in attempts) >= KILLS - 1, "kills must land mid-generation"
        final = _start_flow(config, env, log)
        assert final.wait(timeout=FLOW_TIMEOUT_S) == 0, log.read_text()[-5000:]
        received, marks = _received(servers, marks)
        attempts.append(received)
        injected = sum(s3_proxy.injected.values())

    assert injected > 0, "the S3 proxy must actually have failed requests"
    assert "s3 retry" in log.read_text(), "S3 retries are visible in the flow's log"
    end = _snapshot(s3_endpoint, bucket)
    run_prefix = "expansion/runs/chaos/"
    prompt_questions: dict[str, str] = {}
    for key in end:
        if key.startswith(run_prefix + "prompts/") and key.endswith(".jsonl"):
            for line in _read(s3_endpoint, bucket, key).decode().splitlines():
                record = json.loads(line)
                prompt_questions[record["prompt_id"]] = record["messages"][-1]["content"]
    assert len(prompt_questions) == PROMPTS

    # Every request exactly once across the final completions and failures.
    final_ids: list[str] = []
    for key in end:
        if key.startswith((run_prefix + "completions/", run_prefix + "failures/")):
            lines = _read(s3_endpoint, bucket, key).decode().splitlines()
            final_ids += [json.loads(line)["prompt_id"] for line in lines if line.strip()]
    assert sorted(final_ids) == sorted(prompt_questions)

    # Nothing that existed at a kill was modified; nothing partial exists; the protected data is untouched.
    for snapshot in snapshots:
        for key, digest in snapshot.items():
            assert end[key] == digest, f"{key} changed after a kill"
    _check_every_object_parses(s3_endpoint, bucket, sorted(end))
    assert _read(s3_endpoint, bucket, "train/existing-000.parquet") == EXISTING_PARQUET
    assert [key for key in end if key.startswith("train/")] == ["train/existing-000.parquet"]
    assert run_prefix + "manifest.json" in end

    # Re-sent after kill k: requests of later attempts that an earlier attempt had already sent. Each must
    # have been in flight at kill k (sent, no durable result); a request with a durable result is never
    # generated again.
    figures = []
    sent_so_far: set[str] = set()
    for index, snapshot in enumerate(snapshots):
        sent_so_far |= attempts[index]
        durable = {
            prompt_questions[json.loads(line)["prompt_id"]]
            for key in snapshot
            if key.endswith(".jsonl") and ("/parts/" in key or "/completions/" in key or "/failures/" in key)
            for line in _read(s3_endpoint, bucket, key).decode().splitlines()
            if line.strip()
        }
        in_flight = sent_so_far - durable
        resent = attempts[index + 1] & sent_so_far
        for later in attempts[index + 1 :]:
            assert not later & durable, "a request with a stored result was generated again"
        assert resent <= in_flight
        figures.append(
            {
                "kill": index + 1,
                "sent": len(sent_so_far),
                "durable": len(durable),
                "in_flight": len(in_flight),
                "resent_next_attempt": len(resent),
            }
        )
    done_keys = [key for key in end if key.startswith(run_prefix + "done/")]
    reported = sum(json.loads(_read(s3_endpoint, bucket, key))["resent_requests"] for key in done_keys)
    (tmp_path / "chaos-figures.json").write_text(json.dumps(figures, indent=2))
    print("chaos figures:", json.dumps(figures))
    print(f"chaos: s3 faults injected={dict(s3_proxy.injected)}")
    print(
        f"chaos: kills={len(snapshots)} resent_total={sum(f['resent_next_attempt'] for f in figures)} "
        f"upper_bound_reported_by_flow={reported}"
    )


def test_two_flow_processes_on_one_run_id_neither_overwrite_nor_duplicate(
    tmp_path: Path, bucket: str, s3_endpoint: str, prefect_api: str, tiny_model_dir: Path
) -> None:
    plan = FaultPlan(base_delay_s=0.05, seed=3)
    with FaultServer(plan) as first, FaultServer(plan) as second:
        config = _write_inputs(tmp_path, bucket, [first.url, second.url], tiny_model_dir, "twins")
        env = _flow_env(tmp_path, prefect_api, s3_endpoint)
        logs = [tmp_path / "a.log", tmp_path / "b.log"]
        processes = [_start_flow(config, env, log) for log in logs]
        codes = [process.wait(timeout=FLOW_TIMEOUT_S) for process in processes]
    outputs = [log.read_text() for log in logs]
    # A clear state for each: the run completed (by this process, or by the other one before it looked), or it
    # was refused at once because the other one runs it (one run id, one runner: exit 2), never a crash.
    refused = "run_id: run twins is running in another flow run"
    for code, output in zip(codes, outputs, strict=True):
        if code == EXIT_REFUSED:
            assert refused in output and "stage=preflight" not in output, output[-5000:]
        else:
            assert code == 0, output[-5000:]
            assert "run twins: done" in output or "run twins: already complete" in output
    assert 0 in codes, outputs

    end = _snapshot(s3_endpoint, bucket)
    run_prefix = "expansion/runs/twins/"
    prompt_ids: set[str] = set()
    for key in end:
        if key.startswith(run_prefix + "prompts/") and key.endswith(".jsonl"):
            prompt_ids |= {
                json.loads(line)["prompt_id"]
                for line in _read(s3_endpoint, bucket, key).decode().splitlines()
            }
    final_ids: list[str] = []
    for key in end:
        if key.startswith((run_prefix + "completions/", run_prefix + "failures/")):
            lines = _read(s3_endpoint, bucket, key).decode().splitlines()
            final_ids += [json.loads(line)["prompt_id"] for line in lines if line.strip()]
    assert sorted(final_ids) == sorted(prompt_ids) and len(prompt_ids) == PROMPTS
    versions = [key for key in end if key.startswith("expansion/datasets/")]
    assert len(versions) == 1, f"one run makes one dataset version, got {versions}"
    _check_every_object_parses(s3_endpoint, bucket, sorted(end))


def test_a_server_hung_on_chat_with_a_healthy_health_costs_seconds_and_the_run_completes(
    tmp_path: Path, bucket: str, s3_endpoint: str, prefect_api: str, tiny_model_dir: Path
) -> None:
    plan = FaultPlan(base_delay_s=0.05, seed=5)
    with FaultServer(plan) as steady, FaultServer(plan) as hung:
        hung.answering.clear()  # chat requests are never answered; GET /health answers 200 throughout
        config = _write_inputs(tmp_path, bucket, [steady.url, hung.url], tiny_model_dir, "hung")
        data = yaml.safe_load(config.read_text())
        # request_timeout_s stays at its default (1,800 s): only the stall rule can free the hung requests.
        data["generation"]["stall_min_s"] = 2.0
        config.write_text(yaml.safe_dump(data))
        log = tmp_path / "flow.log"
        started = time.monotonic()
        process = _start_flow(config, _flow_env(tmp_path, prefect_api, s3_endpoint), log)
        code = process.wait(timeout=FLOW_TIMEOUT_S)
        elapsed_s = time.monotonic() - started
        hung_requests = len(hung.chat_requests())
        hung.answering.set()
    output = log.read_text()
    assert code == 0, output[-5000:]
    assert hung_requests > 0, "the hung server must have been given requests"
    assert "server stalled url=" + hung.url in output, output[-5000:]
    assert elapsed_s < FLOW_TIMEOUT_S

    end = _snapshot(s3_endpoint, bucket)
    run_prefix = "expansion/runs/hung/"
    completed: list[str] = []
    failed: list[str] = []
    for key in end:
        if key.startswith((run_prefix + "completions/", run_prefix + "failures/")):
            lines = [line for line in _read(s3_endpoint, bucket, key).decode().splitlines() if line.strip()]
            ids = [json.loads(line)["prompt_id"] for line in lines]
            (completed if "/completions/" in key else failed).extend(ids)
    assert failed == [] and len(completed) == len(set(completed)) == PROMPTS
