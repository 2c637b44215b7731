"""Several GPU boxes (``hosts:``, ``multi_host:``): one host part per box, its work queue and overrides."""

from __future__ import annotations

from typing import Annotated, Any, Final

from pydantic import Field

from datagen.config.base import Slug, StrictModel
from datagen.config.training import TrainingJobConfig
from datagen.config.ui_json import UI_MAPPING, UNWRAP_UI_JSON

# The deployment of the host part of a multi-host run (flows/host_part.py), as deployments/prefect.yaml names it.
HOST_DEPLOYMENT: Final = "expand-host/expand-host"
# Fleet keys a host may not change: the run's engine and served model decide the requests every server gets,
# and the run's one dispatcher is the router over every host's servers (see docs/architecture.md).
HOST_FIXED_FLEET_KEYS: Final = frozenset({"engine", "router", "router_policy", "router_port", "speculative"})


class HostConfig(StrictModel):
    """One GPU box of a multi-host run: the Prefect work queue its worker polls, and what differs there."""

    name: Slug = Field(description="The host's name in logs, store keys and the report (e.g. `box-1`).")
    work_queue: str = Field(
        min_length=1,
        description="Work queue (in the host deployment's pool) that only this box's worker polls; the host "
        "part of the run is sent there.",
    )
    deployment: str | None = Field(
        default=None,
        description="`flow/deployment` of the host part for this box; multi_host.deployment when unset.",
    )
    fleet: Annotated[dict[str, Any], UNWRAP_UI_JSON, UI_MAPPING] = Field(
        default={},
        description="Fleet keys that differ on this box (e.g. {host: 10.0.0.5, num_servers: 4}), over the run's "
        "`fleet`; engine, router and speculative stay the run's.",
    )
    training: TrainingJobConfig | None = Field(
        default=None, description="The training job to halt on this box; the run's `training` when unset."
    )


class MultiHostConfig(StrictModel):
    """How the parent flow drives the hosts of a multi-host run (no effect without `hosts`)."""

    deployment: str = Field(
        default=HOST_DEPLOYMENT, description="`flow/deployment` of the host part (flows/host_part.py)."
    )
    ready_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        description="How long the parent waits for a host's preflight and then for its fleet; a host later "
        "than this is left out of the run (and reported).",
    )
    host_lost_after_s: float = Field(
        default=60.0,
        gt=0,
        description="A host whose servers all stay down this long (or whose host flow run ends) is removed: "
        "its in-flight requests go to the other hosts and the report names it.",
    )
    poll_interval_s: float = Field(
        default=1.0, gt=0, description="How often hosts and the parent look for each other's markers."
    )
    parent_lease_s: float = Field(
        default=60.0,
        ge=60,
        description="Duration of the Prefect concurrency lease the parent holds (Prefect's minimum: 60 s). "
        "Prefect renews it every 0.75 x this; a parent killed outright stops renewing it, so it runs out "
        "0.25-1 x this after the kill, the server's repossessor frees it within its loop (15 s), and the hosts "
        "stop serving: 15-75 s after the kill at 60 s.",
    )
    max_serve_s: float = Field(
        default=7 * 24 * 3600.0,
        gt=0,
        description="The longest a host part serves: past it, it stops its servers and hands its GPUs back "
        "whatever the parent says (a parent that never releases it cannot keep a box's training halted).",
    )
    start_with_hosts: int = Field(
        default=1,
        gt=0,
        description="Generation starts once this many hosts serve (the others join as they come up); fewer "
        "only when the rest were lost first.",
    )
