"""Server plans for tests that launch their own small servers through a real :class:`datagen.host.fleet.Fleet`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from datagen.config import EngineKind
from datagen.engines.base import LaunchCommand
from datagen.host.plan import PlanMode, ServerPlan, ServerSpec


def local_plan(
    tmp_path: Path,
    ports: list[int],
    argv_for_port: Callable[[int], list[str]],
    *,
    engine: EngineKind = "transformers",
    mode: PlanMode = "cpu",
    env: dict[str, str] | None = None,
) -> ServerPlan:
    """One loopback server per port, launched with ``argv_for_port(port)``, logging under ``tmp_path/logs``."""
    servers = [
        ServerSpec(
            index=index,
            host="127.0.0.1",
            port=port,
            url=f"http://127.0.0.1:{port}",
            log_path=str(tmp_path / "logs" / f"server-{index:02d}.log"),
            launch=LaunchCommand(argv=argv_for_port(port), env=env or {}),
        )
        for index, port in enumerate(ports)
    ]
    return ServerPlan(engine=engine, mode=mode, servers=servers, served_model_name="none")
