"""Attach to servers someone else runs (an SGLang router, a shared endpoint): no process is started."""

from __future__ import annotations

from collections.abc import Mapping

from datagen.config import FleetConfig, ModelConfig
from datagen.engines.base import (
    CapacityPlan,
    CapacityRequest,
    EngineProblem,
    LaunchCommand,
    ServerSlot,
    compile_patterns,
)


class ExternalEngine:
    """The engine of ``fleet.external_urls``: readiness is probed, nothing is launched or stopped."""

    name = "external"
    health_path = "/health"
    # Unknown server software: ask for metrics only where the engine is known to serve them.
    metrics_path: str | None = None
    unsupported_sampling_fields: frozenset[str] = frozenset()
    # Unknown server software: exact-token mode only when the user says the servers serve /generate
    # (generation.exact_tokens: true, e.g. SGLang or its router).
    supports_generate = False
    allows_exact_tokens = True
    fatal_log_patterns = compile_patterns(())
    supports_tensor_parallel = False
    launches_processes = False

    def check_available(self) -> list[str]:
        """Nothing to install: reachability is checked when the fleet starts."""
        return []

    def build_launch(self, slot: ServerSlot, model: ModelConfig, fleet: FleetConfig) -> LaunchCommand:
        """Never called for external servers.

        Raises:
            TypeError: Always; external servers have no launch command.

        """
        raise TypeError("engine 'external' starts no process; the plan lists fleet.external_urls instead")

    def served_model_name(self, model: ModelConfig) -> str:
        """The configured served name, else the model path."""
        return model.served_name or model.path

    def api_key_args(self, key_file: str) -> None:
        """Servers someone else runs: their own configuration decides whether they require the key."""
        return None

    def plan_capacity(self, request: CapacityRequest, fleet: FleetConfig) -> CapacityPlan:
        """Someone else sized the servers: the dispatcher keeps ``fleet.max_inflight_per_server``."""
        return CapacityPlan(
            max_inflight=request.configured_inflight,
            inflight_reason=f"in flight per server: {request.configured_inflight} (fleet.max_inflight_per_server)",
        )

    def host_problems(
        self, packages: Mapping[str, str | None], compute_capabilities: list[str]
    ) -> list[EngineProblem]:
        """Nothing runs here: no problems."""
        return []
