"""Decide which servers to start, where, and with which exact argv: :class:`ServerPlan`.

The plan is pure data (pydantic) so it can be shown as an artifact, stored as ``plan.json`` and handed to
:class:`datagen.fleet.Fleet`. Every decision appends a line to ``reasons`` so an operator can see why
the fleet looks the way it does.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from datagen.config import EngineKind, RunConfig
from datagen.engines import Engine, LaunchCommand, ServerSlot, get_engine
from datagen.errors import PlanError
from datagen.probe import EnvReport

logger = logging.getLogger(__name__)

PlanMode = Literal["dp", "tp", "cpu", "external"]
LOG_DIR_NAME = "logs"
# How far past a busy port the planner looks for a free one before giving up.
MAX_PORT_PROBES = 200
# Share of the host's free RAM that all CPU servers' KV caches may take together (the rest is for the
# models, the flow, and everything else on a laptop or CI box).
CPU_CACHE_MEMORY_FRACTION = 0.3
# Addresses that mean "every interface" are not connectable; clients use loopback instead.
WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


class ServerSpec(BaseModel):
    """One planned server: where it listens, which GPUs it owns, how to start it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0)
    host: str
    port: int = Field(gt=0, lt=65536)
    gpu_ids: list[int] = Field(default_factory=list)
    url: str = Field(description="Base URL clients use, e.g. http://127.0.0.1:30000 (no /v1).")
    log_path: str | None = Field(default=None, description="File receiving the server's stdout and stderr.")
    launch: LaunchCommand | None = Field(default=None, description="None for external servers.")


class ServerPlan(BaseModel):
    """The whole fleet as planned: engine, mode, servers, and the reasons behind each choice."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineKind
    mode: PlanMode
    servers: list[ServerSpec] = Field(min_length=1)
    reasons: list[str] = Field(default_factory=list)
    health_path: str = "/health"
    served_model_name: str = Field(description="Model name to send in requests.")

    @property
    def urls(self) -> list[str]:
        """Base URLs of every server, in index order."""
        return [server.url for server in self.servers]

    def to_markdown(self) -> str:
        """The plan as an artifact: mode, reasons, and the exact command of every server."""
        lines = [
            f"# Server plan: {len(self.servers)} x {self.engine} ({self.mode})",
            "",
            f"Model name in requests: `{self.served_model_name}`; readiness: `GET {self.health_path}`",
            "",
            "## Why",
            "",
            *[f"- {reason}" for reason in self.reasons],
            "",
            "## Servers",
            "",
        ]
        for server in self.servers:
            gpus = ",".join(str(gpu) for gpu in server.gpu_ids) or "none"
            lines.append(f"### server {server.index}: {server.url} (GPUs: {gpus})")
            lines.append("")
            if server.launch is not None:
                lines += ["```bash", server.launch.shell_line(), "```"]
            else:
                lines.append("external: not started by datagen")
            if server.log_path:
                lines.append(f"log: `{server.log_path}`")
            lines.append("")
        return "\n".join(lines)


def port_is_free(host: str, port: int) -> bool:
    """Tell whether a server could bind ``host:port`` now.

    Args:
        host: Interface address.
        port: TCP port.

    Returns:
        True when a bind succeeds (the socket is closed again at once).

    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # Servers set SO_REUSEADDR too, so a port in TIME_WAIT counts as free, as it is for them.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def choose_ports(host: str, base_port: int, count: int, reasons: list[str]) -> list[int]:
    """Pick ``count`` free ports from ``base_port`` upwards, recording every skipped port in ``reasons``.

    Raises:
        PlanError: Not enough free ports within :data:`MAX_PORT_PROBES` of ``base_port``.

    """
    ports: list[int] = []
    candidate = base_port
    while len(ports) < count:
        if candidate >= base_port + MAX_PORT_PROBES or candidate > 65535:
            raise PlanError(
                f"found only {len(ports)} of {count} free ports on {host} in "
                f"{base_port}-{candidate - 1}; free some ports or set fleet.base_port elsewhere",
                host=host,
                base_port=base_port,
            )
        if port_is_free(host, candidate):
            ports.append(candidate)
        else:
            reasons.append(f"port {candidate} on {host} is in use: skipped")
        candidate += 1
    return ports


