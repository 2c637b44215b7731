"""Operations end to end, the way users run them: a real `prefect server start`, `datagen deploy` from a clone
at an arbitrary path, two real process workers on the pool, and `prefect deployment run --watch`.

* the README's steps run the CPU demo (two `transformers serve` servers, the tiny model) and `--watch` exits 0;
* a bad dataset path makes `--watch` exit non-zero and print why, in one line and without a traceback;
* runs that send what only the box's config decides (one per vector of docs/security.md) are refused before
  anything runs: by the server at create-flow-run (a parameter the flow does not have, the old whole-config
  payload), or by the flow in one line naming the field (a climbing run id, an output at the protected corpus);
  and so are runs that would believe a planted store (a config.json no box made, resumed by its run id; an
  output inside another run's folder, a series' ledger or a dataset's versions), writing nothing under the root;
* two overlapping runs of two deployments on one box never generate at the same time (the host GPU lock);
* two nightly-style runs of one series take disjoint prompts and publish v0001 then v0002 (v0002 on v0001,
  both on the adopted base corpus), writing nothing under the corpus's prefix;
* a cancelled run stops its servers;
* a run cancelled after its API was away (Prefect's runner has stopped watching for cancels) still stops:
  Cancelled, its server gone, training handed back, the GPU lock free, nothing stored changed;
* the server asks for its auth string (the whole module runs with it on): a request without it gets 401;
* the UI served on a non-default port hands the browser the API URL it was given (``PREFECT_UI_API_URL``);
* a run cannot choose the command, environment or folder the worker starts it with: the server refuses those job
  variables (the pool's template from ``datagen deploy``, which also replaces an existing pool's template), and
  a run that reaches a worker with them anyway is refused by the flow, its log naming them.

Generation for the overlap and series checks goes to a small fake OpenAI server (the `external` engine), so
the whole file stays within a few minutes on a 2-core machine. The first two checks are the README's CLI steps;
the others start their runs through the API (the request `prefect deployment run` sends) and wait for the state
`--watch` would report: a CLI start and a watching process fewer per run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from datagen.app.codeversion import code_version
from datagen.dataset.versions import DatasetVersion, TokenizedPartRef
from datagen.host.gpu_lock import gpu_lock_name, is_held, lock_path
from datagen.output.local import TEMP_PREFIX
from tests.support.fault_server import FaultPlan, FaultServer
from tests.support.prefect_stack import PrefectStack, basic_auth_header, copy_checkout, free_port
from tests.support.workers import worker_port

REPO = Path(__file__).resolve().parents[2]
POOL = "gpu-box"
WATCH_TIMEOUT_S = 480
# Per request, so a run's generation lasts a few seconds: long enough for an overlap to show.
FAKE_SERVER_DELAY_S = 0.4
# What Prefect's runner logs when it stops watching its runs for a cancel (prefect/_internal/observers.py).
OBSERVER_GAVE_UP = "Cancellation polling task failed"
# Enough prompts that one CPU server answering one at a time is still generating minutes later.
PROMPTS_FOR_A_LONG_RUN = 2000
# datagen's watch: a poll (5 s), the runner's grace (30 s), then the run's own stop (servers, hand-back).
CANCEL_AFTER_OUTAGE_BUDGET_S = 90.0
# The concurrency limit an operator set on the pool before the module's `datagen deploy` (which must keep it).
OPERATOR_POOL_LIMIT = 7
# The configs this module's tests write into the clone's configs/.
CONFIG_NAMES = (
    "ci-bad-dataset",
    "ci-overlap-alpha",
    "ci-overlap-beta",
    "ci-nightly",
    "ci-cancel",
    "ci-cancel-after-outage",
)


class Stack:
    """The deployed checkout, its server and two workers, and helpers to run deployments."""

    def __init__(
        self,
        root: Path,
        prefect: PrefectStack,
        clone: Path,
        state_dir: Path,
        pool_after_deploy: dict[str, Any],
    ) -> None:
        self.root = root
        self.prefect = prefect
        self.clone = clone
        self.state_dir = state_dir
        # The work pool as the module's `datagen deploy` left it (the pool it found: an older deploy's, limited).
        self.pool_after_deploy = pool_after_deploy

    def run(self, deployment: str, *params: str) -> subprocess.CompletedProcess[str]:
        """``prefect deployment run DEPLOYMENT --param ... --watch`` from outside the checkout (the README's step)."""
        args = ["deployment", "run", deployment]
        for param in params:
            args += ["--param", param]
        args += ["--watch", "--watch-timeout", str(WATCH_TIMEOUT_S)]
        return self.prefect.prefect(*args, cwd=self.root, timeout_s=WATCH_TIMEOUT_S + 60)

    def start(self, deployment: str, **parameters: Any) -> str:
        """Start a run of ``deployment`` through the API (what `prefect deployment run` sends); its flow run id.

        For the tests whose subject is what the flow does on the workers: the first two run the README's
        `prefect deployment run --watch`, which costs a CLI start and a process polling the run to its end.
        """
        return self.prefect.create_flow_run(deployment, **parameters)

    def finish(self, flow_run_id: str) -> tuple[str, str]:
        """The run's final state type (what `--watch` turns into its exit code) and its log, once it ended."""
        state = self.prefect.wait_final(flow_run_id, WATCH_TIMEOUT_S)
        return state, self.prefect.flow_run_logs(flow_run_id)

    def wait_for_log(self, text: str, timeout_s: float) -> bool:
        """Poll the API's logs until one contains ``text``; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            response = self.prefect.api.post("/logs/filter", json={"limit": 200, "sort": "TIMESTAMP_DESC"})
            response.raise_for_status()
            if any(text in entry["message"] for entry in response.json()):
                return True
            time.sleep(1)
        return False

    def flow_run(self, flow_run_id: str) -> dict[str, Any]:
        """The flow run as the API returns it."""
        return self.prefect.flow_run(flow_run_id)

    def cancel(self, flow_run_id: str) -> None:
        """Cancel the flow run: the request `prefect flow-run cancel` and the UI's Cancel button send."""
        response = self.prefect.api.post(
            f"/flow_runs/{flow_run_id}/set_state", json={"state": {"type": "CANCELLING"}}
        )
        response.raise_for_status()
        assert response.json()["status"] == "ACCEPT", response.text


def _write_config(stack: Stack, name: str, data: dict[str, Any]) -> str:
    """Write a config into the clone's configs/ folder; returns its name (what a run picks it by)."""
    path = stack.clone / "configs" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return name


def _fake_config(stack: Stack, url: str, dataset_path: str, output: str, **changes: Any) -> dict[str, Any]:
    """A config whose generation goes to the fake server; relative paths resolve against configs/."""
    data: dict[str, Any] = {
        "model": {"path": "../runs/_demo/tiny-model"},
        "fleet": {"engine": "external", "external_urls": [url], "max_inflight_per_server": 2},
        "sampling": {"max_tokens": 16},
        "datasets": [
            {"name": "questions", "format": "openai_messages", "path": dataset_path, "category": "chat"}
        ],
        "output": output,
        "protected_prefixes": ["../train"],
        "generation": {"checkpoint_every": 4, "checkpoint_interval_s": 0.5, "request_timeout_s": 30},
        "tokenize": {"dataset_name": "drafter-expansion"},
    }
    data.update(changes)
    return data


def _restart_marking(path: Path) -> dict[str, Any]:
    """A training section whose restart command appends the time it ran to ``path``."""
    return {
        "kind": "none",
        "restart_after_run": True,
        "restart_command": ["sh", "-c", f"date +%s.%N >> {path}"],
    }


def _wait_for_file(path: Path, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not path.exists():
        time.sleep(0.2)
    return path.read_text() if path.exists() else ""


def _write_prompts(path: Path, prefix: str, count: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for index in range(count):
            message = {"role": "user", "content": f"{prefix} question {index:03d}: explain it."}
            handle.write(json.dumps({"messages": [message]}) + "\n")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    """A clone at an arbitrary path, deployed with `datagen deploy`, served by a real server and two workers."""
    root = tmp_path_factory.mktemp("operations")
    # A free port, not 4200, and the UI told where the API is by another name than the one it binds: what a
    # browser on another machine needs (README, server step).
    port = free_port()
    prefect = PrefectStack(
        home=root / "prefect-home", port=port, ui_api_url=f"http://localhost:{port}/api"
    ).launch()  # it starts while the clone is made
    state_dir = root / "host-state"
    try:
        clone = copy_checkout(REPO, root / "any" / "path" / "datagen")
        shutil.copytree(tiny_model_dir, clone / "runs" / "_demo" / "tiny-model")
        # Each test writes its config under one of these names; they are there when `datagen deploy` offers the
        # checkout's configs (the deployments refuse any other name).
        for name in CONFIG_NAMES:
            (clone / "configs" / f"{name}.yaml").write_text("# written by its test\n")
        prefect.wait_ready()
        # The pool as an older `datagen deploy` left it (Prefect's default process template), with a limit its
        # operator set: the module's one deploy is also the re-deploy onto an existing pool that
        # test_deploy_gives_an_existing_pool_its_template_and_keeps_its_concurrency_limit reads (a second deploy
        # of its own cost a whole `datagen deploy`). A fresh pool's creation is every other stack's deploy
        # (test_run_origin, test_run_states_prefect, test_multihost).
        from prefect.workers.process import ProcessWorker

        created = prefect.api.post(
            "/work_pools/",
            json={
                "name": POOL,
                "type": "process",
                "base_job_template": ProcessWorker.get_default_base_job_template(),
                "concurrency_limit": OPERATOR_POOL_LIMIT,
            },
        )
        assert created.status_code == 201, created.text
        deployed = subprocess.run(
            [sys.executable, "-m", "flows.cli_entry", "deploy"],
            cwd=root,  # any folder: deploy finds its checkout
            env=prefect.env(PYTHONPATH=str(clone)),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        pool_after_deploy = prefect.api.get(f"/work_pools/{POOL}").json()
        # The operator's limit has been read: the module's runs go without it, as on a fresh box.
        unlimited = prefect.api.patch(f"/work_pools/{POOL}", json={"concurrency_limit": None})
        assert unlimited.status_code == 204, unlimited.text
        # Every deployment carries the clone's commit, which the flow checks on the worker.
        deployments = prefect.api.post("/deployments/filter", json={}).json()
        versions = {found["name"]: found["version"] for found in deployments}
        expected = code_version(clone)
        assert versions == dict.fromkeys(["expand-host", "expand-manual", "expand-nightly"], expected), (
            versions
        )
        # ... and takes no parameter but its flow's own: the server refuses any other at create-flow-run.
        for found in deployments:
            assert found["parameter_openapi_schema"]["additionalProperties"] is False, found["name"]
            assert found["enforce_parameter_schema"] is True, found["name"]
        # Two for the whole module (the overlap test needs both): a second one started by that test alone made it
        # wait ~5 s for the worker to come up, where an idle worker's polls cost ~0.01 CPU-s a second.
        for index in (1, 2):
            prefect.start_worker(
                POOL,
                root / f"worker-{index}",
                f"worker-{index}",
                PYTHONPATH=str(clone),
                DATAGEN_STATE_DIR=str(state_dir),
                DATAGEN_GPU_LOCK_TIMEOUT_S="600",
            )
        yield Stack(root, prefect, clone, state_dir, pool_after_deploy)
    finally:
        prefect.stop()


def test_readme_steps_run_the_cpu_demo_through_a_worker_and_watch_exits_0(stack: Stack) -> None:
    result = stack.run("expand/expand-manual", "config=demo-worker")

    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "Flow run finished successfully in 'Completed'" in result.stdout
    # The run is named after its generated run id, and the fleet's own threads' lines reached the run log.
    run_id = re.search(r"expand-(\d{8}-\d{6}-[0-9a-f]{12})", result.stdout)
    assert run_id is not None, result.stdout[-3000:]
    assert "server ready url=" in result.stdout
    assert "dispatcher started" in result.stdout
    store = stack.clone / "runs" / "_demo" / "store"
    manifest = json.loads((store / "runs" / run_id.group(1) / "manifest.json").read_text())
    assert manifest["counts"]["completions"] > 0


def test_a_bad_dataset_path_fails_the_watch_with_the_reason(stack: Stack, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-prompts.jsonl"
    restarts = tmp_path / "restarts.txt"
    config = _fake_config(
        stack, "http://127.0.0.1:9", str(missing), str(tmp_path / "out"), training=_restart_marking(restarts)
    )
    name = _write_config(stack, "ci-bad-dataset", config)

    result = stack.run("expand/expand-manual", f"config={name}", "run_id=bad-dataset")

    assert result.returncode != 0
    assert "Flow run finished in state 'Failed'" in result.stdout
    # The reason is one line at the end of the CI log: no traceback of the refusal before it (the flow and task
    # engines' are at DEBUG only), no second copy.
    assert result.stdout.count("run failed:") == 1, result.stdout[-6000:]
    assert "Traceback" not in result.stdout + result.stderr, result.stdout[-6000:]
    assert str(missing) in result.stdout.replace("\n", ""), result.stdout[-6000:]
    assert not restarts.exists(), "training was restarted although preflight refused to halt it"


@dataclass
class Vector:
    """One way a run's parameters reached the box (docs/security.md), sent through create-flow-run.

    ``field`` is what the refusal names: the server's 409 for a parameter the flow does not have or a value of
    the wrong type; the run's Failed state for a value of an allowed parameter the flow refuses (``flow=True``);
    Prefect's refusal on the worker for a run that turned the server's check off (``unchecked=True``). A
    ``name`` that would forge log lines is shown escaped: the run's name and every line of its log stay on one
    line.
    """

    deployment: str
    parameters: dict[str, Any]
    field: str
    flow: bool = False
    unchecked: bool = False
    name: str | None = None  # the flow run's name, as the create body gives it


class Vectors:
    """Every vector sent at once, and each one's answer (the runs created, waited for together)."""

    def __init__(self, root: Path, sleeper: subprocess.Popen[bytes]) -> None:
        self.marks = root / "marks"  # what a command of the caller's would create
        self.sleeper = sleeper  # the process a pidfile target would signal
        self.sent: dict[str, Vector] = {}
        self.answers: dict[str, httpx.Response] = {}
        self.ends: dict[str, tuple[str, str, str]] = {}  # state type, state message, log
        self.names: dict[str, str] = {}  # the flow run's name once it ended
        self.messages: dict[str, list[str]] = {}  # every log record of the flow run


# One per vector of docs/security.md ("What each run parameter can reach"), and the host part's deployment.
VECTOR_NAMES = [
    "restart-command",
    "fleet-env",
    "remote-code",
    "climbing-run-id",
    "config-path",
    "dataset-path",
    "external-urls",
    "pidfile",
    "protected-prefixes",
    "output-at-corpus",
    "whole-config",
    "host-part-training",
    "unchecked-training",
    "planted-config",
    "planted-config-with-origin",
    "output-in-a-run",
    "output-in-a-ledger",
    "output-in-versions",
]
# What the planted store holds beside the runs the module makes (docs/security.md, "What a run reads back").
VICTIM_RUN = "victim"
PLANTED_RUNS = {"planted-config": "planted-a", "planted-config-with-origin": "planted-b"}
# A flow run name that would forge a log line of its own (and clear a terminal).
FORGED_RUN_NAME = "intruder\n12:00:00.000 | INFO    | Flow run 'expand-x' - run complete \x1b[2J"
CONTROL_CHARACTERS = re.compile("[\x00-\x1f\x7f-\x9f]")


def _plant_store(store: Path, configs: Path, marks: Path, pidfile: Path) -> None:
    """An output root as anyone who may write under it could leave it: a finished run, a series' ledger, a
    published version, and config.json files of runs no box made (one bare, one with an honest run's origin)."""
    from datagen.app.run_request import RunRequest, resolve_request

    victim = store / "runs" / VICTIM_RUN
    (victim / "completions" / "questions").mkdir(parents=True, exist_ok=True)
    (victim / "completions" / "questions" / "shard-00000.jsonl").write_text('{"victim": 1}\n')
    (victim / "manifest.json").write_text('{"victim": "complete"}\n')
    (store / "series" / "nightly" / "ledger").mkdir(parents=True, exist_ok=True)
    (store / "series" / "nightly" / "ledger" / "night-1.jsonl").write_text('{"prompt_id": "p1"}\n')
    (store / "datasets" / "drafter-demo").mkdir(parents=True, exist_ok=True)
    (store / "datasets" / "drafter-demo" / "v0001.json").write_text('{"version": 1}\n')
    hostile = {
        "kind": "pidfile",
        "pidfile": str(pidfile),
        "restart_after_run": True,
        "restart_command": ["touch", str(marks / "planted-restart")],
    }
    # What an honest run of demo-worker records as its origin: the file's name, its sha256, no choices.
    origin = {
        "config": "demo-worker",
        "config_sha256": hashlib.sha256((configs / "demo-worker.yaml").read_bytes()).hexdigest(),
        "choices": {},
    }
    for name, run_id in PLANTED_RUNS.items():
        honest = resolve_request(RunRequest(config="demo-worker", run_id=run_id), configs, resume=False)
        forged = honest.model_validate(
            {
                **honest.model_dump(mode="json"),
                "training": hostile,
                "fleet": {"engine": "external", "external_urls": ["http://127.0.0.1:9"]},
            }
        )
        planted = {
            "run_id": run_id,
            "config_hash": forged.config_hash(),  # the hash of what it holds: only the box file can tell
            "created_at": datetime.now().astimezone().isoformat(),
            "config": forged.model_dump(mode="json"),
            **({"origin": origin} if name == "planted-config-with-origin" else {}),
        }
        (store / "runs" / run_id).mkdir(parents=True)
        (store / "runs" / run_id / "config.json").write_text(json.dumps(planted))


def _vectors(stack: Stack, marks: Path, secret: Path, pidfile: Path) -> dict[str, Vector]:
    manual, host = "expand/expand-manual", "expand-host/expand-host"
    base = {"config": "demo-worker"}
    restart = {
        "kind": "none",
        "restart_after_run": True,
        "restart_command": ["touch", str(marks / "restart")],
    }
    corpus = str(stack.clone / "datagen" / "samples")  # demo-worker's protected prefix
    whole = yaml.safe_load((stack.clone / "configs" / "demo-worker.yaml").read_text())
    store = stack.clone / "runs" / "_demo" / "store"  # demo-worker's output root
    host_part = {
        "run_id": "host-vector",
        "host": "box-a",
        "attempt_id": "attempt-1",
        "parent_flow_run_id": "6f1c1d4e-8d8e-4b61-9b48-9f4f1d9c2a11",
    }
    return {
        "restart-command": Vector(manual, {**base, "training": restart}, "'training'"),
        "fleet-env": Vector(
            manual,
            {**base, "fleet": {"env": {"PYTHONSTARTUP": str(secret), "LD_PRELOAD": "x.so"}}},
            "'fleet'",
        ),
        "remote-code": Vector(
            manual,
            {**base, "model": {"path": str(marks)}, "fleet": {"extra_args": ["--trust-remote-code"]}},
            "'fleet', 'model'",
        ),
        "climbing-run-id": Vector(manual, {**base, "run_id": "../../secret"}, "run_id: ", flow=True),
        "config-path": Vector(manual, {**base, "config_path": str(secret)}, "'config_path'"),
        "dataset-path": Vector(
            manual, {**base, "datasets": [{"name": "x", "format": "jsonl", "path": str(secret)}]}, "'datasets"
        ),
        "external-urls": Vector(
            manual, {**base, "fleet": {"external_urls": ["http://127.0.0.1:9"]}}, "'fleet'"
        ),
        "pidfile": Vector(
            manual, {**base, "training": {"kind": "pidfile", "pidfile": str(pidfile)}}, "'training'"
        ),
        "protected-prefixes": Vector(
            manual, {**base, "protected_prefixes": [], "output": corpus}, "'protected_prefixes'"
        ),
        "output-at-corpus": Vector(
            manual, {**base, "output": corpus, "run_id": "at-corpus"}, "output: ", flow=True
        ),
        "whole-config": Vector(manual, {"config": {**whole, "training": restart}}, "'config'"),
        "host-part-training": Vector(host, {**base, **host_part, "training": restart}, "'training'"),
        "unchecked-training": Vector(
            manual, {**base, "run_id": "unchecked", "training": restart}, "'training'", unchecked=True
        ),
        # A planted store: a config.json no box made, under the config's own root, resumed by its run id...
        **{
            name: Vector(manual, {**base, "run_id": run_id}, "run_id: ", flow=True)
            for name, run_id in PLANTED_RUNS.items()
        },
        # ... and an output inside a root's layout: a finished run's completions, a series' ledger, a dataset's
        # versions (with the run id a later run of the dataset would adopt).
        "output-in-a-run": Vector(
            manual,
            {**base, "run_id": "intruder-a", "output": f"{store}/runs/{VICTIM_RUN}/completions"},
            "output: ",
            flow=True,
            name=FORGED_RUN_NAME,
        ),
        "output-in-a-ledger": Vector(
            manual,
            {**base, "run_id": "intruder-b", "output": f"{store}/series/nightly/ledger"},
            "output: ",
            flow=True,
        ),
        "output-in-versions": Vector(
            manual,
            {**base, "run_id": "intruder-c", "output": f"{store}/datasets/drafter-demo"},
            "output: ",
            flow=True,
        ),
    }


@pytest.fixture(scope="module")
def vectors(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vectors]:
    """Every vector of :func:`_vectors` sent through create-flow-run; the runs it created waited for together."""
    root = tmp_path_factory.mktemp("vectors")
    # Where `<output>/runs/../../secret/config.json` of the demo config lands: a climbing run id's target.
    secret = stack.clone / "runs" / "_demo" / "secret" / "config.json"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_text('{"planted": "TOPSECRET-3f9a"}')
    found = Vectors(root, subprocess.Popen(["sleep", "900"]))
    found.marks.mkdir()
    pidfile = root / "training.pid"
    pidfile.write_text(str(found.sleeper.pid))
    corpus = stack.clone / "datagen" / "samples"  # demo-worker's protected prefix
    before = _tree_digest(corpus)
    store = stack.clone / "runs" / "_demo" / "store"  # demo-worker's output root
    _plant_store(store, stack.clone / "configs", found.marks, pidfile)
    stored = _tree_digest(store)
    try:
        found.sent = _vectors(stack, found.marks, secret, pidfile)
        assert list(found.sent) == VECTOR_NAMES
        created = {}
        for name, vector in found.sent.items():
            deployment = stack.prefect.api.get(f"/deployments/name/{vector.deployment}").json()
            payload: dict[str, Any] = {"parameters": vector.parameters}
            if vector.name is not None:
                payload["name"] = vector.name
            if vector.unchecked:
                payload["enforce_parameter_schema"] = False  # Prefect lets a run turn the server's check off
            found.answers[name] = stack.prefect.api.post(
                f"/deployments/{deployment['id']}/create_flow_run", json=payload
            )
            if found.answers[name].status_code == 201:
                created[name] = found.answers[name].json()["id"]
        for name, flow_run_id in created.items():
            state, log = stack.finish(flow_run_id)
            ended = stack.flow_run(flow_run_id)
            found.ends[name] = (state, str(ended["state"]["message"]), log)
            found.names[name] = ended["name"]
            records = stack.prefect.api.post(
                "/logs/filter", json={"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200}
            )
            found.messages[name] = [entry["message"] for entry in records.json()]
        time.sleep(2)  # a restart would be detached: give it the time to show
        assert _tree_digest(corpus) == before, "a run wrote into the protected corpus"
        # Nothing written under the output root: no run folder, no ledger or version changed or added.
        assert _tree_digest(store) == stored, "a refused run wrote under the output root"
        yield found
    finally:
        found.sleeper.kill()
        found.sleeper.wait()


@pytest.mark.parametrize("name", VECTOR_NAMES)
def test_a_run_sending_what_only_the_box_decides_is_refused_before_anything_runs(
    stack: Stack, vectors: Vectors, name: str
) -> None:
    vector, answer = vectors.sent[name], vectors.answers[name]
    if vector.flow:
        # A value of a parameter the run may set: the flow refuses it before any path is built or file read.
        assert answer.status_code == 201, answer.text
        state, message, log = vectors.ends[name]
        assert state == "FAILED", log[-3000:]
        assert "Run parameters refused, nothing started: " + vector.field in message, message
        assert "TOPSECRET" not in message + log and "stage=preflight" not in log, log[-3000:]
    elif vector.unchecked:
        # Prefect on the worker refuses a parameter the flow's signature lacks, before it calls the flow.
        assert answer.status_code == 201, answer.text
        state, message, log = vectors.ends[name]
        assert state in {"FAILED", "CRASHED"}, log[-3000:]
        assert "but was provided with parameters ['config', 'run_id', 'training']" in log, log[-3000:]
        assert "stage=preflight" not in log, "the flow started"
    else:
        # The server refuses it at create-flow-run (the deployment's closed parameter schema): no flow run.
        assert answer.status_code == 409, answer.text
        detail = answer.json()["detail"]
        assert vector.field in detail and "TOPSECRET" not in detail, detail
        assert name not in vectors.ends
    if vector.name is not None:
        assert not CONTROL_CHARACTERS.search(vectors.names[name]), vectors.names[name]
        assert vectors.names[name].startswith("intruder\\n12:00:00.000"), "the name is shown, escaped"
        forged = [line for line in vectors.messages[name] if CONTROL_CHARACTERS.search(line)]
        assert vectors.messages[name] and not forged, forged
    assert not any(vectors.marks.iterdir()), "a command of the caller's ran"
    assert vectors.sleeper.poll() is None, "the pidfile's process was signalled"


def test_two_overlapping_runs_of_two_deployments_never_generate_at_once(stack: Stack, tmp_path: Path) -> None:
    with FaultServer(FaultPlan(base_delay_s=FAKE_SERVER_DELAY_S)) as server:
        paths = []
        for name in ("alpha", "beta"):
            _write_prompts(tmp_path / f"{name}.jsonl", name, 12)
            config = _fake_config(stack, server.url, str(tmp_path / f"{name}.jsonl"), str(tmp_path / "out"))
            paths.append(_write_config(stack, f"ci-overlap-{name}", config))
        # Hold every answer until a run has said it waits for the lock: whichever run generates first stays
        # mid-generation, so the two runs overlap however slowly the workers pick them up.
        server.answering.clear()
        manual = stack.start("expand/expand-manual", config=paths[0], run_id="overlap-alpha")
        nightly = stack.start("expand/expand-nightly", config=paths[1], run_id="overlap-beta")
        waited = stack.wait_for_log("another run holds this host's GPUs", timeout_s=WATCH_TIMEOUT_S / 2)
        deadline = time.monotonic() + WATCH_TIMEOUT_S / 2
        while not server.chat_requests() and time.monotonic() < deadline:
            time.sleep(0.5)
        held = len(server.chat_requests())
        server.answering.set()
        ends = [stack.finish(flow_run_id) for flow_run_id in (manual, nightly)]

        for state, log in ends:
            assert state == "COMPLETED", log[-6000:]
        arrivals: dict[str, list[float]] = {"alpha": [], "beta": []}
        for request in server.chat_requests():
            content = str((request.body or {})["messages"][-1]["content"])
            arrivals[content.split()[0]].append(request.arrived_at)
    assert waited, "neither run logged that it waited for the GPU lock"
    assert held > 0, "no run sent a request while the other waited for the lock"
    assert len(arrivals["alpha"]) == 12 and len(arrivals["beta"]) == 12
    first, second = sorted(arrivals.values(), key=min)
    assert max(first) < min(second), "the two runs sent requests at the same time"


def _tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def test_two_nightly_runs_take_disjoint_prompts_and_publish_v1_then_v2_on_the_base_corpus(
    stack: Stack, tmp_path: Path
) -> None:
    # The existing corpus (protected, never written) and its adopted version manifest, next to it.
    corpus = stack.clone / "train"
    corpus.mkdir()
    (corpus / "part-00000.parquet").write_bytes(b"PAR1 stands in for the 902K existing samples PAR1")
    base = DatasetVersion(
        name="drafter-corpus",
        version=1,
        run_id="existing-corpus",
        rows=902,
        shards=[TokenizedPartRef(url=str(corpus / "part-00000.parquet"), rows=902, source="existing-corpus")],
    )
    base_dir = tmp_path / "corpus-manifest"
    base_dir.mkdir()
    (base_dir / "v0001.json").write_text(base.model_dump_json())
    before = _tree_digest(corpus)
    _write_prompts(tmp_path / "pool.jsonl", "nightly", 10)
    output = tmp_path / "expansion"
    with FaultServer() as server:
        config = _fake_config(
            stack,
            server.url,
            str(tmp_path / "pool.jsonl"),
            str(output),
            tokenize={"dataset_name": "drafter-expansion", "base_version": str(base_dir / "v0001.json")},
            training=_restart_marking(tmp_path / "restarts.txt"),
        )
        name = _write_config(stack, "ci-nightly", config)
        for night in ("night-1", "night-2"):
            state, log = stack.finish(
                stack.start(
                    "expand/expand-nightly",
                    config=name,
                    run_id=night,
                    series="ci-nightly",
                    max_prompts=4,
                )
            )
            assert state == "COMPLETED", log[-6000:]

    taken = {}
    for night in ("night-1", "night-2"):
        lines = (output / "series" / "ci-nightly" / "ledger" / f"{night}.jsonl").read_text().splitlines()
        taken[night] = {json.loads(line)["prompt_id"] for line in lines}
        prompts = output / "runs" / night / "prompts" / "questions" / "shard-00000.jsonl"
        assert {json.loads(line)["prompt_id"] for line in prompts.read_text().splitlines()} == taken[night]
    assert len(taken["night-1"]) == 4 and len(taken["night-2"]) == 4
    assert not taken["night-1"] & taken["night-2"]

    versions = output / "datasets" / "drafter-expansion"
    assert sorted(path.name for path in versions.iterdir()) == ["v0001.json", "v0002.json"]
    v1 = DatasetVersion.model_validate_json((versions / "v0001.json").read_text())
    v2 = DatasetVersion.model_validate_json((versions / "v0002.json").read_text())
    assert (v1.run_id, v2.run_id) == ("night-1", "night-2")
    assert v1.base_version == str(base_dir / "v0001.json")
    assert v2.base_version == str(versions / "v0001.json")
    corpus_url = str(corpus / "part-00000.parquet")
    assert [shard.url for shard in v2.shards[: len(v1.shards)]] == [shard.url for shard in v1.shards]
    assert corpus_url in [shard.url for shard in v2.shards]
    assert {
        shard.source for shard in v2.shards if shard.url.startswith(str(output / "runs" / "night-2"))
    } == {"night-2"}
    assert _tree_digest(corpus) == before

    # Training got the GPUs back once per night (the command ran), before that night's merge wrote anything.
    assert len(_wait_for_file(tmp_path / "restarts.txt").split()) == 2
    for night in ("night-1", "night-2"):
        (record,) = (output / "runs" / night / "attempts").glob("*/training-restart.json")
        started_at = datetime.fromisoformat(json.loads(record.read_text())["started_at"]).timestamp()
        first_part = output / "runs" / night / "tokenized" / "part-00000.parquet"
        assert started_at < first_part.stat().st_mtime


def _live(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_cancelled_run_stops_its_servers(stack: Stack, tmp_path: Path) -> None:
    config = yaml.safe_load((stack.clone / "configs" / "demo-worker.yaml").read_text())
    config["fleet"].update({"cpu_servers": 1, "base_port": worker_port(30300)})
    config["sampling"]["max_tokens"] = 2048  # keeps the server busy until the cancel arrives
    config["output"] = str(tmp_path / "out")
    config["training"] = _restart_marking(tmp_path / "restarts.txt")
    name = _write_config(stack, "ci-cancel", config)

    flow_run_id = stack.start("expand/expand-manual", config=name, run_id="cancel-me")
    pidfile = stack.state_dir / "fleets" / flow_run_id / "servers.json"
    deadline = time.monotonic() + WATCH_TIMEOUT_S
    pids: list[int] = []
    # The cancel goes out as soon as the fleet has registered a live server (loading its model or generating):
    # waiting for its /health as well let a run on a loaded box finish first (a busy CPU server can take
    # longer than a poll's timeout to answer), and the cancel then met a completed run.
    while time.monotonic() < deadline and not pids:
        if pidfile.exists():
            pids = [server["pid"] for server in json.loads(pidfile.read_text())["servers"]]
            pids = [pid for pid in pids if _live(pid)]
        if not pids:
            state = stack.flow_run(flow_run_id)["state_type"]
            assert state not in {"COMPLETED", "FAILED", "CRASHED"}, (
                f"the run ended ({state}) before the cancel"
            )
            time.sleep(0.2)
    assert pids, "the run never started its server"

    stack.cancel(flow_run_id)
    while time.monotonic() < deadline and stack.flow_run(flow_run_id)["state_type"] != "CANCELLED":
        time.sleep(1)
    assert stack.flow_run(flow_run_id)["state_type"] == "CANCELLED"
    stop_deadline = time.monotonic() + 60
    while time.monotonic() < stop_deadline and any(_live(pid) for pid in pids):
        time.sleep(0.5)
    assert not any(_live(pid) for pid in pids), f"servers still running after the cancel: {pids}"
    assert len(_wait_for_file(tmp_path / "restarts.txt").split()) == 1, "training was not restarted"


def _stored(root: Path) -> dict[str, str]:
    """Every stored object under ``root`` and the sha256 of its bytes.

    A write in progress (the local store's temporary file, renamed into place once whole) is not an object yet:
    the snapshot may catch one that the run renames a moment later.
    """
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in root.rglob("*")
        if path.is_file() and not path.name.startswith(TEMP_PREFIX)
    }


def _worker_logs(stack: Stack) -> str:
    return "".join(
        (stack.prefect.home / f"worker-{index}.log").read_text(errors="replace") for index in (1, 2)
    )


def test_a_run_cancelled_after_the_api_was_away_still_stops(stack: Stack, tmp_path: Path) -> None:
    # A run generating slowly on one CPU server (one request at a time, long answers), for several minutes.
    prompts = tmp_path / "prompts.jsonl"
    _write_prompts(prompts, "outage", PROMPTS_FOR_A_LONG_RUN)
    config = yaml.safe_load((stack.clone / "configs" / "demo-worker.yaml").read_text())
    config["fleet"].update({"cpu_servers": 1, "base_port": worker_port(30320), "max_inflight_per_server": 1})
    config["sampling"]["max_tokens"] = 512
    config["datasets"] = [{"name": "questions", "format": "openai_messages", "path": str(prompts)}]
    config["output"] = str(tmp_path / "out")
    config["training"] = _restart_marking(tmp_path / "restarts.txt")
    name = _write_config(stack, "ci-cancel-after-outage", config)
    failed_before = _worker_logs(stack).count(OBSERVER_GAVE_UP)

    flow_run_id = stack.start("expand/expand-manual", config=name, run_id="cancel-after-outage")
    pidfile = stack.state_dir / "fleets" / flow_run_id / "servers.json"
    deadline = time.monotonic() + WATCH_TIMEOUT_S
    pids: list[int] = []
    while time.monotonic() < deadline and not pids:
        if pidfile.exists():
            pids = [server["pid"] for server in json.loads(pidfile.read_text())["servers"]]
            pids = [pid for pid in pids if _live(pid)]
        time.sleep(0.5)
    assert pids, "the run never started its server"

    # The API goes away until Prefect's runner has given up watching the run for a cancel, then comes back.
    stack.prefect.stop_server()
    away = time.monotonic()
    while _worker_logs(stack).count(OBSERVER_GAVE_UP) == failed_before and time.monotonic() - away < 120:
        time.sleep(1)
    assert _worker_logs(stack).count(OBSERVER_GAVE_UP) > failed_before, (
        "Prefect's cancellation watch never gave up"
    )
    stack.prefect.start()
    away_s = time.monotonic() - away
    assert stack.flow_run(flow_run_id)["state_type"] == "RUNNING", "the run did not outlive the outage"
    assert all(_live(pid) for pid in pids), "the servers did not outlive the outage"
    stored = _stored(tmp_path / "out")

    stack.cancel(flow_run_id)
    cancelled_at = time.monotonic()
    state = stack.prefect.wait_final(flow_run_id, CANCEL_AFTER_OUTAGE_BUDGET_S)
    cancel_s = time.monotonic() - cancelled_at
    assert state == "CANCELLED", f"{state} {cancel_s:.0f} s after the cancel (API away {away_s:.0f} s)"
    assert cancel_s < CANCEL_AFTER_OUTAGE_BUDGET_S
    assert not any(_live(pid) for pid in pids), f"servers still running after the cancel: {pids}"
    assert len(_wait_for_file(tmp_path / "restarts.txt").split()) == 1, "training was not restarted once"
    assert not is_held(lock_path(os.environ["DATAGEN_LOCK_DIR"], gpu_lock_name())), (
        "the GPU lock is still held"
    )
    after = _stored(tmp_path / "out")
    # Which one stopped it (the worker's runner once the API was back, or the run's own watch) depends on the
    # load: both end as above, so neither path's log line is asserted.
    assert {key: after.get(key) for key in stored} == stored, "a stored object changed or vanished"


def test_the_api_refuses_a_request_without_the_auth_string(stack: Stack) -> None:
    url = stack.prefect.api_url
    with httpx.Client(timeout=10) as anonymous:
        assert anonymous.get(f"{url}/health").status_code == 200  # probes stay open
        assert anonymous.post(f"{url}/deployments/filter", json={}).status_code == 401
        wrong = basic_auth_header("datagen-test:wrong")
        assert anonymous.post(f"{url}/deployments/filter", json={}, headers=wrong).status_code == 401
    listed = stack.prefect.prefect(
        "deployment", "ls", cwd=stack.root, timeout_s=120, PREFECT_API_AUTH_STRING="datagen-test:wrong"
    )
    assert listed.returncode != 0
    assert "401" in listed.stdout + listed.stderr, listed.stdout[-3000:] + listed.stderr[-3000:]
    # With it, the same request answers: `datagen deploy`, the workers and the runs of this module send it.
    assert stack.prefect.api.post("/deployments/filter", json={}).status_code == 200


def test_the_ui_hands_the_browser_the_api_url_it_was_given_on_a_non_default_port(stack: Stack) -> None:
    assert stack.prefect.port != 4200
    answer = httpx.get(f"{stack.prefect.ui_url}/ui-settings", timeout=10)  # the UI's first request, no auth

    assert answer.status_code == 200, answer.text
    settings = answer.json()
    # Not Prefect's default http://127.0.0.1:4200/api, which a browser elsewhere cannot reach.
    assert settings["api_url"] == f"http://localhost:{stack.prefect.port}/api"
    assert settings["auth"] == "BASIC"  # the UI asks for the auth string
    version = httpx.get(
        f"{settings['api_url']}/admin/version",
        headers=basic_auth_header(stack.prefect.auth_string),
        timeout=10,
    )
    assert version.status_code == 200, version.text


def test_the_stored_run_form_takes_sampling_omitted_empty_or_set_and_refuses_an_unknown_key(
    stack: Stack,
) -> None:
    deployment = stack.prefect.api.get("/deployments/name/expand/expand-manual").json()
    sampling = deployment["parameter_openapi_schema"]["properties"]["sampling"]
    assert sampling["type"] == "object" and "anyOf" not in sampling  # a plain section: no None toggle
    # Far in the future: the server checks the parameters, no worker starts the run before it is deleted.
    later = {"type": "SCHEDULED", "state_details": {"scheduled_time": "2099-01-01T00:00:00Z"}}

    for parameters in (
        {"config": "demo-worker"},
        {"config": "demo-worker", "sampling": None},
        {"config": "demo-worker", "sampling": {}},
        {"config": "demo-worker", "sampling": {"temperature": 0.2, "top_p": None}},
    ):
        created = stack.prefect.api.post(
            f"/deployments/{deployment['id']}/create_flow_run",
            json={"parameters": parameters, "state": later},
        )
        assert created.status_code == 201, (parameters, created.text)
        stack.prefect.api.delete(f"/flow_runs/{created.json()['id']}").raise_for_status()
    refused = stack.prefect.api.post(
        f"/deployments/{deployment['id']}/create_flow_run",
        json={
            "parameters": {"config": "demo-worker", "sampling": {"restart_command": ["sh"]}},
            "state": later,
        },
    )
    assert refused.status_code == 409 and "restart_command" in refused.json()["detail"], refused.text


def test_deploy_gives_an_existing_pool_its_template_and_keeps_its_concurrency_limit(stack: Stack) -> None:
    # The pool the module's deploy found: Prefect's default template, a limit its operator set (the stack fixture).
    pool = stack.pool_after_deploy
    assert pool["base_job_template"] == json.loads(
        (stack.clone / "deployments" / "work-pool.json").read_text()
    )
    assert pool["concurrency_limit"] == OPERATOR_POOL_LIMIT


def test_the_server_refuses_a_run_that_sends_the_command_environment_or_folder(
    stack: Stack, tmp_path: Path
) -> None:
    pwned = tmp_path / "pwned"
    template = stack.prefect.api.get(f"/work_pools/{POOL}").json()["base_job_template"]
    assert template == json.loads((stack.clone / "deployments" / "work-pool.json").read_text())
    assert not {"command", "env", "working_dir"} & set(template["variables"]["properties"])
    deployment = stack.prefect.api.get("/deployments/name/expand/expand-manual").json()

    for job_variables in (
        {"command": f"touch {pwned}"},
        {"env": {"PYTHONPATH": str(tmp_path)}},
        {"env.LD_PRELOAD": str(tmp_path / "evil.so")},
        {"working_dir": str(tmp_path)},
    ):
        created = stack.prefect.api.post(
            f"/deployments/{deployment['id']}/create_flow_run",
            json={"parameters": {"config": "demo-worker"}, "job_variables": job_variables},
        )
        assert created.status_code == 422, created.text
        assert next(iter(job_variables)) in created.json()["detail"], created.text
    time.sleep(3)  # were a run created, a worker polling every second would have started it by now
    assert not pwned.exists()


def test_a_run_that_reaches_a_worker_with_those_job_variables_is_refused_by_the_flow(
    stack: Stack, tmp_path: Path
) -> None:
    # POST /flow_runs/ does not check job variables against the pool (an API caller who may create flow runs,
    # not only run deployments): the worker ignores the command (the template has none to fill) and the flow
    # refuses to go on, naming what was sent.
    pwned = tmp_path / "pwned"
    deployment = stack.prefect.api.get("/deployments/name/expand/expand-manual").json()
    created = stack.prefect.api.post(
        "/flow_runs/",
        json={
            "flow_id": deployment["flow_id"],
            "deployment_id": deployment["id"],
            "work_pool_name": POOL,
            "work_queue_name": "default",
            "state": {"type": "SCHEDULED"},
            "parameters": {"config": "demo-worker", "run_id": "job-variables"},
            "job_variables": {"command": f"touch {pwned}", "env": {"DATAGEN_INJECTED": "1"}},
        },
    )
    assert created.status_code == 201, created.text

    state, log = stack.finish(created.json()["id"])

    assert state == "FAILED", log[-6000:]
    assert log.count("run failed:") == 1, log[-6000:]
    assert "job variables command, env are not a run's to set" in log, log[-6000:]
    assert not pwned.exists()
    assert not (stack.clone / "runs" / "_demo" / "store" / "runs" / "job-variables").exists()
