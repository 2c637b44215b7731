"""One test host for the run-state tests: a bucket behind the S3 proxy, an external server, a stand-in trainer.

A :class:`Box` is what a `datagen run` needs on one host; :func:`enter_state` starts a run and holds it in one
of its states (:data:`STATES`) with real slowness from outside (see tests/integration/test_run_states.py).
Test infrastructure, not datagen code.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from datagen.output.s3_client import make_s3_client
from tests.support.fault_server import FaultPlan, FaultServer
from tests.support.run_states import (
    REPO,
    CliRun,
    LockHolder,
    Trainer,
    alive,
    answered,
    describe,
    jsonl_rows,
    processes_mentioning,
    write_fake_nvidia_smi,
)
from tests.support.s3_proxy import DelayRule, S3FaultProxy

PROMPTS = 12
SHARD_SIZE = 4
# Slow things stay slow longer than the 30 s budget: a run that waits one out instead of obeying fails.
HOLD_S = 45.0
# Getting into a state takes a CLI start-up (Prefect's imports, its API server) on a loaded 2-core box.
REACH_TIMEOUT_S = 240.0
# A restarted trainer is launched detached; it shows up in its events file within moments.
RESTART_WAIT_S = 30.0
# A trainer still writing its checkpoint when the run that halted it is killed: the resume adopts that halt
# (waits for the trainer to exit, never signals it again) and restarts it once at its end.
CRASH_CHECKPOINT_S = 15.0
# A resume sends its first request within 30 s of its flow run's start (nothing of the killed run holds it
# back), and within 90 s of the command's start: Prefect's imports and the CLI's temporary API server take
# 10 s on an idle 2-core box, three times that on a loaded one, and are no part of what a crash costs.
RESUME_FIRST_REQUEST_BUDGET_S = 30.0
RESUME_START_BUDGET_S = 90.0
RESUME_TIMEOUT_S = 300.0
# The external server's time per answer: a dozen requests two at a time last a few seconds.
ANSWER_DELAY_S = 0.5
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}

# The state, the stage marker the run logs last in it, and whether training is halted by then; in the order a
# run goes through them (a resume passes every step again, so a chain of kills can take them in this order).
STATES: dict[str, tuple[str, bool]] = {
    "preflight": ("preflight", False),
    "preparing": ("prepare-prompts", False),
    "waiting": ("gpu-lock", False),
    "halting": ("halt-training", True),
    "probing": ("probe", True),
    "starting": ("start-servers", True),
    "generating": ("generate", True),
    "merging": ("merge-and-tokenize", True),
    "reporting": ("manifest", True),
}


@dataclass
class Box:
    """One test's host: state folder, bucket, external server, stand-in trainer, config, environment."""

    tmp: Path
    bucket: str
    s3_endpoint: str
    proxy: S3FaultProxy
    server: FaultServer
    trainer: Trainer
    env: dict[str, str]
    config: Path
    lock_name: str
    checkout: Path = REPO
    runs: list[CliRun] = field(default_factory=list)
    releases: list[Callable[[], None]] = field(default_factory=list)

    @property
    def state_dir(self) -> Path:
        return Path(self.env["DATAGEN_STATE_DIR"])

    @property
    def lock_dir(self) -> Path:
        return Path(self.env["DATAGEN_LOCK_DIR"])

    def run(self, run_id: str, **env: str) -> CliRun:
        """Start `datagen run --config X --run-id R` (the printed resume command is the same)."""
        run = CliRun(self.config, run_id, {**self.env, **env}, self.tmp / "transcript.txt", self.checkout)
        self.runs.append(run)
        return run

    def objects(self, prefix: str) -> dict[str, bytes]:
        """The objects under ``prefix`` of the bucket, read directly (not through the proxy)."""
        client = make_s3_client(endpoint_url=self.s3_endpoint, region="us-east-1")
        found = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                found[item["Key"]] = client.get_object(Bucket=self.bucket, Key=item["Key"])["Body"].read()
        return found


