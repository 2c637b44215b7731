"""One box's serving sequence, the same in the single-box flow and in each host part of a multi-host run.

Halt training -> probe -> plan -> start the fleet (and its monitor); on the way out, however the block ends
(success, failure, signal, cancellation): stop the fleet, then hand the GPUs back, restarting training once
when configured. The caller holds the box's GPU lock (:func:`tasks.runtime.hold_host_gpus`) around it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.client.schemas.objects import FlowRun, State
from prefect.logging.loggers import flow_run_logger
from pydantic import BaseModel

from datagen.app.accounting import ServingTimes
from datagen.config import RunConfig
from datagen.errors import TrainingNotRestartedError
from datagen.host.fleet import Fleet
from datagen.host.fleet_registry import fleet_pidfile, stop_fleet_from_pidfile
from datagen.host.plan import ServerPlan
from datagen.progress import Stage, enter_stage
from datagen.records import utc_now
from datagen.settings import get_settings, server_api_key
from tasks.host import halt_training, hand_back_gpus, plan_servers, probe_environment, start_fleet, stop_fleet
from tasks.runtime import HostGpus, hand_back_if_gpus_free

# Seconds between checks that restart a server whose process died mid-run.
FLEET_MONITOR_INTERVAL_S = 5.0

Record = Callable[[str, BaseModel], object]


def fleets_root() -> Path:
    """Host-local folder holding one subfolder per flow run's servers."""
    return Path(get_settings().state_dir).expanduser() / "fleets"


def fleet_state_dir(flow_run_id: str) -> Path:
    """Host-local folder of one flow run's servers (pidfile, logs), known to the hooks too."""
    return fleets_root() / flow_run_id


def stop_servers_hook(flow: Any, flow_run: FlowRun, state: State[Any]) -> None:
    """A flow's cancellation and crash hook: it may run in another process, so it stops servers by the pidfile.

    Then training is handed back when no other run holds the GPUs.
    """
    logger = flow_run_logger(flow_run, flow)
    stopped = stop_fleet_from_pidfile(fleet_pidfile(fleet_state_dir(str(flow_run.id))))
    logger.warning("stopped servers after %s count=%d", state.type.value, stopped)
    restarted = hand_back_if_gpus_free()
    if restarted is not None:
        logger.warning("training restarted after %s pid=%d", state.type.value, restarted.pid)


@dataclass(frozen=True)
class Serving:
    """The box's servers, up: their plan, their owner, and the URLs requests go to.

    ``halted_at`` is when the halt of training began: a windowed run's window counts from there.
    ``held_back`` is filled on the way out when training was not restarted (its environment changed since the
    halt, or its job still runs): the caller finishes the run (merge, report) and then raises it.
    """

    plan: ServerPlan
    fleet: Fleet
    urls: list[str]
    halted_at: dt.datetime
    held_back: list[TrainingNotRestartedError] = field(default_factory=list)


@contextlib.contextmanager
def serve_on_this_box(
    config: RunConfig,
    gpus: HostGpus,
    run_id: str | None,
    state_dir: Path,
    record: Record,
    record_restart: Record | None = None,
) -> Iterator[Serving]:
    """Halt training, probe, plan and start this box's servers for the block; stop them and hand back after.

    Args:
        config: The run's config as this box runs it (its fleet and training job).
        gpus: The GPU lock the caller holds (where the halt is recorded).
        run_id: The run, recorded with the halt.
        state_dir: This flow run's fleet folder (:func:`fleet_state_dir`).
        record: Stores one record of the sequence (``training``, ``env``, ``plan``) under the attempt.
        record_restart: Stores the ``training-restart`` record; ``record`` when None.

    Yields:
        The servers, ready and monitored.

    """
    logger = get_run_logger()
    fleet: Fleet | None = None
    serving: Serving | None = None
    # When the GPUs were taken from training and what each step took: the report's accounting and the box's
    # history (the next run's cost preview) read it.
    times = ServingTimes(halted_at=utc_now(), training_halted=config.training.kind != "none")
    try:
        # Inside the try: a signal mid-halt still hands training back (once it has stopped).
        enter_stage(logger, Stage.HALT_TRAINING, kind=config.training.kind)
        step = time.monotonic()
        halt = halt_training(config.training, gpus.halt_record, run_id)
        times.training_halt_s = time.monotonic() - step
        if halt.paused_since_s is not None:
            # Adopted from a run killed while training was stopped: the pause (and a window) began with its signal.
            times.halted_at = dt.datetime.fromtimestamp(halt.paused_since_s, dt.UTC)
        record("training", halt)
        enter_stage(logger, Stage.PROBE)
        env = probe_environment()
        record("env", env)
        enter_stage(logger, Stage.PLAN)
        plan = plan_servers(env, config, state_dir)
        record("plan", plan)
        fleet = Fleet(
            plan,
            state_dir,
            ready_timeout_s=config.fleet.ready_timeout_s,
            max_restarts_per_server=config.fleet.max_restarts_per_server,
            api_key=server_api_key(),
        )
        enter_stage(logger, Stage.START_SERVERS, servers=len(plan.servers), engine=plan.engine)
        step = time.monotonic()
        urls = start_fleet(fleet, fleets_root())
        times.fleet_start_s = time.monotonic() - step
        fleet.start_monitor(FLEET_MONITOR_INTERVAL_S)
        serving = Serving(plan=plan, fleet=fleet, urls=urls, halted_at=times.halted_at)
        yield serving
    finally:
        if fleet is not None:
            enter_stage(logger, Stage.STOP_SERVERS)
            step = time.monotonic()
            stop_fleet(fleet)
            times.fleet_stop_s = time.monotonic() - step
        # The GPUs are free now: merge and tokenize need none, so training need not wait for them.
        step = time.monotonic()
        try:
            restarted = hand_back_gpus(gpus.halt_record)
        except TrainingNotRestartedError as held_back:
            # The data is not at stake: the run finishes, then ends with this (the halt record stays).
            logger.error("%s", held_back)
            restarted = None
            if serving is not None:
                serving.held_back.append(held_back)
        times.training_restart_s = time.monotonic() - step
        times.handed_back_at = utc_now()
        if restarted is not None:
            (record_restart or record)("training-restart", restarted)
        try:
            record("serving-times", times)
        except Exception as error:  # the accounting loses one attempt; the run's outcome must not change
            logger.warning("serving times not recorded error=%r", error)
