"""What a run's creation carries besides its parameters, tried as a trigger-only caller would: a real
`prefect server start` with auth, `datagen deploy` from a clone, two process workers on the pool, every run
created through ``POST /deployments/{id}/create_flow_run``. One stack serves every check.

* the form offers the box's configs: ``config`` is an enum of the clone's configs, so an unknown or malformed
  name is refused at create-flow-run (409); a run that turned the server's check off is refused by the flow in
  one ``run failed:`` line, no traceback, under ``expand-refused`` (not Prefect's random name);
* the flow checks its own Prefect context first: a caller's retries are refused and the run runs once; a work
  queue the config does not allow (another box's, a made-up one) is refused; ``stream_output`` is no run's
  job variable (422);
* the box's ceilings: ``max_tokens`` over the planned context, ``samples_per_prompt`` over the config's, a run
  over the prompt budget are refused naming the ceiling; ``top_k`` and ``temperature`` beyond what engines take
  are refused at create-flow-run;
* one run id, one runner: a second run of a run id while the first runs is refused at once, and training is
  handed back once;
* ``expand-host`` runs only for its parent: without one (409), with a parent that does not exist, or with a
  running ``expand`` run that never started it, it is refused before it writes into the (completed) run's folder.

Every refused run: nothing executed (the restart command's marker never written, the stand-in trainer never
signalled), nothing written under the store.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.fault_server import FaultServer
from tests.support.prefect_stack import PrefectStack, copy_checkout

REPO = Path(__file__).resolve().parents[2]
POOL = "gpu-box"
MANUAL = "expand/expand-manual"
HOST = "expand-host/expand-host"
RUN_TIMEOUT_S = 420.0
# The run id of the run the lease check completes; the host-part vectors then aim at its folder.
LEASED_RUN = "leased-run"
PROMPTS = 6
# How long the first run is held mid-generation for the second to end (a refusal takes a flow run's start).
SECOND_RUNNER_WAIT_S = 150.0
# A queue of the pool that belongs to another box (no config of this one allows it).
OTHER_BOX_QUEUE = "other-box"
FAR_FUTURE = {"type": "SCHEDULED", "state_details": {"scheduled_time": "2099-01-01T00:00:00Z"}}


@dataclass
class Stack:
    """The deployed clone, its server and two workers, the fake model server and what a run must not touch."""

    root: Path
    prefect: PrefectStack
    clone: Path
    store: Path
    server: FaultServer
    marks: Path
    sleeper: subprocess.Popen[bytes]
    restarts: Path

    def deployment(self, name: str) -> dict[str, Any]:
        """The deployment as the API returns it."""
        found = self.prefect.api.get(f"/deployments/name/{name}")
        found.raise_for_status()
        data: dict[str, Any] = found.json()
        return data

    def create(self, name: str, **body: Any) -> httpx.Response:
        """``POST /deployments/{id}/create_flow_run`` with ``body``: what a trigger-only caller sends."""
        return self.prefect.api.post(f"/deployments/{self.deployment(name)['id']}/create_flow_run", json=body)

    def finish(self, flow_run_id: str) -> tuple[dict[str, Any], str]:
        """The flow run once it ended, and its log."""
        self.prefect.wait_final(flow_run_id, RUN_TIMEOUT_S)
        return self.prefect.flow_run(flow_run_id), self.prefect.flow_run_logs(flow_run_id)


def _write_config(clone: Path, name: str, data: dict[str, Any]) -> None:
    (clone / "configs" / f"{name}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def _configs(
    clone: Path, url: str, prompts: Path, store: Path, marks: Path, pidfile: Path, restarts: Path
) -> None:
    base: dict[str, Any] = {
        "model": {"path": "../runs/_demo/tiny-model"},
        "fleet": {"engine": "external", "external_urls": [url], "max_inflight_per_server": 2},
        "sampling": {"max_tokens": 16},
        "datasets": [
            {"name": "questions", "format": "openai_messages", "path": str(prompts), "category": "chat"}
        ],
        "output": str(store),
        "generation": {"checkpoint_every": 2, "checkpoint_interval_s": 0.5, "request_timeout_s": 30},
        "tokenize": {"dataset_name": "drafter-expansion"},
    }
    # A trainer the run would halt (a signal to the stand-in) and a restart that leaves a mark.
    guarded = {
        "kind": "pidfile",
        "pidfile": str(pidfile),
        "restart_after_run": True,
        "restart_command": ["touch", str(marks / "restart")],
    }
    _write_config(clone, "trust-guarded", {**base, "training": guarded})
    # The same with a prompt budget its dataset (no quota) exceeds.
    _write_config(clone, "trust-budget", {**base, "training": guarded, "run_choices": {"max_prompts": 2}})
    # A run whose restart appends a line: one line per hand-back.
    marking = {
        "kind": "none",
        "restart_after_run": True,
        "restart_command": ["sh", "-c", f"echo handed-back >> {restarts}"],
    }
    _write_config(clone, "trust-run", {**base, "training": marking})
    # A multi-host config whose one host polls the pool's default queue, as a forged host part would use it.
    hosts = {
        **base,
        "training": guarded,
        "hosts": [{"name": "box-a", "work_queue": "default"}],
        "multi_host": {"ready_timeout_s": 5, "poll_interval_s": 0.5},
    }
    _write_config(clone, "trust-hosts", hosts)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    """A clone with the test's configs, deployed with `datagen deploy`, a server with auth and two workers."""
    root = tmp_path_factory.mktemp("origin")
    prefect = PrefectStack(home=root / "prefect-home").launch()
    marks = root / "marks"
    marks.mkdir()
    sleeper = subprocess.Popen(["sleep", "1200"])
    pidfile = root / "trainer.pid"
    pidfile.write_text(str(sleeper.pid))
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"question {index}: explain it."}]}) + "\n"
            for index in range(PROMPTS)
        )
    )
    server = FaultServer()
    server.start()
    try:
        clone = copy_checkout(REPO, root / "clone")
        (clone / "runs" / "_demo").mkdir(parents=True, exist_ok=True)
        shutil.copytree(tiny_model_dir, clone / "runs" / "_demo" / "tiny-model")
        store = root / "store"
        _configs(clone, server.url, prompts, store, marks, pidfile, root / "restarts.txt")
        subprocess.run(["git", "-C", str(clone), "add", "-A"], check=True)
        subprocess.run(
            [
                "git",
                "-C",
                str(clone),
                "-c",
                "user.name=t",
                "-c",
                "user.email=t@l",
                "commit",
                "-qm",
                "configs",
            ],
            check=True,
        )
        prefect.wait_ready()
        deployed = subprocess.run(
            [sys.executable, "-m", "flows.cli_entry", "deploy"],
            cwd=root,
            env=prefect.env(PYTHONPATH=str(clone)),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        prefect.create_work_queue(POOL, OTHER_BOX_QUEUE)
        for index in (1, 2):
            prefect.start_worker(
                POOL,
                root / f"worker-{index}",
                f"worker-{index}",
                PYTHONPATH=str(clone),
                DATAGEN_STATE_DIR=str(root / "host-state"),
                DATAGEN_GPU_LOCK_TIMEOUT_S="600",
            )
        yield Stack(root, prefect, clone, store, server, marks, sleeper, root / "restarts.txt")
    finally:
        sleeper.kill()
        sleeper.wait()
        server.stop()
        prefect.stop()


def _tree(folder: Path) -> dict[str, str]:
    if not folder.exists():
        return {}
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def leased(stack: Stack) -> Iterator[tuple[tuple[dict[str, Any], str], tuple[dict[str, Any], str]]]:
    """A run held mid-generation, a second run of its run id started meanwhile; both once they ended."""
    stack.server.answering.clear()  # the first run stays mid-generation until the second has ended
    try:
        first = stack.create(MANUAL, parameters={"config": "trust-run", "run_id": LEASED_RUN}).json()["id"]
        deadline = time.monotonic() + RUN_TIMEOUT_S / 2
        while not stack.server.chat_requests():
            assert time.monotonic() < deadline, stack.prefect.flow_run_logs(first)[-3000:]
            time.sleep(0.5)
        second = stack.create(MANUAL, parameters={"config": "trust-run", "run_id": LEASED_RUN}).json()["id"]
        # Refused at once; a runner without a lease would wait for the GPUs until the first gave them back.
        stack.prefect.wait_final(second, SECOND_RUNNER_WAIT_S)
    finally:
        stack.server.answering.set()
    yield stack.finish(first), stack.finish(second)


def test_a_second_runner_of_a_run_id_is_refused_and_training_is_handed_back_once(
    stack: Stack, leased: tuple[tuple[dict[str, Any], str], tuple[dict[str, Any], str]]
) -> None:
    (first, first_log), (second, second_log) = leased

    assert first["state_type"] == "COMPLETED", first_log[-6000:]
    assert second["state_type"] == "FAILED", second_log[-6000:]
    assert second_log.count("run failed:") == 1 and "Traceback" not in second_log, second_log[-6000:]
    assert f"run_id: run {LEASED_RUN} is running in another flow run" in second_log, second_log[-3000:]
    assert "stage=preflight" not in second_log and "stage=gpu-lock" not in second_log, second_log[-3000:]
    time.sleep(2)  # a second hand-back would be a detached process: give it the time to show
    assert stack.restarts.read_text().splitlines() == ["handed-back"], "training was handed back twice"
    manifest = json.loads((stack.store / "runs" / LEASED_RUN / "manifest.json").read_text())
    assert manifest["counts"]["completions"] == PROMPTS


@dataclass
class Vector:
    """One create-flow-run request and what must refuse it: the server (``status``) or the flow (201)."""

    deployment: str
    body: dict[str, Any]
    names: str  # what the refusal names
    status: int = 201


@dataclass
class Sent:
    """Every vector's answer, and the end of each run it created."""

    vectors: dict[str, Vector]
    answers: dict[str, httpx.Response] = field(default_factory=dict)
    ends: dict[str, tuple[dict[str, Any], str]] = field(default_factory=dict)
    fake_parent: str = ""
    store_before: dict[str, str] = field(default_factory=dict)  # the store's files and digests, before ...
    store_after: dict[str, str] = field(default_factory=dict)  # ... and after every vector


def _parameters(config: str = "trust-guarded", **choices: Any) -> dict[str, Any]:
    return {"config": config, **choices}


def _vectors(fake_parent: str) -> dict[str, Vector]:
    host = {"config": "trust-hosts", "run_id": LEASED_RUN, "host": "box-a", "attempt_id": "forged-attempt"}
    return {
        # The form's configs.
        "unknown-config": Vector(MANUAL, {"parameters": _parameters("no-such-config")}, "config", 409),
        "malformed-config": Vector(MANUAL, {"parameters": _parameters("../configs/x")}, "config", 409),
        "unchecked-unknown-config": Vector(
            MANUAL,
            {
                "parameters": _parameters("no-such-config", run_id="unchecked"),
                "enforce_parameter_schema": False,
            },
            "config: no config named",
        ),
        # The create body's other fields.
        "retries": Vector(
            MANUAL,
            {
                "parameters": _parameters(run_id="retried"),
                "empirical_policy": {"retries": 3, "retry_delay": 0},
            },
            "empirical_policy.retries: ",
        ),
        "other-box-queue": Vector(
            MANUAL,
            {"parameters": _parameters(run_id="other-box"), "work_queue_name": OTHER_BOX_QUEUE},
            "work_queue_name: ",
        ),
        "made-up-queue": Vector(
            MANUAL,
            {"parameters": _parameters(run_id="made-up"), "work_queue_name": "made-up-queue"},
            "work_queue_name: ",
        ),
        "stream-output": Vector(
            MANUAL,
            {"parameters": _parameters(), "job_variables": {"stream_output": False}},
            "stream_output",
            422,
        ),
        # The box's ceilings.
        "max-tokens": Vector(
            MANUAL,
            {"parameters": _parameters(run_id="long", sampling={"max_tokens": 10**9})},
            "sampling.max_tokens",
        ),
        "samples-per-prompt": Vector(
            MANUAL,
            {"parameters": _parameters(run_id="many", sampling={"samples_per_prompt": 64})},
            "sampling.samples_per_prompt: at most 1",
        ),
        "prompt-budget": Vector(
            MANUAL,
            {"parameters": _parameters("trust-budget", run_id="budget")},
            "max_prompts: this run would plan",
        ),
        "top-k": Vector(MANUAL, {"parameters": _parameters(sampling={"top_k": 2**40})}, "2147483647", 409),
        "temperature": Vector(
            MANUAL, {"parameters": _parameters(sampling={"temperature": 1e300})}, "2.0", 409
        ),
        # A host part without its parent.
        "host-without-parent": Vector(HOST, {"parameters": host}, "parent_flow_run_id", 409),
        "host-missing-parent": Vector(
            HOST,
            {"parameters": {**host, "parent_flow_run_id": str(uuid.uuid4())}},
            "parent_flow_run_id: no such",
        ),
        "host-foreign-parent": Vector(
            HOST,
            {"parameters": {**host, "parent_flow_run_id": fake_parent}},
            "parent_flow_run_id: the parent never listed its host parts",
        ),
    }


@pytest.fixture(scope="module")
def sent(stack: Stack, leased: object) -> Iterator[Sent]:
    """Every vector sent at once (after the leased run completed); the runs they created, waited for together."""
    # A running `expand` run that no host part belongs to: created far in the future (no worker takes it), then
    # set Running as its own engine would.
    created = stack.create(
        MANUAL, parameters={"config": "trust-hosts", "run_id": LEASED_RUN}, state=FAR_FUTURE
    )
    assert created.status_code == 201, created.text
    fake_parent = created.json()["id"]
    running = stack.prefect.api.post(
        f"/flow_runs/{fake_parent}/set_state", json={"state": {"type": "RUNNING"}, "force": True}
    )
    assert running.status_code in (200, 201), running.text
    found = Sent(_vectors(fake_parent), fake_parent=fake_parent, store_before=_tree(stack.store))
    try:
        for name, vector in found.vectors.items():
            found.answers[name] = stack.create(vector.deployment, **vector.body)
        for name, answer in found.answers.items():
            if answer.status_code == 201:
                found.ends[name] = stack.finish(answer.json()["id"])
        time.sleep(2)  # a restart would be detached: give it the time to show
        found.store_after = _tree(stack.store)
        yield found
    finally:
        stack.prefect.api.delete(f"/flow_runs/{fake_parent}")


def _check(stack: Stack, sent: Sent, name: str) -> None:
    vector, answer = sent.vectors[name], sent.answers[name]
    assert answer.status_code == vector.status, answer.text
    if vector.status != 201:
        assert vector.names in answer.text, answer.text
        assert name not in sent.ends
    else:
        run, log = sent.ends[name]
        assert run["state_type"] == "FAILED", log[-6000:]
        assert run["run_count"] == 1, f"the run ran {run['run_count']} times"
        refusal = [line for line in log.splitlines() if line.startswith("run failed:")]
        assert len(refusal) == 1 and vector.names in refusal[0], log[-6000:]
        assert "Traceback" not in log and "Engine execution exited" not in log, log[-6000:]
        assert "stage=preflight" not in log, log[-3000:]
    assert not any(stack.marks.iterdir()), "a restart command ran"
    assert stack.sleeper.poll() is None, "the stand-in trainer was signalled"


def _nothing_written(sent: Sent) -> None:
    assert sent.store_after == sent.store_before, "a refused run wrote into the store"


def test_the_form_offers_the_boxs_configs_and_refuses_any_other_at_creation(stack: Stack, sent: Sent) -> None:
    schema = stack.deployment(MANUAL)["parameter_openapi_schema"]
    names = sorted(path.stem for path in (stack.clone / "configs").glob("*.yaml"))
    assert schema["properties"]["config"]["enum"] == names
    assert stack.deployment(HOST)["parameter_openapi_schema"]["properties"]["config"]["enum"] == names
    for name in ("unknown-config", "malformed-config", "unchecked-unknown-config"):
        _check(stack, sent, name)
    run, _ = sent.ends["unchecked-unknown-config"]
    assert run["name"] == "expand-refused", run["name"]
    _nothing_written(sent)


def test_the_flow_refuses_retries_and_work_queues_its_caller_chose(stack: Stack, sent: Sent) -> None:
    for name in ("retries", "other-box-queue", "made-up-queue", "stream-output"):
        _check(stack, sent, name)
    _nothing_written(sent)


def test_choices_over_the_boxs_ceilings_are_refused_naming_the_ceiling(stack: Stack, sent: Sent) -> None:
    for name in ("max-tokens", "samples-per-prompt", "prompt-budget", "top-k", "temperature"):
        _check(stack, sent, name)
    _nothing_written(sent)


def test_a_host_part_runs_only_for_the_parent_that_started_it(stack: Stack, sent: Sent) -> None:
    for name in ("host-without-parent", "host-missing-parent", "host-foreign-parent"):
        _check(stack, sent, name)
    assert not (stack.store / "runs" / LEASED_RUN / "hosts").exists(), (
        "a host part wrote into a completed run"
    )
    _nothing_written(sent)
