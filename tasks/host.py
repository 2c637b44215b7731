"""Host tasks: halt (and restart) the training job, probe the environment, plan and run the server fleet."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.states import Cancelled, Cancelling

import datagen.host.fleet_registry
import datagen.host.handback
import datagen.host.plan
import datagen.host.probe
import datagen.host.trainer_env
import datagen.host.training
from datagen.config import RunConfig, TrainingJobConfig
from datagen.host.env_report import EnvReport
from datagen.host.fleet import Fleet
from datagen.host.handback import HaltedTraining, record_halt
from datagen.host.plan import ServerPlan
from datagen.host.training import HaltRecord, RestartRecord
from datagen.host.training_jobs import JobTarget

# A flow run in one of these states has not started executing: cancelling it needs no worker.
NOT_STARTED_STATES = {StateType.SCHEDULED, StateType.PENDING, StateType.PAUSED}
ACTIVE_STATES = [
    StateType.SCHEDULED,
    StateType.PENDING,
    StateType.RUNNING,
    StateType.PAUSED,
    StateType.CANCELLING,
]


class PrefectFlowRunControl:
    """:class:`datagen.host.training_jobs.FlowRunControl` over the Prefect API this process is configured for."""

    def flow_run_state(self, flow_run_id: str) -> str:
        """The state type name of a flow run (``SCHEDULED`` when it has no state yet)."""
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(UUID(flow_run_id)).state
        return state.type.value if state is not None else StateType.SCHEDULED.value

    def active_flow_runs(self, deployment: str) -> list[str]:
        """Ids of the not-yet-final flow runs of ``flow-name/deployment-name``."""
        with get_client(sync_client=True) as client:
            found = client.read_deployment_by_name(deployment)
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[found.id])),
                flow_run_filter=FlowRunFilter(
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=ACTIVE_STATES))
                ),
            )
        return [str(run.id) for run in runs]

    def cancel_flow_run(self, flow_run_id: str) -> None:
        """Cancel a flow run: Cancelled at once if it never started, else Cancelling for its worker."""
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(UUID(flow_run_id))
            if run.state is not None and run.state.type in NOT_STARTED_STATES:
                client.set_flow_run_state(run.id, Cancelled(message="halted by datagen"), force=True)
            else:
                client.set_flow_run_state(run.id, Cancelling(message="halted by datagen"))


@task(name="halt-training", task_run_name="halt-training-{training.kind}", cache_policy=NO_CACHE)
def halt_training(training: TrainingJobConfig, halt_record: Path, run_id: str | None) -> HaltRecord:
    """Stop the training job gracefully and record what was stopped (idempotent; call with the GPU lock).

    A halt left on the host by a run that died holding the GPUs is adopted: training is not signalled a
    second time, only waited for, and this run hands it back at its end (see :mod:`datagen.host.handback`).
    """
    logger = get_run_logger()
    flow_runs = PrefectFlowRunControl() if training.kind == "prefect" else None
    adopted = datagen.host.handback.adopt_halt(halt_record, run_id)
    if adopted is not None:
        halted = adopted
        signal_time_s = adopted.signal_time_s
        record = datagen.host.training.halt_training(
            adopted.training,
            flow_runs=flow_runs,
            signalled_before_s=signal_time_s if signal_time_s is not None else 0.0,
            earlier_target=adopted.target(),
        )
    else:
        halted = HaltedTraining(training=training, run_id=run_id)
        # Recorded before the signal, so a run killed mid-halt leaves a record the next run adopts.
        record_halt(halt_record, halted)

        @contextlib.contextmanager
        def recording_signal(target: JobTarget) -> Iterator[None]:
            nonlocal halted
            before = halted
            # Every Python process of the job: a launcher (a shell) may be none, its workers are the trainer.
            environments = datagen.host.trainer_env.read_job_environments(target.pids)
            halted = halted.model_copy(
                update={
                    "pids": target.pids,
                    "start_ticks": target.start_ticks,
                    "signalling_at_s": time.time(),
                    "environments": environments,
                }
            )
            record_halt(halt_record, halted)
            try:
                yield
            except Exception:
                # The signal's own failure (e.g. no permission): it did not go out, training was not touched.
                # An interrupt (BaseException) leaves "signalling": the signal may have gone out.
                halted = before
                record_halt(halt_record, halted)
                raise
            halted = halted.model_copy(update={"signalled": True, "signalled_at_s": time.time()})
            record_halt(halt_record, halted)

        record = datagen.host.training.halt_training(
            training, flow_runs=flow_runs, recording_signal=recording_signal
        )
    record_halt(halt_record, halted.model_copy(update={"done": True}))
    if adopted is not None and adopted.signal_time_s:
        record.paused_since_s = adopted.signal_time_s
    if record.stopped and training.restart_after_run and not halted.environments:
        record.notes.append(
            f"no Python process of the job could be read (pids {record.pids}): its environment is not recorded, "
            "so the restart after the run is not checked against it"
        )
    if record.already_gone and record.kind != "none" and adopted is None:
        logger.warning(
            "training was not running: nothing halted kind=%s target=%s (if training holds the GPUs, fix "
            "`training` in the config)",
            record.kind,
            record.target,
        )
    logger.info(
        "training %s kind=%s target=%s escalated=%s last_checkpoint=%s gpu_released=%s",
        "not running" if record.already_gone else "halted" if record.stopped else "left alone",
        record.kind,
        record.target,
        record.escalated,
        record.last_checkpoint,
        record.gpu_memory_released,
    )
    for note in record.notes:
        logger.warning("training halt: %s", note)
    return record


@task(name="hand-back-gpus", cache_policy=NO_CACHE)
def hand_back_gpus(halt_record: Path) -> RestartRecord | None:
    """Restart training once the fleet is down, if it was halted and ``restart_after_run`` is on."""
    record = datagen.host.handback.hand_back_gpus(halt_record)
    if record is not None:
        get_run_logger().info(
            "training restarted pid=%d argv=%s log=%s", record.pid, record.argv, record.log_path
        )
    return record


@task(name="probe-environment", cache_policy=NO_CACHE)
def probe_environment() -> EnvReport:
    """Probe GPUs, interconnect, drivers and packages; publish the report as an artifact."""
    report = datagen.host.probe.probe_environment()
    create_markdown_artifact(report.to_markdown(), key="environment", description="What this host offers")
    logger = get_run_logger()
    logger.info("probe gpus=%d problems=%d", len(report.gpus), len(report.problems))
    for problem in report.problems:
        if problem.severity != "info":
            logger.warning("environment %s: %s fix: %s", problem.severity, problem.message, problem.fix)
    return report


@task(name="plan-servers", cache_policy=NO_CACHE)
def plan_servers(env: EnvReport, config: RunConfig, state_dir: Path) -> ServerPlan:
    """Decide the servers (DP/TP/CPU/external) and their exact argv; publish the plan as an artifact."""
    plan = datagen.host.plan.plan_servers(env, config, state_dir)
    create_markdown_artifact(
        plan.to_markdown(), key="server-plan", description="Servers and their exact argv"
    )
    get_run_logger().info("plan mode=%s servers=%d engine=%s", plan.mode, len(plan.servers), plan.engine)
    return plan


@task(name="start-fleet", cache_policy=NO_CACHE)
def start_fleet(fleet: Fleet, fleets_root: Path) -> list[str]:
    """Stop servers orphaned by crashed earlier runs on this host, then start every server until ready.

    Returns:
        The URLs clients send requests to (the router's alone when the plan has one).

    """
    logger = get_run_logger()
    orphans = datagen.host.fleet_registry.cleanup_orphans(fleets_root, recursive=True)
    if orphans:
        logger.warning("stopped orphaned servers count=%d", orphans)
    fleet.start()
    logger.info("fleet ready servers=%d urls=%s", len(fleet.urls), ",".join(fleet.client_urls))
    return list(fleet.client_urls)


@task(name="stop-fleet", cache_policy=NO_CACHE)
def stop_fleet(fleet: Fleet) -> None:
    """Stop every server process group (idempotent)."""
    fleet.stop()
    get_run_logger().info("fleet stopped")
