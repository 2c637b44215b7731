"""The fleet against real processes: two `transformers serve` CPU servers on the tiny model, plus small
HTTP servers written here (health endpoint only) for the fast stop/orphan/fault paths."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from datagen.config import GenerationConfig, RunConfig
from datagen.engines import LaunchCommand
from datagen.errors import ServerStartError
from datagen.generation.dispatcher import Dispatcher
from datagen.host.fleet import Fleet
from datagen.host.fleet_registry import PIDFILE_NAME, FleetRegistry, cleanup_orphans
from datagen.host.plan import ServerPlan, plan_servers
from datagen.host.ports import port_is_free
from datagen.host.probe import probe_environment
from datagen.records import CompletionRecord
from tests.support.fault_server import FaultServer
from tests.support.plans import local_plan
from tests.support.workers import worker_port
from tests.unit.test_dispatch import make_request

REPO = Path(__file__).resolve().parents[2]

READY_TIMEOUT_S = 120.0
CHAT_TIMEOUT_S = 60.0
PORT_SEARCH_START = worker_port(33000)

# A stand-in server: answers GET /health, keeps a child in its process group, optionally ignores SIGTERM.
HEALTH_SERVER = textwrap.dedent(
    """
    import http.server, signal, subprocess, sys
    port, stubborn = int(sys.argv[1]), sys.argv[2] == "stubborn"
    if stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


def _free_ports(count: int, start: int = PORT_SEARCH_START) -> list[int]:
    ports: list[int] = []
    port = start
    while len(ports) < count:
        if port_is_free("127.0.0.1", port):
            ports.append(port)
        port += 1
    return ports


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in {"Z", "X"}:
            members.append(int(entry.name))
    return members


def _wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def _chat(url: str, model: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 4},
        timeout=CHAT_TIMEOUT_S,
    )


def _health_plan(tmp_path: Path, count: int, *, stubborn: bool = False) -> ServerPlan:
    mode = "stubborn" if stubborn else "polite"
    return local_plan(
        tmp_path, _free_ports(count), lambda port: [sys.executable, "-c", HEALTH_SERVER, str(port), mode]
    )


def _tiny_config(model_dir: Path, base_port: int) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "datasets": [{"name": "chat", "format": "sharegpt", "path": "/unused"}],
            "output": "/unused",
            "fleet": {"device": "cpu", "cpu_servers": 2, "base_port": base_port},
        }
    )


@pytest.fixture(scope="module")
def tiny_fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    state_dir = tmp_path_factory.mktemp("fleet-state")
    config = _tiny_config(tiny_model_dir, _free_ports(1, start=PORT_SEARCH_START + 500)[0])
    plan = plan_servers(probe_environment(), config, state_dir)
    fleet = Fleet(plan, state_dir, ready_timeout_s=READY_TIMEOUT_S, max_restarts_per_server=2)
    fleet.start()
    try:
        yield fleet
    finally:
        fleet.close()


def test_servers_start_in_parallel_register_their_pids_and_answer_chat(tiny_fleet: Fleet) -> None:
    registry = FleetRegistry.model_validate_json(tiny_fleet.pidfile_path.read_text())

    assert [record.url for record in registry.servers] == tiny_fleet.urls
    assert registry.owner_pid == os.getpid()
    for record in registry.servers:
        assert record.pgid == record.pid
        assert _group_members(record.pgid)
        assert "transformers.cli.transformers" in record.cmd
    for url in tiny_fleet.urls:
        response = _chat(url, tiny_fleet.plan.served_model_name)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["role"] == "assistant"


def test_server_killed_with_sigkill_is_restarted_by_ensure_running(tiny_fleet: Fleet) -> None:
    url = tiny_fleet.urls[0]
    old_pid = tiny_fleet.pid(url)
    assert old_pid is not None

    os.killpg(old_pid, signal.SIGKILL)
    assert _wait_for(lambda: not tiny_fleet.is_alive(url), timeout_s=10)
    restarted = tiny_fleet.ensure_running()

    assert restarted == [url]
    new_pid = tiny_fleet.pid(url)
    assert new_pid is not None and new_pid != old_pid
    assert tiny_fleet.restarts(url) == 1
    assert _chat(url, tiny_fleet.plan.served_model_name).status_code == 200
    registry = FleetRegistry.model_validate_json(tiny_fleet.pidfile_path.read_text())
    assert new_pid in [record.pid for record in registry.servers]
    assert tiny_fleet.ensure_running() == []


