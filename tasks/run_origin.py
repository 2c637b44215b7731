"""The Prefect side of a run's origin: read the flow run's own context, refuse what the box does not allow.

See :mod:`datagen.app.run_origin` for the rules. Called first in a deployed flow's body, before anything is
halted or started; a refusal ends the run Failed in one line, and it runs once (its retries are reset to the
deployment's before it fails, so Prefect does not start it again).
"""

from __future__ import annotations

from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext

from datagen.app.run_origin import RunOrigin, retries_problem, work_queue_problem
from datagen.config import RunConfig
from datagen.errors import RunOriginRefusedError


def read_run_origin(*, deployment: bool = True) -> RunOrigin | None:
    """The flow run's retries and work queue, and (``deployment``) its deployment's queue; None outside a run."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None or context.flow is None:
        return None
    flow_run = context.flow_run
    deployment_queue = None
    if deployment and flow_run.deployment_id is not None:
        with get_client(sync_client=True) as client:
            deployment_queue = client.read_deployment(flow_run.deployment_id).work_queue_name
    return RunOrigin(
        retries=flow_run.empirical_policy.retries,
        flow_retries=context.flow.retries or 0,
        work_queue=flow_run.work_queue_name,
        deployment_work_queue=deployment_queue,
    )


def refuse_caller_retries() -> None:
    """Refuse a run created with retries other than its deployment's, after resetting them.

    Reset first: a failed run with retries left is scheduled again by the server, and each attempt would
    halt training again.

    Raises:
        RunOriginRefusedError: Names ``empirical_policy.retries``.
    """
    context = FlowRunContext.get()
    origin = read_run_origin(deployment=False)
    if origin is None or context is None or context.flow_run is None:
        return
    problem = retries_problem(origin)
    if problem is None:
        return
    policy = context.flow_run.empirical_policy.model_copy(update={"retries": origin.flow_retries})
    with get_client(sync_client=True) as client:
        client.update_flow_run(context.flow_run.id, empirical_policy=policy)
    context.flow_run.empirical_policy = policy
    raise RunOriginRefusedError(f"Run refused, nothing started: {problem}")


def verify_work_queue(config: RunConfig, host: str | None = None) -> None:
    """Refuse a deployed run sent to a work queue its config does not allow (a host part: its host's queue).

    Raises:
        RunOriginRefusedError: Names ``work_queue_name`` and the queues allowed.
    """
    origin = read_run_origin()
    problem = work_queue_problem(origin, config, host) if origin is not None else None
    if problem is not None:
        raise RunOriginRefusedError(f"Run refused, nothing started: {problem}")