class BoxFactory:
    """Makes :class:`Box` es for one test and cleans every one of them up.

    Args:
        folder: The test's folder.
        s3_endpoint: The S3 server (read directly by the checks).
        proxy: The proxy runs reach S3 through.
        model_dir: The tiny model (its tokenizer renders the rows).
        env: The runs' base environment (Prefect home, API URL or none, PYTHONPATH).
        checkout: The checkout whose code the runs run (``python -m`` imports it first).
    """

    def __init__(
        self,
        folder: Path,
        s3_endpoint: str,
        proxy: S3FaultProxy,
        model_dir: Path,
        env: dict[str, str],
        checkout: Path = REPO,
    ) -> None:
        self.checkout = checkout
        self.folder = folder
        self.s3_endpoint = s3_endpoint
        self.proxy = proxy
        self.model_dir = model_dir
        self.env = env
        self.boxes: list[Box] = []
        self.servers: list[FaultServer] = []

    def make(self, checkpoint_delay_s: float = 0.0) -> Box:
        """A box with its trainer running; its trainer checkpoints for ``checkpoint_delay_s`` when stopped."""
        tmp_path, s3_endpoint, s3_proxy = self.folder, self.s3_endpoint, self.proxy
        bucket = f"states-{uuid.uuid4().hex[:10]}"
        client = make_s3_client(endpoint_url=s3_endpoint, region="us-east-1")
        client.create_bucket(Bucket=bucket)
        rows = [
            {"messages": [{"role": "user", "content": f"State question {index:03d}: why?"}]}
            for index in range(PROMPTS)
        ]
        body = "".join(json.dumps(row) + "\n" for row in rows).encode()
        client.put_object(Bucket=bucket, Key="data/questions.jsonl", Body=body)
        server = FaultServer(FaultPlan(base_delay_s=ANSWER_DELAY_S))
        server.start()
        self.servers.append(server)
        trainer = Trainer(tmp_path / "trainer", checkpoint_delay_s=checkpoint_delay_s)
        lock_name = f"states-box-{uuid.uuid4().hex[:8]}"
        env = {
            **self.env,
            "DATAGEN_STATE_DIR": str(tmp_path / "state"),
            "DATAGEN_GPU_LOCK": lock_name,
            "DATAGEN_S3_ENDPOINT_URL": s3_proxy.url,
            **S3_ENV,
            "PYTHONUNBUFFERED": "1",
        }
        config = {
            "model": {"path": str(self.model_dir)},
            "fleet": {
                "engine": "external",
                "external_urls": [server.url],
                "max_inflight_per_server": 2,
                "ready_timeout_s": 600,
            },
            "sampling": {"max_tokens": 4},
            "datasets": [
                {
                    "name": "questions",
                    "format": "openai_messages",
                    "path": f"s3://{bucket}/data/questions.jsonl",
                    "shard_size": SHARD_SIZE,
                }
            ],
            "output": f"s3://{bucket}/expansion",
            "protected_prefixes": [f"s3://{bucket}/train"],
            "generation": {
                "checkpoint_every": 2,
                "checkpoint_interval_s": 0.5,
                "backoff_initial_s": 0.05,
                "backoff_max_s": 0.5,
                "request_timeout_s": 120,
            },
            "training": trainer.training_config(),
        }
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        trainer.start()
        box = Box(
            tmp_path, bucket, s3_endpoint, s3_proxy, server, trainer, env, path, lock_name, self.checkout
        )
        self.boxes.append(box)
        return box

    def close(self) -> None:
        """Kill what the boxes' runs left, end every slowness, stop the trainers and servers."""
        self.proxy.clear_delays()
        for box in self.boxes:
            for run in box.runs:
                run.kill()
            for release in box.releases:
                release()
            box.trainer.stop()
        for server in self.servers:
            server.stop()


@dataclass
class Slowness:
    """What holds a run in a state: how to tell it is held there, and how to end it."""

    reached: Callable[[], bool]
    release: Callable[[], None]
    env: dict[str, str] = field(default_factory=dict)