def test_monitor_thread_brings_a_killed_server_back(tiny_fleet: Fleet) -> None:
    url = tiny_fleet.urls[1]
    old_pid = tiny_fleet.pid(url)
    assert old_pid is not None
    tiny_fleet.start_monitor(interval_s=0.2)
    try:
        os.killpg(old_pid, signal.SIGKILL)
        assert _wait_for(lambda: tiny_fleet.restarts(url) == 1 and tiny_fleet.is_alive(url), READY_TIMEOUT_S)
    finally:
        tiny_fleet.stop_monitor()
    assert _wait_for(lambda: _chat(url, tiny_fleet.plan.served_model_name).status_code == 200, 30)


def test_server_with_a_bad_model_path_fails_fast_quoting_its_log(tmp_path: Path) -> None:
    config = _tiny_config(tmp_path / "no-such-model", _free_ports(1, start=PORT_SEARCH_START + 700)[0])
    config.fleet.cpu_servers = 1
    plan = plan_servers(probe_environment(), config, tmp_path)
    fleet = Fleet(plan, tmp_path, ready_timeout_s=READY_TIMEOUT_S)
    started = time.monotonic()

    with pytest.raises(ServerStartError) as raised:
        fleet.start()

    elapsed = time.monotonic() - started
    message = str(raised.value)
    assert elapsed < READY_TIMEOUT_S / 3
    assert "no-such-model" in message
    assert plan.servers[0].log_path is not None and plan.servers[0].log_path in message
    assert "Traceback" in message or "exited with code" in message
    assert not (tmp_path / PIDFILE_NAME).exists()
    fleet.close()


def test_stop_terminates_every_process_of_every_group_and_is_idempotent(tmp_path: Path) -> None:
    fleet = Fleet(_health_plan(tmp_path, 2), tmp_path, ready_timeout_s=30, stop_grace_s=5)
    fleet.start()
    groups = [fleet.pid(url) for url in fleet.urls]
    assert all(pgid is not None and len(_group_members(pgid)) == 2 for pgid in groups)

    fleet.stop()
    fleet.stop()

    assert all(_group_members(pgid) == [] for pgid in groups if pgid is not None)
    assert not fleet.pidfile_path.exists()
    assert not fleet.is_alive(fleet.urls[0])
    fleet.close()


def test_servers_ignoring_sigterm_are_killed_after_the_grace_period(tmp_path: Path) -> None:
    fleet = Fleet(_health_plan(tmp_path, 1, stubborn=True), tmp_path, ready_timeout_s=30, stop_grace_s=1)
    fleet.start()
    pgid = fleet.pid(fleet.urls[0])
    assert pgid is not None

    started = time.monotonic()
    fleet.close()

    assert _group_members(pgid) == []
    assert time.monotonic() - started < 10


def test_a_different_process_stops_the_fleet_through_the_pidfile(tmp_path: Path) -> None:
    fleet = Fleet(_health_plan(tmp_path, 2), tmp_path, ready_timeout_s=30, stop_grace_s=5)
    fleet.start()
    groups = [fleet.pid(url) for url in fleet.urls]
    code = (
        "from datagen.host.fleet_registry import stop_fleet_from_pidfile; "
        f"print(stop_fleet_from_pidfile({str(fleet.pidfile_path)!r}))"
    )

    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )

    assert result.stdout.strip() == "2"
    assert all(_group_members(pgid) == [] for pgid in groups if pgid is not None)
    assert not fleet.pidfile_path.exists()
    fleet.close()


def test_orphans_of_a_dead_owner_are_stopped_but_a_reused_pid_is_left_alone(tmp_path: Path) -> None:
    state_dir = tmp_path / "fleets" / "crashed-run"
    fleet = Fleet(_health_plan(state_dir, 2), state_dir, ready_timeout_s=30, stop_grace_s=5)
    fleet.start()
    pgids = [fleet.pid(url) or 0 for url in fleet.urls]
    registry = FleetRegistry.model_validate_json(fleet.pidfile_path.read_text())
    # The owner "crashed": its pid no longer exists. The second record's command no longer matches what
    # its pid runs, as after pid reuse.
    dead_owner = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    registry.owner_pid = int(dead_owner.stdout)
    registry.owner_start_ticks = None
    registry.servers[1].cmd = ["/usr/bin/something-else"]
    fleet.pidfile_path.write_text(registry.model_dump_json())
    try:
        assert cleanup_orphans(tmp_path / "fleets", grace_s=5, recursive=True) == 0  # still live here

        assert fleet.is_alive(fleet.urls[0])
        # A new run (another process) finds the crashed run's servers.
        code = (
            "from datagen.host.fleet_registry import cleanup_orphans; "
            f"print(cleanup_orphans({str(tmp_path / 'fleets')!r}, grace_s=5, recursive=True))"
        )
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)

        assert result.stdout.strip() == "1"
        assert _group_members(pgids[0]) == []
        assert _group_members(pgids[1])
        assert not fleet.pidfile_path.exists()
    finally:
        fleet.close()
    assert _group_members(pgids[1]) == []


