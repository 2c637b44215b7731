"""The parent's side of a multi-host run: start the host parts, meet them in the store, run one dispatcher.

    check-hosts -> one `expand-host` flow run per host (run_deployment, timeout=0: subflow runs in the UI)
      -> every host's preflight.json -> go.json (or: refuse the run, nothing halted anywhere)
      -> the first fleet.json(s) (multi_host.start_with_hosts) -> one Dispatcher; later hosts join it,
         lost hosts leave it, a server a host restarted elsewhere (fleet-NNNN.json) moves in it (a watcher thread)
      -> generation (the same shard tasks as on one box)
      -> every host still in the run answers, or is lost (waiting at most multi_host.host_lost_after_s)
      -> release.json (naming the lost hosts and why) -> the hosts stop and hand back

See docs/architecture.md ("Several hosts") for why one dispatcher over every host's servers.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from prefect import get_run_logger
from prefect.futures import PrefectFuture

from datagen.app.run_request import HostRequest
from datagen.config import RunConfig
from datagen.errors import HostsUnavailableError, OutputExistsError, PreflightError
from datagen.generation.dispatcher import Dispatcher
from datagen.generation.multihost import HostVouches, HostWatch
from datagen.output.layout import RunLayout
from datagen.output.multihost import (
    HostFleet,
    HostPreflight,
    HostsGo,
    HostsRelease,
    HostsStarted,
    read_host_object,
    read_latest_host_fleet,
    write_host_object,
)
from datagen.output.store import Store
from datagen.records import PreparedDataset
from tasks.context import RunContext
from tasks.multihost import check_hosts, ended_flow_runs, hold_parent_lease, start_host_parts
from tasks.run import record_generation_time
from tasks.shard_scheduler import Generated, generate_all

T = TypeVar("T")
# After the release, how long the parent waits to see every host part end (to log how each ended).
HOSTS_STOP_WAIT_S = 120.0


@dataclass
class HostsOutcome:
    """Which hosts served this attempt, which were lost and why, how many servers took part."""

    served: list[str] = field(default_factory=list)
    lost: dict[str, str] = field(default_factory=dict)
    servers: int = 0


def run_on_hosts(
    context: RunContext,
    request: HostRequest,
    parent_flow_run_id: str | None,
    generate: Callable[[Dispatcher], T],
    outcome: HostsOutcome,
) -> T:
    """Run ``generate`` with one dispatcher over the servers of every host of the run's ``config.hosts``.

    ``outcome`` is filled as hosts join and leave, also when generation raises. The hosts and the parent meet
    in the run's store (the context's), under this attempt's folder. Each host part is sent ``request`` (the
    config's name and the run's choices) and resolves the config from its own checkout.

    Raises:
        PreflightError: A host is misconfigured or its own checks failed; nothing was halted on any host.
        HostsUnavailableError: No host's servers came up.
    """
    config, store, layout, attempt_id = context.config, context.store, context.layout, context.attempt_id
    check_hosts(config)
    assert config.run_id is not None
    # Held until every host part has stopped: a parent killed outright lets it lapse, and the hosts stop.
    with hold_parent_lease(config.run_id, config.multi_host.parent_lease_s):
        logger = get_run_logger()
        poll_s = config.multi_host.poll_interval_s
        started = start_host_parts(config, request, attempt_id, parent_flow_run_id)
        # What each host part checks before it does anything: its parent lists it.
        write_host_object(
            store,
            layout,
            attempt_id,
            HostsStarted(parent_flow_run_id=parent_flow_run_id or "", flow_runs=started),
        )
        release = "generation over"
        try:
            _await_preflights(config, store, layout, attempt_id, started)
            waiting = dict(started)
            ready = _await_fleets(config, store, layout, attempt_id, waiting, outcome)
            first = ready[0]
            vouches = HostVouches()
            with Dispatcher.for_run(
                config,
                first.urls,
                model=first.served_model_name,
                max_inflight_per_server=first.max_inflight_per_server,
                vouch=vouches.version,
            ) as dispatcher:
                watch = HostWatch(
                    dispatcher, lost_after_s=config.multi_host.host_lost_after_s, vouches=vouches
                )
                for fleet in ready:
                    _join(watch, fleet, outcome)
                stop = threading.Event()
                watcher = threading.Thread(
                    target=contextvars.copy_context().run,
                    args=(
                        _watch_hosts,
                        config,
                        store,
                        layout,
                        attempt_id,
                        started,
                        waiting,
                        watch,
                        outcome,
                        stop,
                    ),
                    name="datagen-host-watch",
                    daemon=True,
                )
                watcher.start()
                finished = False
                try:
                    result = generate(dispatcher)
                    finished = True
                    return result
                except BaseException as error:
                    release = f"generation ended early: {type(error).__name__}"
                    raise
                finally:
                    stop.set()
                    watcher.join(poll_s * 5 + 30)
                    _settle_hosts(config, started, watch, outcome, finished=finished)
        finally:
            with contextlib.suppress(OutputExistsError):
                write_host_object(
                    store,
                    layout,
                    attempt_id,
                    HostsRelease(reason=release, lost_hosts=dict(sorted(outcome.lost.items()))),
                )
            _await_hosts_stopped(started, outcome)
            logger.info(
                "hosts released served=%s lost=%s",
                ",".join(outcome.served) or "none",
                ",".join(outcome.lost) or "none",
            )


def generate_on_hosts(
    context: RunContext,
    prepared_futures: list[PrefectFuture[PreparedDataset]],
    request: HostRequest,
    parent_flow_run_id: str | None,
    retry_failed: bool,
) -> Generated:
    """Generate over every host's servers (``config.hosts``): the host parts halt and serve, this flow sends."""
    outcome = HostsOutcome()
    wall_s: float | None = None
    finished = False

    def generate(dispatcher: Dispatcher) -> Generated:
        nonlocal wall_s, finished
        started = time.monotonic()
        try:
            generated = generate_all(context, prepared_futures, dispatcher, retry_failed, started)
            finished = True
            return generated
        finally:
            wall_s = time.monotonic() - started

    try:
        generated = run_on_hosts(context, request, parent_flow_run_id, generate, outcome)
    finally:
        # Recorded once the hosts are released, so a box lost at the very end of generation is named too.
        if wall_s is not None:
            record_generation_time(context, wall_s, outcome.servers, finished, outcome.served, outcome.lost)
    if outcome.lost:
        get_run_logger().warning(
            "hosts lost during the run: %s",
            "; ".join(f"{name} ({reason})" for name, reason in sorted(outcome.lost.items())),
        )
    generated.servers, generated.wall_s = outcome.servers, wall_s or 0.0
    return generated


