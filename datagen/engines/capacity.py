"""The dispatcher's in-flight cap per server: decided here, once, for every engine and host.

Three inputs, in this order of precedence (each decision comes with its reason line for the plan):

1. a ``datagen tune`` measurement (``fleet.tune_result``): the count that saturated a live fleet;
2. ``fleet.max_inflight_per_server`` set explicitly in the config: the operator's number;
3. the engine's own sizing (:meth:`datagen.engines.base.Engine.plan_capacity`: for SGLang its running slots
   plus a refill margin); without one (CPU servers, servers someone else runs) the configured default.

The planner (:func:`datagen.host.plan.plan_servers`) calls :func:`decide_inflight_cap` for every server
and stores the answer in the plan (``ServerSpec.max_inflight``); the flows read it from the plan
(``ServerPlan.dispatcher_inflight``) and never pass a cap of their own (``tests/unit/test_inflight_owner.py``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from datagen.engines.base import CapacityPlan
from datagen.engines.sglang_tuning import CUDA_GRAPH_MAX_BS_CAP
from datagen.engines.tune_result import TuneResult

InflightSource = Literal["tuned", "config", "engine"]
RUNNING_REQUESTS_FLAG = "--max-running-requests"


class InflightCap(BaseModel):
    """The decided cap of one server, where it came from, and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    per_server: int = Field(gt=0, description="Requests the dispatcher keeps in flight on the server.")
    source: InflightSource
    reasons: list[str] = Field(default_factory=list, description="Lines for the plan's reasons, in order.")


def tuned_reason(tuned: TuneResult) -> str:
    """The plan's line for a tune measurement."""
    return (
        f"in flight per server: {tuned.best_inflight_per_server}, measured by datagen tune "
        f"({tuned.best_output_tokens_per_s:.0f} output tok/s, fleet.tune_result)"
        + (f"; {tuned.setting_flag} {tuned.best_setting}" if tuned.setting_flag else "")
    )


def decide_inflight_cap(
    engine: CapacityPlan | None, *, configured: int, explicit: bool, tuned: TuneResult | None
) -> InflightCap:
    """Decide the dispatcher's in-flight cap of one server (see the module docstring for the order).

    Args:
        engine: The engine's sizing of the server; None when the engine sized nothing (CPU servers,
            external servers).
        configured: ``fleet.max_inflight_per_server`` (its default when not set).
        explicit: Whether ``fleet.max_inflight_per_server`` was set in the config.
        tuned: The ``datagen tune`` result, None without ``fleet.tune_result``.

    Returns:
        The cap, its source and the reason lines (the engine's own line first when the engine sized it).

    """
    engine_lines = [engine.inflight_reason] if engine is not None and engine.inflight_reason else []
    if tuned is not None:
        return InflightCap(
            per_server=tuned.best_inflight_per_server,
            source="tuned",
            reasons=[*engine_lines, tuned_reason(tuned)],
        )
    if explicit:
        return InflightCap(
            per_server=configured,
            source="config",
            reasons=[
                *engine_lines,
                f"in flight per server: {configured} (fleet.max_inflight_per_server is set, so it wins over the "
                "engine's derived cap)",
            ],
        )
    if engine is not None:
        return InflightCap(per_server=engine.max_inflight, source="engine", reasons=engine_lines)
    return InflightCap(
        per_server=configured,
        source="config",
        reasons=[f"in flight per server: {configured} (fleet.max_inflight_per_server)"],
    )


def tuned_slot_fields(fields: dict[str, Any], tuned: TuneResult | None) -> dict[str, Any]:
    """The engine's slot fields with a measured ``--max-running-requests`` (and its CUDA-graph batch) applied."""
    if tuned is None or tuned.setting_flag != RUNNING_REQUESTS_FLAG or not tuned.best_setting:
        return fields
    updated = {**fields, "max_running_requests": tuned.best_setting}
    if updated.get("cuda_graph_max_bs"):
        updated["cuda_graph_max_bs"] = min(tuned.best_setting, CUDA_GRAPH_MAX_BS_CAP)
    return updated


def per_client_url(server_caps: list[int], *, router: bool) -> int:
    """The dispatcher's cap per URL it talks to: the smallest server's, or all of them behind a router."""
    if not server_caps:
        raise ValueError("no planned in-flight cap: plan the servers with datagen.host.plan.plan_servers")
    return min(server_caps) * len(server_caps) if router else min(server_caps)
