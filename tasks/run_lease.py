"""One run id, one runner: the Prefect concurrency lease a run holds for as long as it runs.

Two flow runs of one run id (a second trigger while the first runs, two boxes on one S3 root, a resume
started too early) would each halt training and generate the same run: the second one is refused at once,
before anything is halted. The lease lives on the Prefect server, so it holds across boxes that share it; a
runner killed outright stops renewing it and Prefect's repossessor frees it within a lease and a loop of its.

A run against the temporary server ``datagen run`` starts for itself holds no lease: that server keeps
leases in its memory and dies with the run, leaving the limit's slot taken in its database for the next run
(docs/security.md); on one box the GPU lock and the manifest check after it keep a run id to one runner.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Final

from prefect.client.orchestration import get_client
from prefect.concurrency.sync import concurrency

from datagen.errors import RunLeaseHeldError
from tasks.runtime import ensure_limit

# Prefect's shortest lease: renewed every 0.75 x this, so a killed runner's lapses within it after the kill.
RUN_LEASE_S: Final = 60.0
# How long a run waits for a lease another runner holds before it is refused (a refusal, not a queue).
RUN_LEASE_WAIT_S: Final = 5.0
# Set (to its URL) by flows/api_server.py while a run uses its own temporary Prefect server.
TEMPORARY_API_ENV: Final = "DATAGEN_TEMPORARY_PREFECT_API"


def run_lease_name(run_id: str) -> str:
    """The Prefect global concurrency limit whose one slot the runner of ``run_id`` holds."""
    return f"datagen-run-{run_id}"


@contextlib.contextmanager
def hold_run_lease(run_id: str) -> Iterator[str | None]:
    """Hold run ``run_id``'s lease for the block; refuse the run when another runner holds it.

    Yields:
        The lease's limit name; None on a temporary server (no lease).

    Raises:
        RunLeaseHeldError: Another flow run holds the lease (names ``run_id`` and what to do).
    """
    if os.environ.get(TEMPORARY_API_ENV):
        yield None
        return
    name = run_lease_name(run_id)
    ensure_limit(name)
    acquired = False
    try:
        with concurrency(
            name,
            occupy=1,
            timeout_seconds=RUN_LEASE_WAIT_S,
            lease_duration=RUN_LEASE_S,
            strict=True,
            # An API outage mid-run is no reason to stop a run that already holds the GPUs.
            raise_on_lease_renewal_failure=False,
        ):
            acquired = True
            yield name
    except TimeoutError:
        if acquired:
            raise
        raise RunLeaseHeldError(
            f"Run refused, nothing started: run_id: run {run_id} is running in another flow run (it holds the "
            f"Prefect concurrency lease {name}); one run id has one runner. Wait for that run to end, then "
            "resume with this run id; a runner killed outright frees its lease within two minutes."
        ) from None
    finally:
        if acquired:
            with contextlib.suppress(Exception), get_client(sync_client=True) as client:
                client.delete_global_concurrency_limit_by_name(name)
