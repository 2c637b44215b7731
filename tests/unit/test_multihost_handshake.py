"""Multi-host pieces without Prefect: the `hosts:` config, the store handshake, and hosts joining and leaving a
real dispatcher (a real HTTP server for a live host, a closed port for a dead one)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from datagen.config import GenerationConfig, RunConfig, parse_run_config
from datagen.errors import ConfigError, OutputExistsError
from datagen.generation.dispatcher import Dispatcher
from datagen.generation.multihost import HostWatch
from datagen.output.layout import RunLayout
from datagen.output.multihost import (
    FleetPublisher,
    HostFleet,
    HostsGo,
    read_host_fleet,
    read_latest_host_fleet,
    wait_for_host_object,
    write_host_object,
)
from datagen.output.store import Store
from tests.support.fault_server import FaultServer
from tests.support.prefect_stack import free_port

BASE: dict[str, Any] = {
    "model": {"path": "m"},
    "datasets": [{"name": "d", "format": "openai_messages", "path": "x.jsonl"}],
    "output": "/tmp/out",
}


def _hosts(*hosts: dict[str, Any], **changes: Any) -> RunConfig:
    return parse_run_config({**BASE, "hosts": list(hosts), **changes})


def test_a_host_overrides_fleet_keys_and_its_training_job_and_the_run_hash_ignores_hosts() -> None:
    config = _hosts(
        {"name": "box-1", "work_queue": "box-1", "fleet": {"host": "10.0.0.5", "num_servers": 4}},
        {"name": "box-2", "work_queue": "box-2", "training": {"kind": "systemd", "systemd_unit": "train"}},
    )

    one = config.for_host("box-1")
    two = config.for_host("box-2")

    assert (one.fleet.host, one.fleet.num_servers, one.training.kind) == ("10.0.0.5", 4, "none")
    assert (two.fleet.host, two.training.kind, two.hosts) == ("127.0.0.1", "systemd", [])
    assert config.config_hash() == parse_run_config(BASE).config_hash(), "a resume may use other hosts"


@pytest.mark.parametrize(
    ("hosts", "changes", "message"),
    [
        (
            [{"name": "a", "work_queue": "qa"}, {"name": "a", "work_queue": "qb"}],
            {},
            "host names must be unique; repeated: a",
        ),
        (
            [{"name": "a", "work_queue": "q"}, {"name": "b", "work_queue": "q"}],
            {},
            "hosts share work queue(s) q",
        ),
        ([{"name": "a", "work_queue": "q", "fleet": {"engine": "sglang"}}], {}, "fleet.engine cannot differ"),
        (
            [{"name": "a", "work_queue": "q", "fleet": {"base_port": 5}}],
            {},
            "host a: fleet overrides are invalid",
        ),
        (
            [{"name": "a", "work_queue": "q"}],
            {"fleet": {"router": True}},
            "fleet.router cannot be used with hosts",
        ),
        (
            [{"name": "a", "work_queue": "q"}],
            {"multi_host": {"start_with_hosts": 2}},
            "start_with_hosts is 2 but only 1 host",
        ),
        (
            [{"name": "a", "work_queue": "q"}],
            {"window": {"max_hours": 6}},
            "window cannot be used with hosts yet",
        ),
    ],
)
def test_a_bad_hosts_section_is_refused_with_a_one_line_fix(
    hosts: list[dict[str, Any]], changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _hosts(*hosts, **changes)


def test_handshake_objects_are_write_once_and_a_wait_ends_by_object_give_up_or_deadline(
    tmp_path: Path,
) -> None:
    store = Store(str(tmp_path / "out"))
    layout = RunLayout("r1")

    assert wait_for_host_object(
        store, layout, "a1", HostsGo, poll_s=0.01, give_up=lambda: "parent ended"
    ) == ("parent ended")
    waited = wait_for_host_object(store, layout, "a1", HostsGo, poll_s=0.01, timeout_s=0.05)
    assert isinstance(waited, str) and "did not appear" in waited
    write_host_object(store, layout, "a1", HostsGo(go=True))
    with pytest.raises(OutputExistsError):
        write_host_object(store, layout, "a1", HostsGo(go=False, reason="too late"))
    assert wait_for_host_object(store, layout, "a1", HostsGo, poll_s=0.01) == HostsGo(go=True)
    assert layout.hosts_object("a1", HostFleet.object_name, "box-1") == "runs/r1/hosts/a1/box-1/fleet.json"


def _fleet(host: str, urls: list[str]) -> HostFleet:
    return HostFleet(
        host=host,
        flow_run_id="f",
        hostname="h",
        pid=1,
        urls=urls,
        max_inflight_per_server=4,
        served_model_name="m",
    )


def _wait(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_each_restart_is_a_new_fleet_version_and_a_late_reader_gets_the_latest(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "out"))
    layout = RunLayout("r1")
    first = _fleet("box-1", ["http://a:1", "http://a:2"])
    publisher = FleetPublisher(store, layout, "a1", first)
    publisher.publish()
    assert read_latest_host_fleet(store, layout, "a1", "box-1") == first

    publisher.server_restarted("http://a:1", "http://a:3")  # moved off a taken port
    publisher.server_restarted("http://a:2", "http://a:2")  # restarted where it was

    one = read_host_fleet(store, layout, "a1", "box-1", 1)
    two = read_host_fleet(store, layout, "a1", "box-1", 2)
    assert one is not None and (one.urls, one.restarted) == (["http://a:3", "http://a:2"], ["http://a:3"])
    assert two is not None and (two.urls, two.restarted) == (["http://a:3", "http://a:2"], ["http://a:2"])
    assert read_latest_host_fleet(store, layout, "a1", "box-1") == two
    assert read_host_fleet(store, layout, "a1", "box-1", 0) == first, "fleet.json is never rewritten"
    assert layout.hosts_object("a1", two.name, "box-1") == "runs/r1/hosts/a1/box-1/fleet-0002.json"


def test_a_host_whose_servers_stay_down_is_removed_and_a_live_one_stays() -> None:
    now = [0.0]
    dead = f"http://127.0.0.1:{free_port()}"
    with (
        FaultServer() as live,
        Dispatcher(
            [live.url], model="m", engine="external", max_inflight_per_server=4, generation=GenerationConfig()
        ) as dispatcher,
    ):
        watch = HostWatch(dispatcher, lost_after_s=5.0, clock=lambda: now[0])
        assert watch.join(_fleet("box-1", [live.url]))
        assert watch.join(_fleet("box-2", [dead]))
        assert not watch.join(_fleet("box-2", [dead])), "a host joins once"
        _wait(lambda: any(s.up for s in dispatcher.stats().servers if s.url == live.url))
        # A new server counts as up until its first health probe fails (later under load).
        _wait(lambda: not any(s.up for s in dispatcher.stats().servers if s.url == dead))

        assert watch.check({}) == []  # box-2 down since now
        now[0] = 4.0
        assert watch.check({}) == []
        now[0] = 6.0
        lost = watch.check({})

        assert [host.name for host in lost] == ["box-2"]
        assert "servers down for 6s" in lost[0].reason
        assert watch.active == ["box-1"]
        _wait(lambda: [s.url for s in dispatcher.stats().servers] == [live.url])
        assert not watch.join(_fleet("box-2", [dead])), "a lost host does not come back in this attempt"


def test_a_host_whose_flow_run_ended_is_removed_at_once() -> None:
    with (
        FaultServer() as live,
        Dispatcher(
            [live.url], model="m", engine="external", max_inflight_per_server=4, generation=GenerationConfig()
        ) as dispatcher,
    ):
        watch = HostWatch(dispatcher, lost_after_s=60.0)
        watch.join(_fleet("box-1", [live.url]))

        lost = watch.check({"box-1": "Crashed"})

        assert [(host.name, host.reason) for host in lost] == [
            ("box-1", "its host flow run ended (Crashed) while generation went on")
        ]
        assert watch.active == []


def test_at_the_end_an_idle_host_that_died_is_found_by_connecting_and_named_when_it_stays_silent() -> None:
    # box-2's server was up and idle when it died: no request failed there, so the dispatcher still counts
    # it up; only the end-of-generation check (a TCP connect) finds it gone.
    now = [0.0]
    with (
        FaultServer() as live,
        FaultServer() as dying,
        Dispatcher(
            [live.url, dying.url],
            model="m",
            engine="external",
            max_inflight_per_server=4,
            generation=GenerationConfig(),
        ) as dispatcher,
    ):
        watch = HostWatch(dispatcher, lost_after_s=5.0, clock=lambda: now[0])
        watch.join(_fleet("box-1", [live.url]))
        watch.join(_fleet("box-2", [dying.url]))
        _wait(lambda: all(s.up for s in dispatcher.stats().servers))
        dying.stop()

        assert watch.check({}) == [] and watch.silent == [], "mid-run, an idle dead server is not noticed"
        assert watch.check({}, at_end=True) == []
        assert watch.silent == ["box-2"]
        now[0] = 5.0
        lost = watch.check({}, at_end=True)

        assert [(host.name, host.reason) for host in lost] == [
            ("box-2", "all 1 of its servers down for 5s at the end of generation")
        ]
        assert watch.active == ["box-1"] and watch.silent == []


def test_when_generation_ended_early_a_silent_host_is_lost_at_once_and_a_live_one_stays() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with (
        FaultServer() as live,
        Dispatcher(
            [live.url], model="m", engine="external", max_inflight_per_server=4, generation=GenerationConfig()
        ) as dispatcher,
    ):
        watch = HostWatch(dispatcher, lost_after_s=60.0)
        watch.join(_fleet("box-1", [live.url]))
        watch.join(_fleet("box-2", [dead]))
        _wait(lambda: any(s.up for s in dispatcher.stats().servers if s.url == live.url))

        lost = watch.check({}, at_end=True, lost_after_s=0.0)

        assert [host.name for host in lost] == ["box-2"]
        assert "at the end of generation" in lost[0].reason
        assert watch.active == ["box-1"]
