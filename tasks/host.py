"""Host tasks: halt the training job, probe the environment, plan and run the server fleet."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from datagen.config import RunConfig, TrainingJobConfig
from datagen.fleet import Fleet, cleanup_orphans
from datagen.plan import ServerPlan
from datagen.plan import plan_servers as plan_servers_for
from datagen.probe import EnvReport
from datagen.probe import probe_environment as probe_host
from datagen.training import HaltRecord
from datagen.training import halt_training as halt_training_job


@task(name="halt-training", task_run_name="halt-training-{training.kind}", cache_policy=NO_CACHE)
def halt_training(training: TrainingJobConfig) -> HaltRecord:
    """Stop the training job gracefully and record what was stopped (idempotent)."""
    record = halt_training_job(training)
    get_run_logger().info(
        "training halted kind=%s pid=%s already_gone=%s escalated=%s last_checkpoint=%s",
        record.kind,
        record.pid,
        record.already_gone,
        record.escalated,
        record.last_checkpoint,
    )
    return record


@task(name="probe-environment", cache_policy=NO_CACHE)
def probe_environment() -> EnvReport:
    """Probe GPUs, interconnect, drivers and packages; publish the report as an artifact."""
    report = probe_host()
    create_markdown_artifact(report.to_markdown(), key="environment", description="What this host offers")
    get_run_logger().info("probe gpus=%d problems=%d", len(report.gpus), len(report.problems))
    return report


@task(name="plan-servers", cache_policy=NO_CACHE)
def plan_servers(env: EnvReport, config: RunConfig, state_dir: Path) -> ServerPlan:
    """Decide the servers (DP/TP/CPU/external) and their exact argv; publish the plan as an artifact."""
    plan = plan_servers_for(env, config, state_dir)
    create_markdown_artifact(
        plan.to_markdown(), key="server-plan", description="Servers and their exact argv"
    )
    get_run_logger().info("plan mode=%s servers=%d engine=%s", plan.mode, len(plan.servers), plan.engine)
    return plan


@task(name="start-fleet", cache_policy=NO_CACHE)
def start_fleet(fleet: Fleet, fleets_root: Path) -> list[str]:
    """Stop servers orphaned by crashed earlier runs on this host, then start every server until ready."""
    logger = get_run_logger()
    orphans = cleanup_orphans(fleets_root, recursive=True)
    if orphans:
        logger.warning("stopped orphaned servers count=%d", orphans)
    fleet.start()
    logger.info("fleet ready servers=%d urls=%s", len(fleet.urls), ",".join(fleet.urls))
    return list(fleet.urls)


@task(name="stop-fleet", cache_policy=NO_CACHE)
def stop_fleet(fleet: Fleet) -> None:
    """Stop every server process group (idempotent)."""
    fleet.stop()
    get_run_logger().info("fleet stopped")