def _join(watch: HostWatch, fleet: HostFleet, outcome: HostsOutcome) -> None:
    if watch.join(fleet):
        outcome.served.append(fleet.host)
        outcome.servers += len(fleet.urls)


def _await_preflights(
    config: RunConfig, store: Store, layout: RunLayout, attempt_id: str, started: dict[str, str]
) -> None:
    """Wait for every host's preflight; write go.json (go or not) once all passed or one failed."""
    deadline = time.monotonic() + config.multi_host.ready_timeout_s
    reports: dict[str, HostPreflight] = {}
    problems: list[str] = []
    while True:
        for name in started:
            if name not in reports:
                found = read_host_object(store, layout, attempt_id, HostPreflight, host=name)
                if found is not None:
                    reports[name] = found
        ended = ended_flow_runs({name: run for name, run in started.items() if name not in reports})
        problems = [
            f"host {name}: its host flow run ended ({state}) before it reported its checks: see that run's log"
            for name, state in sorted(ended.items())
        ]
        problems += [f"host {r.host}: {problem}" for r in reports.values() for problem in r.problems]
        missing = sorted(set(started) - set(reports) - set(ended))
        if problems or not missing:
            break
        if time.monotonic() >= deadline:
            problems = [
                f"host {name}: no preflight within {config.multi_host.ready_timeout_s:.0f}s: is its worker busy or "
                "stopped? (see the host flow run in the UI)"
                for name in missing
            ]
            break
        time.sleep(config.multi_host.poll_interval_s)
    if problems:
        write_host_object(store, layout, attempt_id, HostsGo(go=False, reason="; ".join(problems)))
        raise PreflightError(problems)
    write_host_object(store, layout, attempt_id, HostsGo(go=True))
    get_run_logger().info(
        "every host passed its preflight hosts=%s: halting training and starting servers there",
        ",".join(f"{r.host}@{r.hostname}" for r in reports.values()),
    )


def _await_fleets(
    config: RunConfig,
    store: Store,
    layout: RunLayout,
    attempt_id: str,
    waiting: dict[str, str],
    outcome: HostsOutcome,
) -> list[HostFleet]:
    """The first ``multi_host.start_with_hosts`` host fleets to be ready (fewer when the others were lost).

    Hosts whose flow run ends meanwhile, or that are not ready by ``multi_host.ready_timeout_s``, are lost.

    Raises:
        HostsUnavailableError: Every host was lost before serving.
    """
    wanted = config.multi_host.start_with_hosts
    deadline = time.monotonic() + config.multi_host.ready_timeout_s
    ready: list[HostFleet] = []
    while waiting and len(ready) < wanted:
        for name in list(waiting):
            found = read_latest_host_fleet(store, layout, attempt_id, name)
            if found is not None:
                del waiting[name]
                ready.append(found)
        for name, state in ended_flow_runs(waiting).items():
            outcome.lost[name] = f"its host flow run ended ({state}) before its servers were ready"
            get_run_logger().error("host lost host=%s reason=%s", name, outcome.lost[name])
            del waiting[name]
        if time.monotonic() >= deadline:
            for name in waiting:
                outcome.lost[name] = f"no servers ready within {config.multi_host.ready_timeout_s:.0f}s"
            waiting.clear()
        elif waiting and len(ready) < wanted:
            time.sleep(config.multi_host.poll_interval_s)
    if ready:
        return ready
    raise HostsUnavailableError(
        "no host's servers came up: "
        + "; ".join(f"{name}: {reason}" for name, reason in sorted(outcome.lost.items()))
        + ". Read the host flow runs' logs (subflow runs of this run in the UI), fix, and run again with the same "
        "run id to resume."
    )


