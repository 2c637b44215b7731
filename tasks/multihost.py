"""The Prefect side of a multi-host run: check the hosts' work queues, start one host part per box, watch them.

Each box runs the `expand-host` deployment (flows/host_part.py) on its own worker, which polls only that box's work
queue; the parent starts one flow run per host with Prefect's ``run_deployment`` (a subflow run in the UI)
and never waits on it: the hosts and the parent meet in the run's store (:mod:`datagen.output.multihost`).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from uuid import UUID

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import FlowRun
from prefect.concurrency.sync import concurrency
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound

from datagen.app.run_request import HostRequest
from datagen.config import RunConfig
from datagen.errors import DatagenError, PreflightError
from tasks.runtime import ensure_limit

# A worker polls its queue every 10 s by default (PREFECT_WORKER_QUERY_SECONDS): a queue not polled for six
# times that has no worker behind it.
WORKER_STALE_S = 60.0
# Host parts started at once (API calls in flight together).
MAX_PARALLEL_STARTS = 16


def _deployment_of(config: RunConfig, host: str) -> str:
    return config.host(host).deployment or config.multi_host.deployment


@task(name="check-hosts", cache_policy=NO_CACHE)
def check_hosts(config: RunConfig) -> list[str]:
    """Every host's deployment exists, its work queue exists in that deployment's pool, and a worker polls it.

    Runs before any host part starts, so a misconfigured host refuses the run while every box still trains.

    Returns:
        One line per host: its deployment, pool, queue and when its worker last polled.

    Raises:
        PreflightError: One problem per bad host, each with the command that fixes it.
    """
    problems: list[str] = []
    lines: list[str] = []
    now = dt.datetime.now(dt.UTC)
    with get_client(sync_client=True) as client:
        pools: dict[str, str | None] = {}
        for host in config.hosts:
            name = _deployment_of(config, host.name)
            if name not in pools:
                try:
                    pools[name] = client.read_deployment_by_name(name).work_pool_name
                except ObjectNotFound:
                    pools[name] = None
            pool = pools[name]
            if pool is None:
                problems.append(
                    f"host {host.name}: deployment {name!r} does not exist: deploy it with `datagen deploy` "
                    "(deployments/prefect.yaml has expand-host), or fix multi_host.deployment"
                )
                continue
            try:
                queue = client.read_work_queue_by_name(host.work_queue, work_pool_name=pool)
            except ObjectNotFound:
                problems.append(
                    f"host {host.name}: work queue {host.work_queue!r} does not exist in pool {pool!r}: create "
                    f"it (`prefect work-queue create {host.work_queue} --pool {pool}`) and start the box's "
                    f"worker with `prefect worker start --pool {pool} --work-queue {host.work_queue}`, or fix "
                    f"hosts[{host.name}].work_queue"
                )
                continue
            polled = queue.last_polled
            if polled is not None and polled.tzinfo is None:
                polled = polled.replace(tzinfo=dt.UTC)
            age_s = (now - polled).total_seconds() if polled is not None else None
            if age_s is None or age_s > WORKER_STALE_S:
                seen = "never" if age_s is None else f"{age_s:.0f}s ago"
                problems.append(
                    f"host {host.name} unreachable: no worker polls work queue {host.work_queue!r} of pool "
                    f"{pool!r} (last poll: {seen}): start `prefect worker start --pool {pool} --work-queue "
                    f"{host.work_queue}` on that box"
                )
                continue
            lines.append(
                f"host {host.name}: deployment {name}, pool {pool}, queue {host.work_queue}, "
                f"worker polled {age_s:.0f}s ago"
            )
    if problems:
        raise PreflightError(problems)
    logger = get_run_logger()
    for line in lines:
        logger.info("preflight %s", line)
    return lines


def _start_host_part(
    config: RunConfig, request: HostRequest, host: str, attempt_id: str, parent_flow_run_id: str | None
) -> str:
    entry = config.host(host)
    flow_run = run_deployment(  # a sync call outside an event loop returns the FlowRun itself
        _deployment_of(config, host),
        parameters={
            **request.model_dump(mode="json", exclude_none=True),
            "host": host,
            "attempt_id": attempt_id,
            "parent_flow_run_id": parent_flow_run_id,
        },
        flow_run_name=f"expand-host-{config.run_id}-{host}",
        work_queue_name=entry.work_queue,
        timeout=0,
    )
    assert isinstance(flow_run, FlowRun)
    return str(flow_run.id)


def start_host_parts(
    config: RunConfig, request: HostRequest, attempt_id: str, parent_flow_run_id: str | None
) -> dict[str, str]:
    """Start one `expand-host` flow run per host on its work queue, all at once, without waiting for any.

    Each is sent ``request`` (the box config's name and the run's choices), never the config itself.

    Each start is a few API calls (a second or more on a loaded server): made in parallel, so the last
    box does not start many seconds after the first.

    Returns:
        Host name -> its host flow run id.
    """
    logger = get_run_logger()
    names = [host.name for host in config.hosts]
    with ThreadPoolExecutor(max_workers=min(len(names), MAX_PARALLEL_STARTS)) as pool:
        # Each call runs in a copy of this flow run's context, so Prefect links it as a subflow run.
        futures = [
            pool.submit(
                contextvars.copy_context().run,
                _start_host_part,
                config,
                request,
                name,
                attempt_id,
                parent_flow_run_id,
            )
            for name in names
        ]
        started = {name: future.result() for name, future in zip(names, futures, strict=True)}
    for name, flow_run_id in started.items():
        logger.info(
            "host part started host=%s work_queue=%s flow_run=%s",
            name,
            config.host(name).work_queue,
            flow_run_id,
        )
    return started


def ended_flow_runs(flow_run_ids: dict[str, str]) -> dict[str, str]:
    """The entries of ``flow_run_ids`` (name -> flow run id) whose flow run is in a final state -> that state."""
    if not flow_run_ids:
        return {}
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[UUID(flow_run_id) for flow_run_id in flow_run_ids.values()])
            )
        )
    by_id = {str(run.id): run for run in runs}
    ended: dict[str, str] = {}
    for name, flow_run_id in flow_run_ids.items():
        run = by_id.get(flow_run_id)
        if run is not None and run.state is not None and run.state.is_final():
            ended[name] = run.state.name or run.state.type.value
    return ended


def flow_run_ended(flow_run_id: str | None) -> str | None:
    """The final state's name of a flow run, None while it runs (or when there is none to ask about)."""
    if not flow_run_id:
        return None
    try:
        return ended_flow_runs({"run": flow_run_id}).get("run")
    except Exception:  # the API being briefly unreachable is no reason to stop serving
        return None


