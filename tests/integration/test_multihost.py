"""One run over two "hosts": a real `prefect server start`, the `expand-host` deployment, two process workers on
two work queues (separate state folders and GPU locks: two boxes), each host serving simulated
continuous-batching servers of its own (benchmarks/simulator.py, one process per host, `engine: external`).

* a run across both hosts: every request answered exactly once, both hosts served, both host parts completed;
* one host killed mid-run (its worker, its host flow run's process and its servers, SIGKILL): the run completes
  on the other host, every request answered exactly once, the report names the lost host;
* one host killed after the last requests went out: the release and the report name it, and the run does not
  wait for its host part (which never ends) beyond `host_lost_after_s`;
* a host on a work queue that does not exist refuses the run before any host part starts.

The parent runs through `datagen run` with PREFECT_API_URL set (the same flow the deployments run).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.prefect_stack import PrefectStack, copy_checkout, free_port, stop_group, stop_groups

REPO = Path(__file__).resolve().parents[2]
POOL = "gpu-box"
HOSTS = ("host-a", "host-b")
SERVERS_PER_HOST = 2
SLOTS = 8
RUN_TIMEOUT_S = 300
# How often this server's repossessor revokes expired leases (Prefect's default: 15 s). The killed parent's lease
# lapses a lease (60 s) after the kill; the lease test, last, then waits for the next pass, not up to 15 s more.
REPOSSESSOR_LOOP_S = 2
# The runs of this module: each one's config is configs/<run id>.yaml of the clone.
RUN_CONFIGS = ("two-hosts", "host-loss", "late-loss", "unknown-queue")


class Stack:
    """The deployed checkout, its Prefect server, one worker and one simulator process per host."""

    def __init__(self, root: Path, prefect: PrefectStack, clone: Path) -> None:
        self.root = root
        self.prefect = prefect
        self.clone = clone
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.simulators: dict[str, subprocess.Popen[bytes]] = {}
        self.urls: dict[str, list[str]] = {}
        self.killed_parent_at = 0.0  # when the fixture SIGKILLed a parent lease holder (monotonic)
        # One client for the simulators' stats, polled every 0.1-0.2 s (a client per request: ~20 ms of CPU).
        self.http = httpx.Client(timeout=5)

    def start_worker(self, host: str) -> None:
        """The host's worker, polling only the host's queue."""
        self.workers[host] = self.prefect.start_worker(
            POOL,
            self.root / f"worker-{host}",
            f"worker-{host}",
            work_queue=host,
            PYTHONPATH=str(self.clone),
            DATAGEN_STATE_DIR=str(self.root / f"state-{host}"),
            DATAGEN_GPU_LOCK=f"datagen-gpus-{host}",
        )

    def ensure_workers(self, *hosts: str) -> None:
        """A new worker for each of ``hosts`` whose box a test killed (only a test that needs the box pays)."""
        for host in hosts:
            if self.workers[host].poll() is not None:
                started = datetime.now(UTC)
                self.start_worker(host)
                self.wait_polled(host, since=started)

    def wait_polled(self, host: str, since: datetime | None = None, timeout_s: float = 60.0) -> None:
        """Wait until a worker has polled the host's queue (after ``since`` if given).

        The parent refuses a host whose queue no worker polled in the last minute.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            response = self.prefect.api.get(f"/work_pools/{POOL}/queues/{host}")
            response.raise_for_status()
            polled = response.json()["last_polled"]
            if polled and (since is None or datetime.fromisoformat(polled) > since):
                return
            assert time.monotonic() < deadline, f"no worker polled queue {host} in {timeout_s:.0f}s"
            time.sleep(0.2)

    def start_servers(self, host: str, step_ms: float = 20.0) -> None:
        """The host's simulated servers (restarted with new ports for each test)."""
        if host in self.simulators:
            stop_group(self.simulators[host])
        ports = [free_port() for _ in range(SERVERS_PER_HOST)]
        self.simulators[host] = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "benchmarks" / "simulator.py"),
                "--ports",
                ",".join(map(str, ports)),
                "--slots",
                str(SLOTS),
                "--mean-tokens",
                "30",
                "--sigma",
                "0.5",
                "--step-base-ms",
                str(step_ms),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.urls[host] = [f"http://127.0.0.1:{port}" for port in ports]
        deadline = time.monotonic() + 30
        for url in self.urls[host]:
            while True:
                try:
                    if self.http.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"simulator {url} did not start"
                time.sleep(0.1)

    def served(self, host: str, counter: str = "finished") -> int:
        """Requests the host's servers finished (or another counter of /bench/stats: `requests` received)."""
        return sum(self.http.get(f"{url}/bench/stats").json()[counter] for url in self.urls[host])

    def kill_box(self, host: str, run_root: Path) -> None:
        """The box dies: its worker, the flow run process that owns its servers, the servers (SIGKILL)."""
        fleet_files = list((run_root / "hosts").glob(f"*/{host}/fleet.json"))
        host_part_pid = json.loads(fleet_files[0].read_text())["pid"]
        os.killpg(self.workers[host].pid, signal.SIGKILL)
        os.kill(host_part_pid, signal.SIGKILL)
        os.killpg(self.simulators[host].pid, signal.SIGKILL)
        self.workers[host].wait(30)  # reaped: ensure_workers sees the box is gone

    def run(self, config: dict[str, Any], run_id: str) -> subprocess.Popen[str]:
        """`datagen run --config FILE --run-id ID` against the stack's Prefect server (the parent flow).

        FILE is one of the clone's configs/: every host part reads it from its box's checkout by name.
        """
        path = self.clone / "configs" / f"{run_id}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return subprocess.Popen(
            [sys.executable, "-m", "flows.cli_entry", "run", "--config", str(path), "--run-id", run_id],
            cwd=self.root,
            env=self.prefect.env(
                PYTHONPATH=str(self.clone), DATAGEN_STATE_DIR=str(self.root / "state-parent")
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    """`datagen deploy --name expand-host` from a clone, a Prefect server, one worker + servers per host."""
    root = tmp_path_factory.mktemp("multihost")
    prefect = PrefectStack(
        home=root / "prefect-home",
        server_env={"PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS": str(REPOSSESSOR_LOOP_S)},
    ).launch()  # it starts while the clone is made
    stack = Stack(root, prefect, root / "clone")
    try:
        copy_checkout(REPO, stack.clone)
        # Each test writes its run's config as configs/<run id>.yaml; the names are there when `datagen deploy`
        # offers the checkout's configs (the host deployment refuses any other name).
        for run_id in RUN_CONFIGS:
            (stack.clone / "configs" / f"{run_id}.yaml").write_text("# written by its test\n")
        prefect.wait_ready()
        # A parent killed outright: its lease takes over a minute to lapse, so it is killed first thing here and
        # the lapse is awaited by its test, while the others run.
        stack.killed_parent_at = _kill_a_lease_holder(stack, KILLED_PARENT_RUN)
        deployed = subprocess.run(
            [sys.executable, "-m", "flows.cli_entry", "deploy", "--name", "expand-host"],
            cwd=root,
            env=prefect.env(PYTHONPATH=str(stack.clone)),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        # The README's step for the first box; the second box's queue through the API (the same request, without
        # another Prefect CLI start).
        created = prefect.prefect("work-queue", "create", HOSTS[0], "--pool", POOL, cwd=root)
        assert created.returncode == 0, created.stdout + created.stderr
        prefect.create_work_queue(POOL, HOSTS[1])
        for host in HOSTS:
            stack.start_worker(host)
            stack.start_servers(host)
        for host in HOSTS:
            stack.wait_polled(host)
        yield stack
    finally:
        stop_groups(list(stack.simulators.values()))
        stack.http.close()
        prefect.stop()


def _config(
    stack: Stack, tmp_path: Path, tiny_model_dir: Path, prompts: int, **multi_host: Any
) -> dict[str, Any]:
    dataset = tmp_path / "questions.jsonl"
    with dataset.open("w") as handle:
        for index in range(prompts):
            message = {"role": "user", "content": f"question {index:04d}: explain it."}
            handle.write(json.dumps({"messages": [message]}) + "\n")
    return {
        "model": {"path": str(tiny_model_dir), "served_name": "sim"},  # the simulated servers serve "sim"
        "fleet": {
            "engine": "external",
            "external_urls": stack.urls[HOSTS[0]],
            "max_inflight_per_server": SLOTS,
        },
        "sampling": {"max_tokens": 64},
        "datasets": [
            {
                "name": "questions",
                "format": "openai_messages",
                "path": str(dataset),
                "category": "chat",
                "shard_size": 50,
            }
        ],
        "output": str(tmp_path / "out"),
        "generation": {
            "checkpoint_every": 16,
            "checkpoint_interval_s": 0.5,
            "request_timeout_s": 30,
            "backoff_initial_s": 0.2,
            "backoff_max_s": 1.0,
        },
        "tokenize": {"dataset_name": "drafter-expansion"},
        "hosts": [
            {"name": host, "work_queue": host, "fleet": {"external_urls": stack.urls[host]}} for host in HOSTS
        ],
        "multi_host": {"poll_interval_s": 0.5, "ready_timeout_s": 180, **multi_host},
    }


def _answered(run_root: Path) -> Counter[tuple[str, int]]:
    """(prompt id, sample) -> how many final records (completions and failures) the run holds for it."""
    keys: Counter[tuple[str, int]] = Counter()
    for folder in ("completions", "failures"):
        for path in (run_root / folder).rglob("*.jsonl"):
            for line in path.read_text().splitlines():
                record = json.loads(line)
                keys[(record["prompt_id"], record["sample_index"])] += 1
    return keys


def _finish(process: subprocess.Popen[str]) -> str:
    try:
        output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
    return output


def _assert_exactly_once(run_root: Path, prompts: int) -> None:
    answered = _answered(run_root)
    assert len(answered) == prompts, f"{prompts - len(answered)} request(s) never answered"
    duplicated = [key for key, count in answered.items() if count > 1]
    assert not duplicated, f"answered more than once: {duplicated[:5]}"
    failures = sum(1 for _ in (run_root / "failures").rglob("*.jsonl") for line in _.read_text().splitlines())
    assert failures == 0


def test_a_run_across_two_hosts_answers_every_request_once_on_both(
    stack: Stack, tmp_path: Path, tiny_model_dir: Path
) -> None:
    prompts = 200
    stack.ensure_workers(*HOSTS)
    for host in HOSTS:
        stack.start_servers(host, step_ms=10.0)
    # Both hosts serve from the first request: a short run could otherwise end before the second joins.
    config = _config(stack, tmp_path, tiny_model_dir, prompts, start_with_hosts=2)

    output = _finish(stack.run(config, "two-hosts"))

    assert "run complete" in output or "completions" in output, output[-6000:]
    run_root = tmp_path / "out" / "runs" / "two-hosts"
    assert (run_root / "manifest.json").exists(), output[-6000:]
    _assert_exactly_once(run_root, prompts)
    report = json.loads((run_root / "report.json").read_text())
    assert report["hosts"] == list(HOSTS)
    assert report["lost_hosts"] == {}
    assert report["servers"] == SERVERS_PER_HOST * len(HOSTS)
    # One host flow run per host, each a subflow run of the parent (linked through a parent task run).
    response = stack.prefect.api.post(
        "/flow_runs/filter", json={"flow_runs": {"name": {"like_": "expand-host-two-hosts-"}}}
    )
    host_runs = response.json()
    assert sorted(run["name"] for run in host_runs) == [f"expand-host-two-hosts-{host}" for host in HOSTS]
    assert all(run["parent_task_run_id"] for run in host_runs), host_runs
    assert {run["work_queue_name"] for run in host_runs} == set(HOSTS)
    for host in HOSTS:
        assert stack.served(host) > prompts // 5, f"{host} served almost nothing"
        assert f"host part ended host={host} state=Completed" in output, output[-6000:]


def test_losing_a_host_mid_run_costs_only_its_in_flight_requests_and_the_report_names_it(
    stack: Stack, tmp_path: Path, tiny_model_dir: Path
) -> None:
    prompts = 480
    stack.ensure_workers(*HOSTS)
    for host in HOSTS:
        stack.start_servers(host, step_ms=12.0)
    config = _config(stack, tmp_path, tiny_model_dir, prompts, host_lost_after_s=3, start_with_hosts=2)
    lost = HOSTS[1]

    parent = stack.run(config, "host-loss")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while stack.served(lost) < 40:
        assert parent.poll() is None, _finish(parent)[-6000:]
        assert time.monotonic() < deadline, "the lost-to-be host never served"
        time.sleep(0.2)
    stack.kill_box(lost, tmp_path / "out" / "runs" / "host-loss")

    output = _finish(parent)

    assert parent.returncode == 0, output[-8000:]
    run_root = tmp_path / "out" / "runs" / "host-loss"
    _assert_exactly_once(run_root, prompts)
    report = json.loads((run_root / "report.json").read_text())
    assert list(report["lost_hosts"]) == [lost], report["lost_hosts"]
    assert "servers down" in report["lost_hosts"][lost]
    assert f"host lost: {lost}" in (run_root / "report.md").read_text()
    assert f"host lost host={lost}" in output


def test_a_box_lost_after_the_last_requests_went_out_is_named_and_the_run_does_not_wait_for_it(
    stack: Stack, tmp_path: Path, tiny_model_dir: Path
) -> None:
    # Killed once every request has reached a server: generation ends on the other box before the dead one's
    # servers were down for host_lost_after_s, so only the end-of-generation check can name it.
    prompts = 64
    lost_after_s = 4
    stack.ensure_workers(*HOSTS)
    for host in HOSTS:
        stack.start_servers(host, step_ms=60.0)
    config = _config(
        stack, tmp_path, tiny_model_dir, prompts, host_lost_after_s=lost_after_s, start_with_hosts=2
    )
    lost = HOSTS[1]
    run_root = tmp_path / "out" / "runs" / "late-loss"

    parent = stack.run(config, "late-loss")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while sum(stack.served(host, "requests") for host in HOSTS) < prompts:
        assert parent.poll() is None, _finish(parent)[-6000:]
        assert time.monotonic() < deadline, "the requests never all went out"
        time.sleep(0.1)
    assert stack.served(HOSTS[0]) + stack.served(lost) < prompts, "generation was over before the kill"
    stack.kill_box(lost, run_root)
    killed_at = time.time()

    output = _finish(parent)
    finished_after_s = time.time() - killed_at

    assert parent.returncode == 0, output[-8000:]
    _assert_exactly_once(run_root, prompts)
    report = json.loads((run_root / "report.json").read_text())
    assert list(report["lost_hosts"]) == [lost], report["lost_hosts"]
    assert "servers down" in report["lost_hosts"][lost]
    (release_path,) = (run_root / "hosts").glob("*/release.json")
    release = json.loads(release_path.read_text())
    assert list(release["lost_hosts"]) == [lost] and "servers down" in release["lost_hosts"][lost], release
    # Released host_lost_after_s after the servers went silent (plus the watch's polls), not after 120 s.
    released_after_s = release_path.stat().st_mtime - killed_at
    assert released_after_s < lost_after_s + 10, f"released {released_after_s:.0f}s after the kill"
    assert "host parts still running" not in output
    # Then only the other box's hand-back, merge, tokenize and report (slack for a loaded machine); the old
    # end-of-run wait alone was HOSTS_STOP_WAIT_S (120 s).
    assert finished_after_s < lost_after_s + 45, f"the run ended {finished_after_s:.0f}s after the kill"
    print(
        f"box killed: released after {released_after_s:.1f}s, run ended after {finished_after_s:.1f}s, "
        f"reason: {report['lost_hosts'][lost]}"
    )


def test_a_host_on_an_unknown_work_queue_refuses_the_run_before_any_host_starts(
    stack: Stack, tmp_path: Path, tiny_model_dir: Path
) -> None:
    stack.ensure_workers(HOSTS[0])  # a worker that would start its host part, were the run not refused
    config = _config(stack, tmp_path, tiny_model_dir, 10)
    config["hosts"][1]["work_queue"] = "no-such-queue"

    process = stack.run(config, "unknown-queue")
    output = _finish(process)

    assert process.returncode == 2, output[-6000:]
    assert "work queue 'no-such-queue' does not exist in pool 'gpu-box'" in output.replace("\n", " "), output[
        -4000:
    ]
    assert not (tmp_path / "out" / "runs" / "unknown-queue" / "hosts").exists()


HOLD_PARENT_LEASE = """
import sys, time
from tasks.multihost import hold_parent_lease
with hold_parent_lease(sys.argv[1], 60.0):
    print("held", flush=True)
    time.sleep(3600)
"""
KILLED_PARENT_RUN = f"killed-parent-{os.getpid()}"


def _kill_a_lease_holder(stack: Stack, run_id: str) -> float:
    """Start a process holding ``run_id``'s parent lease, SIGKILL it once it holds it; return when."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_PARENT_LEASE, run_id],
        env=stack.prefect.env(PYTHONPATH=str(stack.clone)),
        stdout=subprocess.PIPE,
        text=True,
    )
    from prefect.settings import temporary_settings

    from tasks.multihost import parent_lease_lapsed

    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with temporary_settings(stack.prefect.client_settings()):
            assert not parent_lease_lapsed(run_id)
    finally:
        holder.kill()
        holder.wait()
    return time.monotonic()


def test_a_parent_killed_outright_lets_its_lease_lapse_so_the_hosts_stop_serving(stack: Stack) -> None:
    # A host part stops serving when parent_lease_lapsed() says so (flows/host_part.py). Prefect revokes expired
    # leases in `prefect server start` (its repossessor, every REPOSSESSOR_LOOP_S here), not in its ephemeral test
    # server.
    from prefect.settings import temporary_settings

    from tasks.multihost import hold_parent_lease, parent_lease_lapsed

    ended = f"ended-parent-{os.getpid()}"
    with temporary_settings(stack.prefect.client_settings()):
        # The lease (60 s, Prefect's minimum), the default repossessor period (15 s; this server's is shorter),
        # slack for a loaded machine.
        while not parent_lease_lapsed(KILLED_PARENT_RUN):
            assert time.monotonic() - stack.killed_parent_at < 60 + 15 + 45, (
                "the killed parent's lease held on"
            )
            time.sleep(1)
        lapsed_after_s = time.monotonic() - stack.killed_parent_at
        with hold_parent_lease(ended, 60.0):
            assert not parent_lease_lapsed(ended)
        assert parent_lease_lapsed(ended), "a parent that ends deletes its lease's limit"
    # Not sooner than the lease: the holder was killed right after it took (and first renewed) it, so the lease
    # ran out a whole lease after the kill (a parent killed later in its 45 s renewal cycle lapses from 15 s on:
    # docs/operations.md).
    assert lapsed_after_s >= 55, f"lapsed {lapsed_after_s:.0f} s after the kill: it was never held"
    print(f"parent lease lapsed {lapsed_after_s:.0f} s after the SIGKILL")
