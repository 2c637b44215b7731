"""sglang-router (``fleet.router``): its argv and whether it can run here.

The router is one more process in front of the planned servers; the dispatcher then talks to it only, so
its in-flight cap carries every server's share (:func:`datagen.engines.capacity.per_client_url`).
"""

from __future__ import annotations

import sys

from datagen.config import FleetConfig
from datagen.engines.base import LaunchCommand, module_importable

ROUTER_MODULE = "sglang_router"
ROUTER_PACKAGE = "sglang-router"
ROUTER_INSTALL_HINT = "pip install sglang-router (the `gpu` extra installs it with sglang)"


def router_problems(fleet: FleetConfig) -> list[str]:
    """Why ``fleet.router`` cannot work here (for preflight); empty when it can or is off."""
    if not fleet.router:
        return []
    if not module_importable(ROUTER_MODULE):
        return [
            f"fleet.router is on but sglang-router is not installed in {sys.executable}: {ROUTER_INSTALL_HINT}"
        ]
    return []


def router_launch(worker_urls: list[str], host: str, port: int, policy: str) -> LaunchCommand:
    """The argv of ``python -m sglang_router.launch_router`` in front of ``worker_urls``."""
    return LaunchCommand(
        argv=[
            sys.executable,
            "-m",
            f"{ROUTER_MODULE}.launch_router",
            "--worker-urls",
            *worker_urls,
            "--host",
            host,
            "--port",
            str(port),
            "--policy",
            policy,
        ]
    )
