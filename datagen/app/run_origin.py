"""Where a deployed run came from, beyond its parameters, and what the box allows of it.

A create-flow-run request carries more than parameters: the flow run's retries (Prefect's engine honours a
caller's ``empirical_policy.retries``, each retry halting training again) and the work queue it is sent to (any
queue of the pool, a made-up name creating one, so a box's worker polling every queue runs it). The flow reads
these from its own Prefect context (``tasks/run_origin.py``) and holds them to what the box allows here, before
anything is halted or started. Refusals name the field, never the value sent.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from datagen.config import RunConfig


class RunOrigin(BaseModel):
    """What a flow run was created with besides its parameters, and what its deployment says."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    retries: int | None = Field(description="The flow run's retries (its empirical policy).")
    flow_retries: int = Field(description="The flow's own retries: what its deployment runs with.")
    work_queue: str | None = Field(description="The work queue the flow run was sent to.")
    deployment_work_queue: str | None = Field(
        description="The work queue its deployment names; None for a run outside any deployment."
    )


def retries_problem(origin: RunOrigin) -> str | None:
    """Why the run's retries are not its deployment's, or None when they are."""
    if origin.retries is None or origin.retries == origin.flow_retries:
        return None
    return (
        "empirical_policy.retries: a run's retries are its deployment's (each retry would halt training "
        "again); start it without retries. A failed run resumes by its run id, once, when you choose"
    )


def allowed_work_queues(origin: RunOrigin, config: RunConfig, host: str | None = None) -> list[str]:
    """The work queues a run of ``config`` may run from.

    A host part's: its host's queue. Else ``run_choices.work_queues``, else the queue its deployment names.
    """
    if host is not None:
        return [config.host(host).work_queue]
    if config.run_choices.work_queues:
        return list(config.run_choices.work_queues)
    return [origin.deployment_work_queue] if origin.deployment_work_queue else []


def work_queue_problem(origin: RunOrigin, config: RunConfig, host: str | None = None) -> str | None:
    """Why the run may not run from its work queue, or None when it may (or it is no deployment's run)."""
    if origin.deployment_work_queue is None:
        return None
    allowed = allowed_work_queues(origin, config, host)
    if origin.work_queue in allowed:
        return None
    where = f"host {host}'s queue in hosts[].work_queue" if host is not None else "run_choices.work_queues"
    return (
        f"work_queue_name: this config runs only from work queue {', '.join(allowed)} ({where}, else the "
        "deployment's own): start the run without work_queue_name; the box's operator allows other queues "
        "in the config"
    )


__all__ = ["RunOrigin", "allowed_work_queues", "retries_problem", "work_queue_problem"]
