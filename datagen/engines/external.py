"""Attach to servers someone else runs (an SGLang router, a shared endpoint): no process is started."""

from __future__ import annotations

from datagen.config import FleetConfig, ModelConfig
from datagen.engines.base import EngineRecipe, LaunchCommand, ServerSlot


class ExternalEngine(EngineRecipe):
    """The engine of ``fleet.external_urls``: readiness is probed, nothing is launched or stopped.

    Nothing to install (reachability is checked when the fleet starts), nothing runs here to report on,
    and the servers' own configuration decides whether they require the API key.
    """

    name = "external"
    # Unknown server software: no metrics (asked only where the engine is known to serve them), and
    # exact-token mode only when the user says the servers serve /generate
    # (generation.exact_tokens: true, e.g. SGLang or its router).
    allows_exact_tokens = True
    launches_processes = False

    def build_launch(self, slot: ServerSlot, model: ModelConfig, fleet: FleetConfig) -> LaunchCommand:
        """Never called for external servers.

        Raises:
            TypeError: Always; external servers have no launch command.

        """
        raise TypeError("engine 'external' starts no process; the plan lists fleet.external_urls instead")