def parent_lease_name(run_id: str) -> str:
    """The Prefect global concurrency limit the parent of run ``run_id`` holds a slot of."""
    return f"datagen-parent-{run_id}"


@contextlib.contextmanager
def hold_parent_lease(run_id: str, lease_s: float) -> Iterator[str]:
    """Hold the run's parent lease for the block: the hosts serve while it is held.

    Prefect renews the lease in the background; a parent killed outright (SIGKILL, a lost box) stops
    renewing it, Prefect's repossessor revokes it, and the hosts see the slot free and stop serving. Its
    flow run, which nothing can end, stays "Running" in the UI. The limit is deleted when the block ends.

    Args:
        run_id: The run.
        lease_s: Lease duration (``multi_host.parent_lease_s``).

    Yields:
        The limit's name.

    Raises:
        DatagenError: Another parent of this run holds the lease (still running, or killed less than a lease
            ago) for longer than four leases.

    """
    name = parent_lease_name(run_id)
    ensure_limit(name)
    acquired = False
    try:
        with concurrency(
            name, occupy=1, timeout_seconds=4 * lease_s + 30, lease_duration=lease_s, strict=True
        ):
            acquired = True
            yield name
    except TimeoutError:
        if acquired:
            raise
        raise DatagenError(
            f"Another parent of run {run_id} holds its lease ({name!r}): it is still running. Cancel it in the "
            "Prefect UI, or resume this run when it has ended."
        ) from None
    finally:
        if acquired:
            with contextlib.suppress(Exception), get_client(sync_client=True) as client:
                client.delete_global_concurrency_limit_by_name(name)


def parent_lease_lapsed(run_id: str) -> bool:
    """Whether the run's parent lease is no longer held (its parent ended or was killed); False if unknown."""
    try:
        with get_client(sync_client=True) as client:
            limit = client.read_global_concurrency_limit_by_name(parent_lease_name(run_id))
    except ObjectNotFound:
        return True  # deleted by its parent on the way out (the hosts are released by then)
    except Exception:  # the API being briefly unreachable is no reason to stop serving
        return False
    return limit.active_slots == 0
