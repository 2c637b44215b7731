"""One run id, one runner: the Prefect concurrency lease a run holds for as long as it runs.

Two flow runs of one run id (a second trigger while the first runs, two boxes on one S3 root, a resume
started too early) would each halt training and generate the same run: the second one is refused at once,
before anything is halted. The lease lives on the Prefect server, so it holds across the boxes that share it.
A runner killed outright stops renewing it: a runner on the same box frees it at once (its holder record,
:mod:`datagen.host.run_holder`, names a process that is gone); from another box it lapses within a lease and a
loop of the server's repossessor.

A run against the temporary server ``datagen run`` starts for itself holds no lease: that server keeps leases
in its memory and dies with the run, leaving the limit's slot taken in its database for the next run; on one
box the GPU lock and the manifest check after it keep a run id to one runner.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Final
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.concurrency._leases import maintain_concurrency_lease
from prefect.context import FlowRunContext
from prefect.exceptions import PrefectHTTPStatusError

from datagen.errors import RunLeaseHeldError
from datagen.host.run_holder import RunLeaseHolder, holder_path, read_holder, remove_holder, write_holder
from datagen.settings import get_settings
from tasks.runtime import ensure_limit

# Prefect's shortest lease: renewed every 0.75 x this, so a killed runner's lapses within it after the kill.
RUN_LEASE_S: Final = 60.0
# The server's answer when every slot of a limit is taken.
LOCKED: Final = 423
# Set (to its URL) by flows/api_server.py while a run uses its own temporary Prefect server.
TEMPORARY_API_ENV: Final = "DATAGEN_TEMPORARY_PREFECT_API"


def run_lease_name(run_id: str) -> str:
    """The Prefect global concurrency limit whose one slot the runner of ``run_id`` holds."""
    return f"datagen-run-{run_id}"


def _take(name: str) -> str | None:
    """One attempt at the limit's slot: the lease's id, or None while another holds it."""
    with get_client(sync_client=True) as client:
        try:
            response = client.increment_concurrency_slots_with_lease(
                names=[name], slots=1, mode="concurrency", lease_duration=RUN_LEASE_S
            )
        except PrefectHTTPStatusError as error:
            if error.response.status_code == LOCKED:
                return None
            raise
    return str(response.json()["lease_id"])


def _release(lease_id: str) -> None:
    with contextlib.suppress(Exception), get_client(sync_client=True) as client:
        client.release_concurrency_slots_with_lease(UUID(lease_id))


@contextlib.contextmanager
def hold_run_lease(run_id: str) -> Iterator[str | None]:
    """Hold run ``run_id``'s lease for the block; refuse the run when another live runner holds it.

    Yields:
        The lease's limit name; None on a temporary server (no lease).

    Raises:
        RunLeaseHeldError: Another runner holds the lease (names ``run_id`` and what to do).
    """
    if os.environ.get(TEMPORARY_API_ENV):
        yield None
        return
    name = run_lease_name(run_id)
    record = holder_path(get_settings().lock_dir, name)
    ensure_limit(name)
    lease_id = _take(name)
    if lease_id is None:
        holder = read_holder(record)
        if holder is not None and holder.is_gone():
            _release(holder.lease_id)  # that lease alone: a live runner's is never touched
            lease_id = _take(name)
    if lease_id is None:
        raise RunLeaseHeldError(
            f"Run refused, nothing started: run_id: run {run_id} is running in another flow run (it holds the "
            f"Prefect concurrency lease {name}); one run id has one runner. Wait for that run to end, then "
            "resume with this run id; a runner killed outright on another box frees it within two minutes (if "
            f"none is alive anywhere after a Prefect server restart: `prefect gcl delete {name}`)."
        )
    context = FlowRunContext.get()
    flow_run_id = str(context.flow_run.id) if context and context.flow_run else None
    write_holder(record, RunLeaseHolder.this_process(run_id, lease_id, flow_run_id))
    try:
        # Renewed in the background; an API outage mid-run is no reason to stop a run that holds the GPUs.
        with maintain_concurrency_lease(UUID(lease_id), RUN_LEASE_S, raise_on_lease_renewal_failure=False):
            yield name
    finally:
        remove_holder(record, lease_id)
        _release(lease_id)
        with contextlib.suppress(Exception), get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(name)