def test_cleanup_leaves_the_servers_of_a_live_owner_alone(tmp_path: Path) -> None:
    fleet = Fleet(_health_plan(tmp_path, 1), tmp_path, ready_timeout_s=30, stop_grace_s=5)
    fleet.start()
    try:
        owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            data = json.loads(fleet.pidfile_path.read_text())
            data["owner_pid"], data["owner_start_ticks"] = owner.pid, None
            fleet.pidfile_path.write_text(json.dumps(data))

            assert cleanup_orphans(tmp_path) == 0
            assert fleet.is_alive(fleet.urls[0])
        finally:
            owner.kill()
            owner.wait()
    finally:
        fleet.close()


def test_external_servers_are_probed_but_never_stopped(tmp_path: Path) -> None:
    port = _free_ports(1, start=PORT_SEARCH_START + 900)[0]
    server = subprocess.Popen(
        [sys.executable, "-c", HEALTH_SERVER, str(port), "polite"], start_new_session=True
    )
    try:
        config = RunConfig.model_validate(
            {
                "model": {"path": "m"},
                "datasets": [{"name": "chat", "format": "sharegpt", "path": "/unused"}],
                "output": "/unused",
                "fleet": {"engine": "external", "external_urls": [f"http://127.0.0.1:{port}"]},
            }
        )
        plan = plan_servers(probe_environment(), config, tmp_path)
        with Fleet(plan, tmp_path, ready_timeout_s=30) as fleet:
            assert fleet.is_alive(f"http://127.0.0.1:{port}")
            assert fleet.ensure_running() == []
        assert server.poll() is None
        assert not (tmp_path / PIDFILE_NAME).exists()
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_missing_engine_executable_is_a_server_start_error(tmp_path: Path) -> None:
    plan = _health_plan(tmp_path, 1)
    broken = plan.servers[0].model_copy(
        update={"launch": LaunchCommand(argv=[str(tmp_path / "no-such-python")])}
    )
    fleet = Fleet(plan.model_copy(update={"servers": [broken]}), tmp_path, ready_timeout_s=30)

    with pytest.raises(ServerStartError, match="no-such-python"):
        fleet.start()
    fleet.close()


def test_router_starts_after_the_servers_and_is_the_only_client_url(tmp_path: Path) -> None:
    plan = _health_plan(tmp_path, 3)
    router_spec, *workers = plan.servers
    renumbered = [server.model_copy(update={"index": index}) for index, server in enumerate(workers)]
    plan = plan.model_copy(update={"servers": renumbered, "router": router_spec})
    fleet = Fleet(plan, tmp_path, ready_timeout_s=30, stop_grace_s=5, max_restarts_per_server=1)
    fleet.start()
    try:
        assert fleet.client_urls == [router_spec.url]
        assert fleet.urls == [server.url for server in workers]
        registry = FleetRegistry.model_validate_json(fleet.pidfile_path.read_text())
        assert [record.url for record in registry.servers] == [*fleet.urls, router_spec.url]
        assert fleet.is_alive(router_spec.url)
        router_pid = fleet.pid(router_spec.url)
        assert router_pid is not None

        os.killpg(router_pid, signal.SIGKILL)
        assert _wait_for(lambda: not fleet.is_alive(router_spec.url), timeout_s=10)

        assert fleet.ensure_running() == [router_spec.url]
        assert fleet.is_alive(router_spec.url)
    finally:
        groups = [fleet.pid(url) for url in [*fleet.urls, router_spec.url]]
        fleet.close()
    assert all(_group_members(pgid) == [] for pgid in groups if pgid is not None)


# --- our server or none: ports taken after the plan, foreign listeners, the model check ----------------


def _standin_plan(tmp_path: Path, ports: list[int], load_s: float, model: str = "none") -> ServerPlan:
    """Launched stand-ins (tests/support/standin_server.py) that load for ``load_s`` and list ``model``."""

    def argv(port: int) -> list[str]:
        return [
            sys.executable, "-m", "tests.support.standin_server",
            "--port", str(port), "--load-s", str(load_s), "--model", model,
        ]  # fmt: skip

    return local_plan(tmp_path, ports, argv, env={"PYTHONPATH": str(REPO)})


def _answers(fleet: Fleet, count: int) -> list[object]:
    generation = GenerationConfig(
        max_attempts=2, backoff_initial_s=0.01, backoff_max_s=0.05, request_timeout_s=30
    )
    with Dispatcher(
        fleet.client_urls,
        model="none",
        engine="transformers",
        max_inflight_per_server=2,
        generation=generation,
    ) as dispatcher:
        # Every server up first (under load a probe may answer late, and the first server up would take all),
        # then all at once: more requests than one server's cap, so every server of the fleet takes some.
        assert _wait_for(lambda: len(dispatcher.stats().servers_up) == len(fleet.client_urls), timeout_s=30)
        futures = [dispatcher.submit(make_request(f"q{index}")) for index in range(count)]
        return [future.result(60) for future in futures]


