"""A server a remote host restarted on another port reaches the parent's dispatcher, and only ours gets requests.

The two sides of a multi-host run as `flows/host_part.py` and `flows/multihost.py` wire them, in one process but with
real parts: the host's :class:`~datagen.host.fleet.Fleet` of launched stand-in servers (real processes on real
ports) publishing through :class:`~datagen.output.multihost.FleetPublisher` into a real store, and the parent's
:class:`~datagen.generation.dispatcher.Dispatcher` over them, vouched for and followed by
:class:`~datagen.generation.multihost.HostWatch` reading that store.

Mid-generation one server is SIGKILLed and another program binds its port at once (it answers ``/health`` and
chat completions for a model of the same name: only the host can tell it is not ours). The host's monitor
restarts the server, which moves to the next free port and is published as ``fleet-0001.json``; the parent
moves its requests there. The foreign listener never gets a request nor a probe, every request is answered
exactly once, and ``fleet.json`` is never rewritten.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from datagen.config import GenerationConfig
from datagen.generation.dispatcher import Dispatcher
from datagen.generation.multihost import HostVouches, HostWatch
from datagen.host.fleet import Fleet
from datagen.host.ports import port_is_free
from datagen.output.layout import RunLayout
from datagen.output.multihost import FleetPublisher, HostFleet, read_host_fleet, read_host_object
from datagen.output.store import Store
from datagen.records import CompletionRecord
from tests.support.fault_server import FaultServer
from tests.support.plans import local_plan
from tests.support.workers import worker_port
from tests.unit.test_dispatch import make_request

REPO = Path(__file__).resolve().parents[2]
HOST = "box-1"
ATTEMPT = "attempt-0001"
IN_FLIGHT = 2
ANSWER_S = 0.1
REQUESTS = 120
KILL_AFTER = 30
FOLLOW_POLL_S = 0.1
TIMEOUT_S = 60.0


def _free_ports(count: int, start: int) -> list[int]:
    ports: list[int] = []
    port = start
    while len(ports) < count:
        if port_is_free("127.0.0.1", port):
            ports.append(port)
        port += 1
    return ports


def _wait_for(predicate: object, what: str) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_server_restarted_on_another_port_of_a_remote_host_gets_the_parents_requests_never_the_squatter(
    tmp_path: Path,
) -> None:
    ports = _free_ports(2, worker_port(33000) + 1600)

    def argv(port: int) -> list[str]:
        return [
            sys.executable, "-m", "tests.support.standin_server",
            "--port", str(port), "--load-s", "0.2", "--answer-s", str(ANSWER_S),
        ]  # fmt: skip

    plan = local_plan(tmp_path, ports, argv, env={"PYTHONPATH": str(REPO)})
    store = Store(str(tmp_path / "out"))
    layout = RunLayout("host-moves")
    generation = GenerationConfig(
        max_attempts=3, backoff_initial_s=0.01, backoff_max_s=0.05, request_timeout_s=30
    )
    with Fleet(plan, tmp_path / "state", ready_timeout_s=60, stop_grace_s=5) as fleet:
        # The host part's side (flows/host_part.py).
        publisher = FleetPublisher(
            store,
            layout,
            ATTEMPT,
            HostFleet(
                host=HOST,
                flow_run_id="host-run",
                hostname="box-1.example",
                pid=os.getpid(),
                urls=fleet.client_urls,
                max_inflight_per_server=IN_FLIGHT,
                served_model_name="none",
            ),
        )
        publisher.publish()
        fleet.on_server_restarted(publisher.server_restarted)
        old_url, other_url = fleet.urls
        # The parent's side (flows/multihost.py): it knows the host only through the store.
        first = read_host_object(store, layout, ATTEMPT, HostFleet, host=HOST)
        assert first is not None
        vouches = HostVouches()
        with Dispatcher(
            first.urls,
            model="none",
            engine="transformers",
            max_inflight_per_server=IN_FLIGHT,
            generation=generation,
            vouch=vouches.version,
        ) as dispatcher:
            watch = HostWatch(dispatcher, lost_after_s=60.0, vouches=vouches)
            assert watch.join(first)
            stop = threading.Event()

            def follow() -> None:
                while not stop.wait(FOLLOW_POLL_S):
                    watch.follow(store, layout, ATTEMPT)

            follower = threading.Thread(target=follow, name="follow-host", daemon=True)
            follower.start()
            try:
                futures = [dispatcher.submit(make_request(f"q{index:03d}")) for index in range(REQUESTS)]
                _wait_for(lambda: sum(future.done() for future in futures) >= KILL_AFTER, "the first answers")
                pid = fleet.pid(old_url)
                assert pid is not None
                os.killpg(pid, signal.SIGKILL)
                # The parent sees it gone (its requests there are refused or reset) ...
                _wait_for(
                    lambda: not next(s for s in dispatcher.stats().servers if s.url == old_url).up,
                    "the parent to see the server gone",
                )
                # ... and another program takes the port: it answers anything for a model of the same name.
                with FaultServer(port=ports[0]) as squatter:
                    squatter.models = ["none"]
                    # The host's monitor restarts it: the port is taken, so it moves.
                    assert fleet.ensure_running() == [fleet.urls[0]]
                    new_url = fleet.urls[0]
                    results = [future.result(TIMEOUT_S) for future in futures]
                    assert squatter.requests == [] and squatter.health_checks == 0, "the squatter was asked"
            finally:
                stop.set()
                follower.join()
            servers = {server.url for server in dispatcher.stats().servers}

    assert new_url not in (old_url, other_url)
    assert servers == {new_url, other_url}, "the parent replaced the moved server's URL"
    assert all(isinstance(result, CompletionRecord) for result in results), results
    answered = Counter(result.key for result in results)
    assert len(answered) == REQUESTS and set(answered.values()) == {1}
    by_server = Counter(result.server for result in results if isinstance(result, CompletionRecord))
    assert by_server[new_url] > 0, f"nothing answered at the new URL: {by_server}"
    assert set(by_server) <= {old_url, other_url, new_url}
    # Write-once: the move is a new version, fleet.json is as first written.
    assert read_host_object(store, layout, ATTEMPT, HostFleet, host=HOST) == first
    moved = read_host_fleet(store, layout, ATTEMPT, HOST, 1)
    assert moved is not None and moved.urls == [new_url, other_url] and moved.restarted == [new_url]
    assert read_host_fleet(store, layout, ATTEMPT, HOST, 2) is None