def client_url(host: str, port: int) -> str:
    """The base URL clients use for a server bound to ``host:port``."""
    connect_host = "127.0.0.1" if host in WILDCARD_HOSTS else host
    if ":" in connect_host:
        connect_host = f"[{connect_host}]"
    return f"http://{connect_host}:{port}"


def plan_servers(
    env: EnvReport, config: RunConfig, state_dir: Path, *, engine: Engine | None = None
) -> ServerPlan:
    """Plan the fleet for this host and config.

    No GPUs (or ``fleet.device: cpu``): ``fleet.cpu_servers`` CPU servers. GPUs: one server per GPU
    (data parallel), or tensor-parallel groups of ``fleet.tensor_parallel`` GPUs kept inside NVLink
    islands when the topology is known. ``fleet.num_servers`` overrides the CPU count and caps the GPU
    count. ``external``: the configured URLs, nothing to start.

    Args:
        env: The probed environment.
        config: The run config.
        state_dir: Host-local state folder; server logs go to ``<state_dir>/logs``.
        engine: The launch recipe; ``get_engine(config.fleet.engine)`` when None.

    Returns:
        The plan.

    Raises:
        PlanError: The config asks for something this host cannot give (CUDA without GPUs, tensor
            parallelism with an engine that has none, no free ports).

    """
    fleet = config.fleet
    recipe = engine or get_engine(fleet.engine)
    reasons: list[str] = []
    served_name = recipe.served_model_name(config.model)
    if not recipe.launches_processes:
        servers = [
            ServerSpec(index=index, host=_url_host(url), port=_url_port(url), url=url.rstrip("/"))
            for index, url in enumerate(fleet.external_urls)
        ]
        reasons.append(f"engine {recipe.name}: {len(servers)} server(s) already running, nothing to start")
        return ServerPlan(
            engine=fleet.engine,
            mode="external",
            servers=servers,
            reasons=reasons,
            health_path=recipe.health_path,
            served_model_name=served_name,
        )

    groups, mode = _gpu_groups(env, config, recipe, reasons)
    compute_caps = {gpu.index: gpu.compute_capability for gpu in env.gpus}
    if mode == "cpu":
        count = fleet.num_servers or fleet.cpu_servers
        groups = [[] for _ in range(count)]
    ports = choose_ports(fleet.host, fleet.base_port, len(groups), reasons)
    cpu_threads = max(1, (os.cpu_count() or 1) // len(groups)) if mode == "cpu" else None
    cache_fraction = round(CPU_CACHE_MEMORY_FRACTION / len(groups), 4) if mode == "cpu" else None
    if cpu_threads is not None:
        reasons.append(
            f"{len(groups)} CPU server(s) share {os.cpu_count()} cores and "
            f"{CPU_CACHE_MEMORY_FRACTION:.0%} of free RAM for KV caches: {cpu_threads} thread(s) and "
            f"{cache_fraction:.1%} of free RAM each"
        )
    log_dir = Path(state_dir) / LOG_DIR_NAME
    servers = []
    for index, (gpu_ids, port) in enumerate(zip(groups, ports, strict=True)):
        slot = ServerSlot(
            index=index,
            host=fleet.host,
            port=port,
            device="cpu" if mode == "cpu" else "cuda",
            gpu_ids=gpu_ids,
            compute_capability=compute_caps.get(gpu_ids[0]) if gpu_ids else None,
            cpu_threads=cpu_threads,
            cache_memory_fraction=cache_fraction,
        )
        try:
            launch = recipe.build_launch(slot, config.model, fleet)
        except ValueError as error:
            raise PlanError(str(error)) from error
        servers.append(
            ServerSpec(
                index=index,
                host=fleet.host,
                port=port,
                gpu_ids=gpu_ids,
                url=client_url(fleet.host, port),
                log_path=str(log_dir / f"server-{index:02d}.log"),
                launch=launch,
            )
        )
    plan = ServerPlan(
        engine=fleet.engine,
        mode=mode,
        servers=servers,
        reasons=reasons,
        health_path=recipe.health_path,
        served_model_name=served_name,
    )
    logger.info("plan engine=%s mode=%s servers=%d", plan.engine, plan.mode, len(plan.servers))
    return plan


def _gpu_groups(
    env: EnvReport, config: RunConfig, recipe: Engine, reasons: list[str]
) -> tuple[list[list[int]], PlanMode]:
    """GPU groups (one per server) and the mode; ``cpu`` mode returns no groups."""
    fleet = config.fleet
    gpu_ids = [gpu.index for gpu in env.gpus]
    if fleet.device == "cpu" or (fleet.device == "auto" and not gpu_ids):
        why = "fleet.device is cpu" if fleet.device == "cpu" else "no GPUs found"
        reasons.append(f"{why}: CPU servers")
        return [], "cpu"
    if not gpu_ids:
        raise PlanError(
            "fleet.device is cuda but no GPU was found on this host (nvidia-smi lists none); "
            "run on a GPU host or set fleet.device: auto",
        )
    tp = fleet.tensor_parallel or 1
    if tp > 1 and not recipe.supports_tensor_parallel:
        raise PlanError(
            f"fleet.tensor_parallel={tp} but engine {recipe.name} serves one GPU per server; "
            "use engine sglang or unset fleet.tensor_parallel",
        )
    if tp > len(gpu_ids):
        raise PlanError(f"fleet.tensor_parallel={tp} exceeds the {len(gpu_ids)} GPU(s) of this host")
    if tp == 1:
        groups = [[gpu] for gpu in gpu_ids]
        reasons.append(f"{len(gpu_ids)} GPU(s): one server per GPU (data parallel)")
        mode: PlanMode = "dp"
    else:
        groups = _tp_groups(env, gpu_ids, tp, reasons)
        mode = "tp"
    if fleet.num_servers is not None and fleet.num_servers != len(groups):
        if fleet.num_servers < len(groups):
            reasons.append(
                f"fleet.num_servers={fleet.num_servers}: using the first {fleet.num_servers} group(s)"
            )
            groups = groups[: fleet.num_servers]
        else:
            reasons.append(
                f"fleet.num_servers={fleet.num_servers} but only {len(groups)} GPU group(s): "
                f"starting {len(groups)}"
            )
    return groups, mode


def _tp_groups(env: EnvReport, gpu_ids: list[int], tp: int, reasons: list[str]) -> list[list[int]]:
    islands = env.interconnect.nvlink_islands
    if env.interconnect.kind in {"nvlink", "mixed"} and islands:
        groups = [
            island[start : start + tp] for island in islands for start in range(0, len(island) - tp + 1, tp)
        ]
        unused = sorted(set(gpu_ids) - {gpu for group in groups for gpu in group})
        reasons.append(f"tensor parallel {tp} inside NVLink islands {islands}: {len(groups)} server(s)")
        if unused:
            reasons.append(f"GPUs {unused} fit no NVLink group of {tp}: left idle")
        if not groups:
            raise PlanError(
                f"no NVLink island holds {tp} GPUs (islands: {islands}); lower fleet.tensor_parallel",
            )
        return groups
    groups = [gpu_ids[start : start + tp] for start in range(0, len(gpu_ids) - tp + 1, tp)]
    reasons.append(
        f"tensor parallel {tp} over {env.interconnect.kind} interconnect (no NVLink islands known): "
        f"{len(groups)} server(s); data parallel is usually faster without NVLink"
    )
    unused = gpu_ids[len(groups) * tp :]
    if unused:
        reasons.append(f"GPUs {unused} fit no group of {tp}: left idle")
    return groups


def _url_host(url: str) -> str:
    return urlsplit(url).hostname or "127.0.0.1"


def _url_port(url: str) -> int:
    parts = urlsplit(url)
    if parts.port is not None:
        return parts.port
    return 443 if parts.scheme == "https" else 80
