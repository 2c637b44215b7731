"""The crash matrix on a real `prefect server start` with process workers, and a multi-host part under its worker.

The same boxes as tests/integration/test_run_states.py (a bucket behind the S3 proxy, an external server, the
stand-in trainer), with a real Prefect server instead of the CLI's temporary one:

* `datagen run` against the server (``PREFECT_API_URL``) SIGKILLed mid-halt, its printed resume SIGKILLed
  mid-generation, then the printed resume again: it finishes, every request once, training signalled once and
  restarted once, each resume's first request within 30 s of its start (nothing waits for a lease of a killed
  run);
* a process worker SIGKILLed mid-generation with the flow run it runs (its process group and the run's, which
  Prefect starts in a session of its own; as when the box loses them): the next run of that box, through a new
  worker, sends its first request within the lease plus 30 s of the kill, finishes, every request once, training
  restarted once;
* the host part of a multi-host run, under its worker: SIGTERM to the parent (`datagen run`) mid-generation
  ends the parent within 30 s with 143, and the host part within 30 s more: it stops serving, hands training
  back (restarted once) and leaves no process behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.prefect_stack import PrefectStack, copy_checkout, stop_group, stop_groups
from tests.support.run_states import REPO, alive, descendants, describe
from tests.support.s3_proxy import S3FaultProxy
from tests.support.state_box import (
    CRASH_CHECKPOINT_S,
    PROMPTS,
    S3_ENV,
    Box,
    BoxFactory,
    check_training,
    final_answers,
    sigkill_then_resume,
)

POOL = "gpu-box"
HOST_QUEUE = "host-a"
# The old Prefect limit's lease (60 s) plus 30 s: a killed worker's box takes new work within this.
WORKER_KILL_BUDGET_S = 60.0 + 30.0
SIGNAL_EXIT_BUDGET_S = 30.0
HOST_PART_END_BUDGET_S = 30.0
RUN_TIMEOUT_S = 300.0


# The names under which tests put a box's config among the clone's configs/ (known to the deploy).
BOX_CONFIGS = ("states-worker", "states-hosts")


class Stack:
    """A real Prefect server, the `expand-manual` and `expand-host` deployments of a clone of the checkout."""

    def __init__(self, root: Path, prefect: PrefectStack, clone: Path) -> None:
        self.root = root
        self.prefect = prefect
        self.clone = clone

    def env(self) -> dict[str, str]:
        """The base environment of runs against this server (the clone's code)."""
        return self.prefect.env(PYTHONPATH=str(self.clone))

    def worker(self, box: Box, name: str, queue: str | None = None) -> subprocess.Popen[bytes]:
        """A process worker of the box (its state folder, GPU lock, S3 endpoint), on ``queue`` if given."""
        extra = {
            key: box.env[key] for key in ("DATAGEN_STATE_DIR", "DATAGEN_GPU_LOCK", "DATAGEN_S3_ENDPOINT_URL")
        }
        return self.prefect.start_worker(
            POOL, box.tmp / name, name, work_queue=queue, PYTHONPATH=str(self.clone), **S3_ENV, **extra
        )

    def deployment_run(self, deployment: str, **params: str) -> str:
        """Start a run of ``deployment`` (not watched) through the API; returns its flow run id.

        What is tested here is the worker and the box: test_operations runs `prefect deployment run` itself.
        """
        return self.prefect.create_flow_run(deployment, **params)

    def wait_final(self, flow_run_id: str, timeout_s: float) -> str:
        """The flow run's final state type, waited for up to ``timeout_s`` (its last state if none)."""
        return self.prefect.wait_final(flow_run_id, timeout_s)

    def host_flow_runs(self, run_id: str) -> list[dict[str, Any]]:
        """The `expand-host` flow runs of run ``run_id``."""
        response = self.prefect.api.post(
            "/flow_runs/filter", json={"flow_runs": {"name": {"like_": f"expand-host-{run_id}-"}}}
        )
        response.raise_for_status()
        runs: list[dict[str, Any]] = response.json()
        return runs


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`prefect server start`, and `datagen deploy` of the two deployments from a clone of the checkout."""
    root = tmp_path_factory.mktemp("states-prefect")
    clone = copy_checkout(REPO, root / "clone")
    # The configs the tests put among the clone's configs/ exist before the deploy, which offers the checkout's
    # config names as the only choices (each test writes its box's own content under its name).
    for name in BOX_CONFIGS:
        (clone / "configs" / f"{name}.yaml").write_text((clone / "configs" / "demo.yaml").read_text())
    prefect = PrefectStack(home=root / "prefect-home").start()
    try:
        deployed = subprocess.run(
            [
                sys.executable,
                "-m",
                "flows.cli_entry",
                "deploy",
                "--name",
                "expand-manual",
                "--name",
                "expand-host",
            ],
            cwd=root,
            env=prefect.env(PYTHONPATH=str(clone)),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        # What `prefect work-queue create` sends, without a CLI start (test_multihost runs that README step).
        prefect.create_work_queue(POOL, HOST_QUEUE)
        yield Stack(root, prefect, clone)
    finally:
        prefect.stop()


@pytest.fixture(scope="module")
def s3_proxy(s3_endpoint: str) -> Iterator[S3FaultProxy]:
    """The proxy every run reaches S3 through."""
    with pytest.MonkeyPatch.context() as patch, S3FaultProxy(s3_endpoint) as proxy:
        for name, value in S3_ENV.items():
            patch.setenv(name, value)
        yield proxy


@pytest.fixture()
def make_box(
    tmp_path: Path, s3_endpoint: str, s3_proxy: S3FaultProxy, stack: Stack, tiny_model_dir: Path
) -> Iterator[Callable[..., Box]]:
    """Boxes whose runs use the real Prefect server."""
    factory = BoxFactory(tmp_path, s3_endpoint, s3_proxy, tiny_model_dir, stack.env(), stack.clone)
    try:
        yield factory.make
    finally:
        factory.close()


def test_sigkills_mid_halt_and_mid_generation_on_a_real_prefect_server_then_the_resume_finishes_once(
    make_box: Callable[..., Box],
) -> None:
    # One box, one chain: a run killed mid-halt, its printed resume killed mid-generation, the next resume left
    # to finish (what test_run_states' crash chain does on the CLI's own server). Each link is checked as a
    # run of its own was: every resume's first request within 30 s of its start, every request once, nothing
    # of a killed run left, training signalled once and restarted once; one box and one final resume fewer.
    sigkill_then_resume(make_box(checkpoint_delay_s=CRASH_CHECKPOINT_S), ["halting", "generating"])


def _as_box_config(stack: Stack, box: Box, name: str) -> str:
    """Put the box's config among the clone's configs/ (a run picks one by name); returns its name."""
    assert name in BOX_CONFIGS, f"{name}: deployed configs are {BOX_CONFIGS}"
    path = stack.clone / "configs" / f"{name}.yaml"
    path.write_text(box.config.read_text())
    box.config = path
    return name


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"never {what} in {timeout_s:.0f}s"
        time.sleep(0.1)


def test_a_worker_killed_mid_run_lets_the_next_run_on_its_box_start_within_the_lease_plus_30s(
    make_box: Callable[..., Box], stack: Stack
) -> None:
    box = make_box()
    name = _as_box_config(stack, box, "states-worker")
    first = stack.worker(box, "worker-1")
    second: subprocess.Popen[bytes] | None = None
    try:
        killed = stack.deployment_run("expand/expand-manual", config=name, run_id="worker")
        _wait(lambda: len(box.server.chat_requests()) >= 3, "generating", RUN_TIMEOUT_S)
        run_processes = descendants(first.pid)
        # The worker and the flow run it runs. Prefect 3.9 starts a flow run's process in a session of its own:
        # a SIGKILL to the worker's group alone left the run generating to its end, and the "next" run's first
        # request was the killed run's next one (the budget below could not fail).
        run_pids = _processes_of_flow_run(killed)
        assert run_pids, "the killed run's process was not found"
        groups = {first.pid} | {group for pid in run_pids if (group := _process_group(pid)) is not None}
        doomed = [pid for pid in run_processes if _process_group(pid) in groups]
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        killed_at = time.monotonic()
        first.wait(30)
        _wait(lambda: not any(alive(pid) for pid in doomed), "gone after the SIGKILL", 10)
        mark = len(box.server.chat_requests())  # from here on, requests are the next run's

        second = stack.worker(box, "worker-2")
        resumed = stack.deployment_run("expand/expand-manual", config=name, run_id="worker")
        _wait(
            lambda: len(box.server.chat_requests()) > mark, "sent a request again", WORKER_KILL_BUDGET_S + 60
        )
        first_request_s = box.server.chat_requests()[mark].arrived_at - killed_at
        state = stack.wait_final(resumed, RUN_TIMEOUT_S)
    finally:
        # Both: a worker left running polls every queue of the pool, so the next test's host part could go to it
        # (with this box's state folder and GPU lock) instead of that test's own worker.
        stop_groups([first] + ([second] if second else []))

    assert state == "COMPLETED", f"the next run ended {state}"
    assert first_request_s <= WORKER_KILL_BUDGET_S, (
        f"the next run's first request {first_request_s:.0f}s after"
    )
    prompts, finals = final_answers(box, "worker")
    assert len(prompts) == PROMPTS and sorted(finals) == sorted(prompts), "every request exactly once"
    left = [pid for pid in run_processes if alive(pid)]
    assert not left, f"left by the killed worker's flow run:\n{describe(left)}"
    check_training(box, halted=True)


def _process_group(pid: int) -> int | None:
    """The process group of ``pid``; None when it has exited."""
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _processes_of_flow_run(flow_run_id: str, timeout_s: float = 10.0) -> list[int]:
    """Pids whose environment names ``flow_run_id`` (``PREFECT__FLOW_RUN_ID``, set by the worker that runs it)."""
    wanted = f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode()
    deadline = time.monotonic() + timeout_s
    while True:
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if wanted in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
            except OSError:
                continue
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


def test_a_signal_to_the_parent_of_a_multi_host_run_ends_the_host_part_under_its_worker(
    make_box: Callable[..., Box], stack: Stack
) -> None:
    box = make_box()
    config = yaml.safe_load(box.config.read_text())
    config["hosts"] = [
        {"name": HOST_QUEUE, "work_queue": HOST_QUEUE, "fleet": {"external_urls": [box.server.url]}}
    ]
    config["multi_host"] = {"poll_interval_s": 0.5, "ready_timeout_s": 180}
    box.config.write_text(yaml.safe_dump(config, sort_keys=False))
    _as_box_config(stack, box, "states-hosts")  # the host part reads it from its checkout by name
    worker = stack.worker(box, "worker-host", queue=HOST_QUEUE)
    try:
        parent = box.run("hosts")
        parent.wait_until(lambda: len(box.server.chat_requests()) >= 3, "generating", RUN_TIMEOUT_S)
        (host_run,) = stack.host_flow_runs("hosts")
        # Found by the flow run id its worker puts in its environment: under load another live worker of the
        # stack may be the one that picked it up, so the worker's own process tree is not the place to look.
        host_processes = _processes_of_flow_run(str(host_run["id"]))
        assert host_processes, "the host part runs in a process of a worker"
        sent = parent.send(signal.SIGTERM)
        code = parent.wait(SIGNAL_EXIT_BUDGET_S + 30)
        exit_s = time.monotonic() - sent
        host_state = stack.wait_final(host_run["id"], HOST_PART_END_BUDGET_S)
        host_s = time.monotonic() - sent
        deadline = time.monotonic() + 10  # the worker reaps its flow run's process
        while (left := [pid for pid in host_processes if alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop_group(worker)

    assert code == 128 + signal.SIGTERM, parent.tail()
    assert exit_s < SIGNAL_EXIT_BUDGET_S, f"the parent exited {exit_s:.1f}s after SIGTERM"
    assert host_state in {"COMPLETED", "CANCELLED"}, f"the host part is {host_state} {host_s:.0f}s after"
    assert host_s < SIGNAL_EXIT_BUDGET_S + HOST_PART_END_BUDGET_S
    assert not left, f"the host part left processes:\n{describe(left)}"
    check_training(box, halted=True)