def _held(rule: DelayRule) -> Callable[[], bool]:
    return lambda: rule.held_now > 0


def slow_down(box: Box, state: str) -> Slowness:
    """Make the run's way through ``state`` slow, from outside; before the run starts."""
    nothing = lambda: None  # noqa: E731
    if state == "waiting":
        holder = LockHolder(box.lock_dir, box.lock_name)
        return Slowness(
            lambda: any("another run holds this host's GPUs" in line for _, line in box.runs[-1].lines),
            holder.release,
        )
    if state in {"preflight", "preparing", "merging", "reporting"}:
        method, path = {
            "preflight": (None, "/data/questions.jsonl"),  # preflight reads the dataset's first row
            "preparing": ("PUT", "/prompts/"),
            "merging": ("PUT", "/tokenized/"),
            "reporting": ("PUT", "/manifest.json"),
        }[state]
        rule = box.proxy.add_delay(HOLD_S, method=method, path_contains=path, times=1)
        return Slowness(_held(rule), rule.release)
    if state == "halting":
        assert float(box.trainer.argv[-1]) > 0, "the box's trainer must checkpoint slowly"
        return Slowness(lambda: bool(box.trainer.signals()), nothing)
    if state == "probing":
        folder, started = write_fake_nvidia_smi(box.tmp / "fake-bin", HOLD_S)
        return Slowness(started.exists, nothing, {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"})
    if state == "starting":
        box.server.healthy = False

        def healthy() -> None:
            box.server.healthy = True

        return Slowness(lambda: box.server.health_checks > 0, healthy)
    assert state == "generating"
    return Slowness(lambda: len(box.server.chat_requests()) >= 3, nothing)


def enter_state(box: Box, state: str, run_id: str, context: str = "", **env: str) -> tuple[CliRun, Slowness]:
    """Start a run and wait until it is held in ``state``; checks its last stage marker.

    Args:
        box: The host.
        state: One of :data:`STATES`.
        run_id: The run id.
        context: Said in failure messages (e.g. which kill came before).
        **env: More environment for this run (e.g. ``PREFECT_API_URL``).
    """
    slowness = slow_down(box, state)
    box.releases.append(slowness.release)
    run = box.run(run_id, **slowness.env, **env)
    run.wait_until(slowness.reached, f"reached {state}{context}", REACH_TIMEOUT_S)
    stage, _ = STATES[state]
    stages = run.stages()
    assert stages and stages[-1] == stage, (
        f"in {state}{context} the last stage is {stages[-1:]}:\n{run.tail()}"
    )
    return run, slowness


def left_behind(box: Box, run: CliRun) -> str:
    """The run's processes still alive, and any other process naming the test's folder (trainers aside)."""
    trainers = set(box.trainer.started_pids())  # restarted by the run, detached: meant to outlive it
    left = [pid for pid in run.left_running(grace_s=5.0) if pid not in trainers]
    strays = [pid for pid, _ in processes_mentioning(str(box.tmp)) if pid not in trainers and pid not in left]
    return describe(left + strays)


def check_training(box: Box, halted: bool) -> None:
    """Training untouched (not ``halted``), or signalled once and restarted once (one trainer runs)."""
    trainer = box.trainer
    if not halted:
        assert not trainer.signals(), f"training was signalled before the halt:\n{trainer.summary()}"
        assert len(trainer.started_pids()) == 1 and trainer.running(), trainer.summary()
        return
    restarted = trainer.wait_for(starts=2, timeout_s=RESTART_WAIT_S)
    assert restarted, f"training halted by the run was not restarted:\n{trainer.summary()}"
    assert sum(trainer.signals().values()) == 1, f"training signalled more than once:\n{trainer.summary()}"
    time.sleep(1.0)  # a second restart (a bug) would show up now
    assert len(trainer.started_pids()) == 2, f"training restarted more than once:\n{trainer.summary()}"
    assert trainer.running() == trainer.started_pids()[-1:], trainer.summary()


def final_answers(box: Box, run_id: str) -> tuple[set[tuple[str, int]], list[tuple[str, int]]]:
    """The requests the run's prompts make, and the (prompt id, sample) of every final record."""
    root = f"expansion/runs/{run_id}/"
    prompts = {
        (row["prompt_id"], 0)
        for key, data in box.objects(root + "prompts/").items()
        if key.endswith(".jsonl")
        for row in jsonl_rows(data)
    }
    finals: list[tuple[str, int]] = []
    for folder in ("completions/", "failures/"):
        for data in box.objects(root + folder).values():
            finals += list(answered(jsonl_rows(data)).elements())
    return prompts, finals


def sigkill_then_resume(
    box: Box,
    states: list[str],
    run_id: str = "crash",
    *,
    shared_api: str | None = None,
    own_api_in: frozenset[str] = frozenset(STATES),
) -> None:
    """SIGKILL a run held in each of ``states`` in turn (the printed resume command each time), then resume.

    Each run after the first is the printed resume command of the run killed before it; the last one is left
    to finish. Checks: it finishes (exit 0); every request is answered exactly once; every run that sent
    requests sent its first within 30 s of its start; nothing of a killed run is left; training was
    signalled once and restarted once.

    Args:
        box: The host (its runs start the CLI's own temporary Prefect API server unless told otherwise).
        states: The states to kill a run in, in order.
        run_id: The run id of every run.
        shared_api: A running Prefect API the runs killed outside ``own_api_in`` report to.
        own_api_in: The states whose run starts the CLI's own temporary server (all, by default); the final
            resume always does.
    """
    runs: list[tuple[CliRun, int, str]] = []  # each run, the server's request count at its start, its state
    for state in states:
        mark = len(box.server.chat_requests())
        after = f" (after the SIGKILL in {runs[-1][2]})" if runs else ""
        api = {} if state in own_api_in or shared_api is None else {"PREFECT_API_URL": shared_api}
        run, slowness = enter_state(box, state, run_id, after, **api)
        runs.append((run, mark, state))
        run.send(signal.SIGKILL)
        assert run.wait(30) is not None, f"a SIGKILLed run did not end{after}"
        slowness.release()
    resumed = box.run(run_id)
    runs.append((resumed, len(box.server.chat_requests()), "the end"))
    code = resumed.wait(RESUME_TIMEOUT_S)

    assert code == 0, f"the resume after the SIGKILL in {states[-1]} failed:\n{resumed.tail()}"
    prompts, finals = final_answers(box, run_id)
    assert len(prompts) == PROMPTS
    assert sorted(finals) == sorted(prompts), "every request exactly once across completions and failures"
    requests = box.server.chat_requests()
    marks = [mark for _, mark, _ in runs] + [len(requests)]
    for index, (run, mark, _) in enumerate(runs[1:], start=1):
        sent = requests[mark : marks[index + 1]]
        if sent:
            began = run.flow_began()
            first_s, after_start_s = sent[0].arrived_at - began, sent[0].arrived_at - run.started
            assert first_s <= RESUME_FIRST_REQUEST_BUDGET_S and after_start_s <= RESUME_START_BUDGET_S, (
                f"the resume after the SIGKILL in {runs[index - 1][2]} sent its first request {first_s:.1f}s "
                f"after its flow run began ({after_start_s:.1f}s after the command started)"
            )
    if not requests[runs[-1][1] :]:
        assert states[-1] in {"merging", "reporting"}, (
            "the resume sent no request although some were unanswered"
        )
    trainers = set(box.trainer.started_pids())  # restarted by a run, detached: meant to outlive it
    orphans = [pid for run, _, _ in runs[:-1] for pid in run.pids if alive(pid) and pid not in trainers]
    assert not orphans, f"left by a killed run after the resume:\n{describe(orphans)}"
    left = left_behind(box, resumed)
    assert not left, f"left running after the resume:\n{left}"
    check_training(box, halted=True)