def _watch_hosts(
    config: RunConfig,
    store: Store,
    layout: RunLayout,
    attempt_id: str,
    started: dict[str, str],
    waiting: dict[str, str],
    watch: HostWatch,
    outcome: HostsOutcome,
    stop: threading.Event,
) -> None:
    """Until ``stop``: join hosts whose fleet appears, follow their servers' restarts, remove hosts that are gone."""
    logger = get_run_logger()
    deadline = time.monotonic() + config.multi_host.ready_timeout_s
    while not stop.wait(config.multi_host.poll_interval_s):
        try:
            watch.follow(store, layout, attempt_id)
            for name in list(waiting):
                found = read_latest_host_fleet(store, layout, attempt_id, name)
                if found is not None:
                    del waiting[name]
                    _join(watch, found, outcome)
            ended = ended_flow_runs(started)
            for name in list(waiting):
                if name in ended or time.monotonic() >= deadline:
                    reason = (
                        f"its host flow run ended ({ended[name]}) before its servers were ready"
                        if name in ended
                        else f"no servers ready within {config.multi_host.ready_timeout_s:.0f}s"
                    )
                    del waiting[name]
                    outcome.lost[name] = watch.give_up(name, reason).reason
            for lost in watch.check({name: state for name, state in ended.items() if name in watch.active}):
                outcome.lost[lost.name] = lost.reason
            if not watch.active and not waiting:
                logger.error(
                    "every host is lost: requests wait for servers, then fail after "
                    "generation.no_live_server_timeout_s; rerun with the same run id to resume"
                )
        except Exception as error:  # the watcher must outlive one failed API call
            logger.warning("host watch failed; retrying error=%s", error)


def _settle_hosts(
    config: RunConfig, started: dict[str, str], watch: HostWatch, outcome: HostsOutcome, *, finished: bool
) -> None:
    """Generation is over: every host still in the run answers, or is lost before the release names it.

    A box that died near the end is otherwise never reported (its servers were not down for
    ``host_lost_after_s`` yet) and its host part never ends (its worker died with it). Its servers are
    counted down from when the watch first saw them down, mid-run or here, so it is lost at most
    ``host_lost_after_s`` after that; a host whose servers come back (restarted) stays. When generation ended
    early nothing is waited for: hosts not answering now are lost at once. Never raises: the release must
    be written.
    """
    logger = get_run_logger()
    poll_s = config.multi_host.poll_interval_s
    lost_after_s = config.multi_host.host_lost_after_s if finished else 0.0
    try:
        while watch.active:
            try:
                ended = ended_flow_runs({name: started[name] for name in watch.active})
            except Exception as error:  # the servers' silence is the signal that always comes
                logger.warning("host states unavailable error=%s", error)
                ended = {}
            for lost in watch.check(ended, at_end=True, lost_after_s=lost_after_s):
                outcome.lost[lost.name] = lost.reason
            if not watch.silent:
                return
            time.sleep(poll_s)
    except Exception as error:
        logger.warning("end-of-generation host check failed error=%s", error)


def _await_hosts_stopped(started: dict[str, str], outcome: HostsOutcome) -> None:
    """Wait (bounded) for the host parts to end after the release, and log how each ended."""
    logger = get_run_logger()
    deadline = time.monotonic() + HOSTS_STOP_WAIT_S
    alive = {name: run for name, run in started.items() if name not in outcome.lost}
    while alive and time.monotonic() < deadline:
        try:
            ended = ended_flow_runs(alive)
        except Exception as error:
            logger.warning("host states unavailable error=%s", error)
            return
        for name, state in ended.items():
            logger.info("host part ended host=%s state=%s", name, state)
            del alive[name]
        if alive:
            time.sleep(1.0)
    if alive:
        logger.warning(
            "host parts still running %.0fs after the release: %s (they stop their servers when they see it)",
            HOSTS_STOP_WAIT_S,
            ",".join(alive),
        )