def test_a_foreign_listener_on_a_planned_port_is_named_never_asked_and_our_server_moves_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ports = _free_ports(2, start=PORT_SEARCH_START + 1200)
    plan = _standin_plan(tmp_path, ports, load_s=1.0)
    # Another program binds server 0's port right after the plan, while our server is still loading.
    with FaultServer(port=ports[0]) as foreign, caplog.at_level(logging.INFO, logger="datagen.host"):
        foreign.models = ["none"]  # it even serves a model of the same name: only the socket tells them apart
        with Fleet(plan, tmp_path / "state", ready_timeout_s=60, stop_grace_s=5) as fleet:
            moved_url = fleet.urls[0]
            answers = _answers(fleet, 8)
            registry = FleetRegistry.model_validate_json(fleet.pidfile_path.read_text())
        assert foreign.health_checks == 0 and foreign.requests == [], "the foreign listener was sent requests"

    assert moved_url != foreign.url and fleet.urls[1] == plan.servers[1].url
    assert registry.servers[0].url == moved_url
    assert all(isinstance(answer, CompletionRecord) for answer in answers)
    assert {answer.server for answer in answers if isinstance(answer, CompletionRecord)} == set(fleet.urls)
    messages = [record.getMessage() for record in caplog.records]
    named = [m for m in messages if f"another program listens on port {ports[0]}" in m]
    assert named and f"pid={os.getpid()}" in named[0], messages
    assert any(f"server moved index=0 from={foreign.url} to={moved_url}" in m for m in messages), messages


def test_a_bind_failure_in_the_log_relaunches_the_server_on_the_next_free_port(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ports = _free_ports(1, start=PORT_SEARCH_START + 1300)
    plan = _standin_plan(tmp_path, ports, load_s=0.2)
    # Bound, not listening: invisible as a listener, yet our server's bind fails (a race the log tells).
    with socket.socket() as squatter, caplog.at_level(logging.INFO, logger="datagen.host"):
        squatter.bind(("127.0.0.1", ports[0]))
        with Fleet(plan, tmp_path / "state", ready_timeout_s=60, stop_grace_s=5) as fleet:
            url = fleet.urls[0]
            answers = _answers(fleet, 2)

    assert url != plan.servers[0].url
    assert all(isinstance(answer, CompletionRecord) and answer.server == url for answer in answers)
    messages = [record.getMessage() for record in caplog.records]
    assert any("could not bind port" in m and "address already in use" in m for m in messages), messages
    log = Path(plan.servers[0].log_path or "").read_text()
    assert "error while attempting to bind on address" in log and f"--port {ports[0]}" in log


def test_a_restarted_server_whose_port_was_taken_moves_and_the_dispatcher_is_told(tmp_path: Path) -> None:
    ports = _free_ports(1, start=PORT_SEARCH_START + 1400)
    plan = _standin_plan(tmp_path, ports, load_s=0.2)
    moves: list[tuple[str, str]] = []
    with Fleet(plan, tmp_path / "state", ready_timeout_s=60, stop_grace_s=5) as fleet:
        fleet.on_server_moved(lambda old, new: moves.append((old, new)))
        old_url = fleet.urls[0]
        pid = fleet.pid(old_url)
        assert pid is not None
        os.killpg(pid, signal.SIGKILL)
        assert _wait_for(lambda: not fleet.is_alive(old_url), timeout_s=10)
        with FaultServer(port=ports[0]) as foreign:
            restarted = fleet.ensure_running()
            assert foreign.health_checks == 0 and foreign.requests == []
            new_url = fleet.urls[0]
            assert restarted == [new_url] and new_url != old_url
            assert moves == [(old_url, new_url)]
            assert fleet.is_alive(new_url) and not fleet.is_alive(old_url)
            assert fleet.restarts(old_url) == fleet.restarts(new_url) == 1


def test_an_external_server_serving_another_model_is_refused_before_any_request(tmp_path: Path) -> None:
    with FaultServer() as other_run:
        other_run.models = ["someone-elses-model"]
        config = RunConfig.model_validate(
            {
                "model": {"path": "our-model"},
                "datasets": [{"name": "chat", "format": "sharegpt", "path": "/unused"}],
                "output": "/unused",
                "fleet": {"engine": "external", "external_urls": [other_run.url]},
            }
        )
        plan = plan_servers(probe_environment(), config, tmp_path)
        fleet = Fleet(plan, tmp_path, ready_timeout_s=30)
        with pytest.raises(
            ServerStartError, match="serves 'someone-elses-model', not the planned 'our-model'"
        ):
            fleet.start()
        fleet.close()
        assert other_run.chat_requests() == []
