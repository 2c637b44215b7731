"""The Prefect side of a host part's parent check (the rules: :mod:`datagen.app.host_parent`)."""

from __future__ import annotations

from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound

from datagen.app.host_parent import ParentRun, parent_problem, started_problem
from datagen.app.run_request import HostPartRequest
from datagen.config import RunConfig
from datagen.errors import RunOriginRefusedError
from datagen.output.layout import RunLayout
from datagen.output.multihost import HostsStarted, wait_for_host_object
from tasks.context import open_run_store
from tasks.multihost import flow_run_ended

# The parent lists its host parts as soon as it created them all (seconds; a minute on a loaded server): a host
# part waits this long for the list at most (less with a shorter multi_host.ready_timeout_s).
PARENT_LIST_WAIT_S = 300.0


def read_parent_run(flow_run_id: UUID) -> ParentRun | None:
    """The flow run ``flow_run_id`` as the parent check reads it; None when the API has no such run."""
    with get_client(sync_client=True) as client:
        try:
            run = client.read_flow_run(flow_run_id)
            flow = client.read_flow(run.flow_id)
        except ObjectNotFound:
            return None
    return ParentRun(
        flow_name=flow.name,
        running=run.state is not None and run.state.is_running(),
        parameters=dict(run.parameters or {}),
    )


def verify_parent(request: HostPartRequest, config: RunConfig, flow_run_id: str) -> None:
    """Refuse a host part that no running `expand` run of its config and run id started.

    Waits (at most :data:`PARENT_LIST_WAIT_S`, less when the parent ends) for the parent to list its host parts:
    it writes the list once every one was created.

    Raises:
        RunOriginRefusedError: Names ``parent_flow_run_id`` (or the choice that differs from the parent's).
    """
    assert config.run_id is not None, "the parent resolves the run id"
    parent = str(request.parent_flow_run_id)
    problem = parent_problem(
        read_parent_run(request.parent_flow_run_id), config=request.config, run_id=config.run_id
    )
    if problem is None:
        started = wait_for_host_object(
            open_run_store(config),
            RunLayout(config.run_id),
            request.attempt_id,
            HostsStarted,
            poll_s=config.multi_host.poll_interval_s,
            timeout_s=min(PARENT_LIST_WAIT_S, config.multi_host.ready_timeout_s),
            give_up=lambda: flow_run_ended(parent),
        )
        problem = started_problem(started, parent=parent, host=request.host, flow_run_id=flow_run_id)
    if problem is not None:
        raise RunOriginRefusedError(f"Run refused, nothing started: {problem}")
