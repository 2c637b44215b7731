"""S3 refusing connections for 90 s mid-run: the run rides it out, and the outage costs at most what was in flight.

A real `datagen run` (reporting to the worker's running Prefect API server) sends to a simulated
OpenAI-compatible server and writes to moto's S3 server through a TCP relay. Once part of the run is answered,
the relay goes away for :data:`OUTAGE_S`: its listener closes (every new connection is refused) and every open
connection is reset, as when S3 or the network to it is down; then it listens again on the same port. The run ends Completed
(exit 0) without a resume: shards keep their results while their writes fail and store them once S3 is back.
Counted at the simulated server, the requests generated more than once stay within the fleet's in-flight cap
(what a shard attempt ending mid-outage could lose); every prompt has exactly one final record; no object
that existed when the outage began changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from datagen.output.s3_client import make_s3_client
from tests.support.fault_server import FaultPlan, FaultServer
from tests.support.prefect_db import seed_prefect_home
from tests.support.run_configs import external_run_config, write_prompts
from tests.support.tcp_outage import TcpOutage

REPO = Path(__file__).resolve().parents[2]
# The outage: a night's run must ride out a 90 s S3 blip without losing work or dying.
OUTAGE_S = 90.0
PROMPTS = 240
SHARD_SIZE = 10
IN_FLIGHT = 4  # one server: the dispatcher's whole in-flight cap
RUNNING_SHARDS = 3
CHECKPOINT_EVERY = 4
OUTAGE_AFTER = 60
RUN_TIMEOUT_S = 420
RUN_ID = "s3-outage-1"
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _objects(client: Any, bucket: str) -> dict[str, str]:
    """Every object's key -> ETag and size."""
    objects: dict[str, str] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for item in page.get("Contents", []):
            objects[item["Key"]] = f"{item['ETag']} {item['Size']}"
    return objects


def _final_records(client: Any, bucket: str) -> list[dict[str, Any]]:
    rows = []
    for kind in ("completions", "failures"):
        prefix = f"out/runs/{RUN_ID}/{kind}/"
        for key in _objects(client, bucket):
            if key.startswith(prefix) and key.endswith(".jsonl"):
                body = client.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
                rows.extend(json.loads(line) for line in body.splitlines() if line.strip())
    return rows


def test_a_90_s_s3_outage_mid_run_is_ridden_out_and_costs_at_most_what_was_in_flight(
    tmp_path: Path, tiny_model_dir: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, prefect_api: str
) -> None:
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    bucket = f"outage-{uuid.uuid4().hex[:10]}"
    client = make_s3_client(endpoint_url=s3_endpoint, region="us-east-1")
    client.create_bucket(Bucket=bucket)
    client.put_object(Bucket=bucket, Key="train/existing.jsonl", Body=b'{"kept": true}\n')
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS, "S3 outage question")
    with TcpOutage(s3_endpoint) as relay, FaultServer(FaultPlan(base_delay_s=0.05)) as server:
        config = external_run_config(
            tmp_path / "run.yaml",
            server_url=server.url,
            model_dir=tiny_model_dir,
            prompts=prompts,
            dataset="outage",
            shard_size=SHARD_SIZE,
            in_flight=IN_FLIGHT,
            output=f"s3://{bucket}/out",
            protected=f"s3://{bucket}/train",
            generation={
                "checkpoint_every": CHECKPOINT_EVERY,
                "checkpoint_interval_s": 0.2,
                "backoff_initial_s": 0.05,
                "max_concurrent_shards": RUNNING_SHARDS,
            },
        )
        env = {
            **os.environ,
            **S3_ENV,
            "DATAGEN_S3_ENDPOINT_URL": relay.url,
            "DATAGEN_STATE_DIR": str(tmp_path / "state"),
            "PREFECT_HOME": str(seed_prefect_home(tmp_path / "prefect-home")),
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        env["PREFECT_API_URL"] = prefect_api
        err = tmp_path / "run.err"
        with err.open("w") as stderr:
            run = subprocess.Popen(
                [sys.executable, "-m", "flows.cli_entry", "run", "--config", str(config), "--run-id", RUN_ID],
                env=env,
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
            )
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while len(server.chat_requests()) < OUTAGE_AFTER:
                assert run.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
                time.sleep(0.02)
            relay.go_down()
            before = _objects(client, bucket)
            sent_at_outage = len(server.chat_requests())
            time.sleep(OUTAGE_S)
            sent_during_outage = len(server.chat_requests()) - sent_at_outage
            relay.come_back()
            code = run.wait(RUN_TIMEOUT_S)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
        sent = Counter(
            request.body["messages"][-1]["content"] for request in server.chat_requests() if request.body
        )

    log = err.read_text()
    assert code == 0, log[-3000:]
    # Met: botocore retried refused connections (a write may straddle the whole outage in its own retries).
    assert "cause=EndpointConnectionError" in log, "the outage was never met"
    redone = sum(count - 1 for count in sent.values())
    assert len(sent) == PROMPTS
    assert redone <= IN_FLIGHT, (
        f"{redone} requests generated more than once (the fleet's in-flight cap is {IN_FLIGHT}); "
        f"{sent_at_outage} sent before the outage, {sent_during_outage} during it"
    )
    records = _final_records(client, bucket)
    keys = [f"{row['prompt_id']}/{row['sample_index']}" for row in records]
    assert len(keys) == len(set(keys)) == PROMPTS, "every prompt has exactly one final record"
    after = _objects(client, bucket)
    assert {key: after.get(key) for key in before} == before, "no object that existed at the outage changed"
