"""The `expand-host` flow: one box's part of a multi-host run, on that box's own Prefect worker.

The parent `expand` flow starts one run of this flow per host (``run_deployment``, one work queue per box)
and talks to it through the run's store (:mod:`datagen.output.multihost`)::

    parent check (a running expand run that lists this host part in started.json)
      -> host preflight -> preflight.json ... wait for go.json (every host passed)
      -> [host GPU lock] halt-training -> probe-environment -> plan-servers -> start-fleet -> fleet.json
      -> keep the servers up (restarting dead ones, each restart published as fleet-NNNN.json) until
         release.json (or the parent's run ended, or multi_host.max_serve_s passed)
      -> stop-fleet -> hand-back-gpus

Generation itself happens in the parent: its one dispatcher sends requests to every host's servers.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import cast

from prefect import get_run_logger
from prefect.context import FlowRunContext
from pydantic import BaseModel

import datagen.app.preflight
from datagen.app.run_request import HostPartRequest, SamplingChoice, checked_request, resolve_request
from datagen.config import RunConfig, is_valid_slug
from datagen.errors import PreflightError
from datagen.output.layout import RunLayout
from datagen.output.multihost import (
    FleetPublisher,
    HostFleet,
    HostPreflight,
    HostsGo,
    HostsRelease,
    wait_for_host_object,
    write_host_object,
)
from datagen.output.store import Store
from flows.checked_flow import CheckedFlow, box_configs
from flows.serving import fleet_state_dir, serve_on_this_box, stop_servers_hook
from tasks.cancellation import run_cancellable
from tasks.context import open_run_store
from tasks.host_parent import verify_parent
from tasks.multihost import flow_run_ended, parent_lease_lapsed
from tasks.run_origin import refuse_caller_retries, verify_work_queue
from tasks.runtime import explain_failure, forward_thread_logs, hold_host_gpus, verify_code_version


def _host_flow_run_name() -> str:
    from prefect.runtime import flow_run

    parameters = dict(flow_run.parameters or {})
    run_id, host = parameters.get("run_id"), parameters.get("host")
    if not (
        isinstance(run_id, str) and is_valid_slug(run_id) and isinstance(host, str) and is_valid_slug(host)
    ):
        return "expand-host"  # refused before it starts: the name needs no error
    return f"expand-host-{run_id}-{host}"


def _expand_host(
    config: str,
    run_id: str,
    host: str,
    attempt_id: str,
    parent_flow_run_id: str,
    max_prompts: int | None = None,
    series: str | None = None,
    output: str | None = None,
    sampling: SamplingChoice | None = None,
    datasets: list[str] | None = None,
) -> str:
    """Serve the target on this box's GPUs for one attempt of a multi-host run.

    This box resolves the run's config from its own checkout by name, with the run's choices; the parent
    sends nothing else.

    Args:
        config: Name of the run's config: configs/<name>.yaml in this box's checkout.
        run_id: The run's id (resolved by the parent).
        host: This box's name in the config's `hosts`.
        attempt_id: The parent attempt this host part belongs to (its handshake folder).
        parent_flow_run_id: The parent `expand` flow run that started this host part: it serves only a
            running parent that lists it, and stops when that parent ends.
        max_prompts: The run's choice (see the expand flow).
        series: The run's choice (see the expand flow).
        output: The run's output root (under a root this box's config allows).
        sampling: The run's choice (see the expand flow).
        datasets: The run's choice (see the expand flow).

    Returns:
        What this host did, in one line.
    """
    context = FlowRunContext.get()
    flow_run_id = str(context.flow_run.id) if context and context.flow_run else "local"
    parameters = {
        "config": config,
        "run_id": run_id,
        "host": host,
        "attempt_id": attempt_id,
        "parent_flow_run_id": parent_flow_run_id,
        "max_prompts": max_prompts,
        "series": series,
        "output": output,
        "sampling": sampling,
        "datasets": datasets,
    }

    def body() -> str:
        refuse_caller_retries()  # first: a refusal after it must not be run again
        request = checked_request(config, parameters, box_configs(), HostPartRequest)
        verify_code_version(__file__)
        resolved = resolve_request(request.run_request(), box_configs(), resume=False)
        verify_work_queue(resolved, request.host)
        # Before this box writes or halts anything: a host part serves only the parent that started it.
        verify_parent(request, resolved, flow_run_id)
        return _serve(
            resolved, request.host, request.attempt_id, str(request.parent_flow_run_id), flow_run_id
        )

    with forward_thread_logs(flow_run_id), explain_failure():
        return cast(str, run_cancellable(body))


expand_host = CheckedFlow(
    fn=_expand_host,
    request_model=HostPartRequest,
    name="expand-host",
    flow_run_name=_host_flow_run_name,
    on_cancellation=[stop_servers_hook],
    on_crashed=[stop_servers_hook],
    validate_parameters=True,
)


def _serve(config: RunConfig, host: str, attempt_id: str, parent: str, flow_run_id: str) -> str:
    logger = get_run_logger()
    assert config.run_id is not None, "the parent resolves the run id before starting host parts"
    local = config.for_host(host)
    # With the Prefect block's S3 credentials (None: the AWS chain): this box meets the parent in the run's store.
    store = open_run_store(config)
    layout = RunLayout(config.run_id)
    poll_s = config.multi_host.poll_interval_s
    hostname = socket.gethostname()

    problems: list[str] = []
    try:
        datagen.app.preflight.run_host_preflight(local, store.credentials)
    except PreflightError as error:
        problems = error.problems
    write_host_object(
        store,
        layout,
        attempt_id,
        HostPreflight(host=host, flow_run_id=flow_run_id, hostname=hostname, problems=problems),
        host=host,
    )
    if problems:
        raise PreflightError([f"host {host}: {problem}" for problem in problems])
    logger.info("host preflight passed host=%s hostname=%s; waiting for the other hosts", host, hostname)

    def parent_ended() -> str | None:
        state = flow_run_ended(parent)
        if state:
            return f"the parent flow run ended ({state})"
        if config.run_id is not None and parent_lease_lapsed(config.run_id):
            return "the parent's lease lapsed: its process died without ending its flow run"
        return None

    go = wait_for_host_object(
        store,
        layout,
        attempt_id,
        HostsGo,
        poll_s=poll_s,
        timeout_s=config.multi_host.ready_timeout_s,
        give_up=parent_ended,
    )
    if not isinstance(go, HostsGo) or not go.go:
        reason = go if isinstance(go, str) else go.reason
        logger.warning("host part not started host=%s reason=%s; nothing was halted", host, reason)
        return f"host {host}: nothing halted ({reason})"

    state_dir = fleet_state_dir(flow_run_id)

    def record(name: str, value: BaseModel) -> None:
        _record(store, layout, attempt_id, f"host-{host}-{name}", value)

    def record_restart(name: str, value: BaseModel) -> None:
        # The GPUs are already handed back: a store that fails now must not hide how the part ended.
        with contextlib.suppress(Exception):
            record(name, value)

    with (
        hold_host_gpus(layout.run_id) as gpus,
        serve_on_this_box(local, gpus, layout.run_id, state_dir, record, record_restart) as serving,
    ):
        published = HostFleet(
            host=host,
            flow_run_id=flow_run_id,
            hostname=hostname,
            pid=os.getpid(),
            urls=serving.urls,
            max_inflight_per_server=serving.plan.dispatcher_inflight,
            served_model_name=serving.plan.served_model_name,
            launched=any(server.launch is not None for server in serving.plan.servers),
        )
        publisher = FleetPublisher(store, layout, attempt_id, published)
        publisher.publish()
        # Each restart (maybe on another port) is a new version of fleet.json: the parent's dispatcher follows.
        serving.fleet.on_server_restarted(publisher.server_restarted)
        logger.info("host serving host=%s servers=%d; until the parent releases it", host, len(serving.urls))
        started = time.monotonic()
        released = wait_for_host_object(
            store,
            layout,
            attempt_id,
            HostsRelease,
            poll_s=poll_s,
            timeout_s=config.multi_host.max_serve_s,
            give_up=parent_ended,
        )
        why = released if isinstance(released, str) else released.reason
        logger.info("host released host=%s after_s=%.0f reason=%s", host, time.monotonic() - started, why)
    return f"host {host}: served {len(serving.urls)} server(s) ({why})"


def _record(store: Store, layout: RunLayout, attempt_id: str, name: str, value: BaseModel) -> None:
    """Store one record of this host part under the parent attempt's folder (``host-<name>-<what>.json``)."""
    store.write_json(layout.attempt_object(attempt_id, f"{name}.json"), value)
