"""Decide which servers to start, where, and with which exact argv: :class:`ServerPlan`.

The plan is pure data (pydantic) so it can be shown as an artifact, stored as ``plan.json`` and handed to
:class:`datagen.host.fleet.Fleet`. Every decision appends a line to ``reasons`` so an operator can see why
the fleet looks the way it does:

- data parallel (one server per GPU) when the model fits one GPU; tensor parallel only when it does not,
  and only inside an NVLink island (the smallest size that fits); a :class:`PlanError` when even the
  largest island cannot hold it. The fit is computed from the model's ``config.json``
  (:mod:`datagen.engines.model_size`).
- Engine sizing (``Engine.plan_capacity``): for SGLang the attention backend by compute capability and model
  type, memory fraction, max running requests and CUDA-graph batch from the KV/state budget, the hybrid
  cache mode, MTP, and only flags the target sglang accepts; the dispatcher's in-flight cap per server
  (``ServerSpec.max_inflight``) follows. See docs/engines.md.
- CPU servers: threads and a KV cache sized by tokens, so several fit on a small CI box.
- Optionally an sglang-router in front of the servers.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import socket
import sys
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from datagen.config import EngineKind, FleetConfig, RunConfig
from datagen.engines import Engine, LaunchCommand, ServerSlot, SGLangEngine, get_engine
from datagen.engines.base import CapacityRequest
from datagen.engines.model_size import BYTES_PER_GIB, BYTES_PER_MIB, ModelShape, read_model_shape
from datagen.engines.sglang_tuning import CUDA_GRAPH_MAX_BS_CAP
from datagen.errors import PlanError
from datagen.host.env_report import EnvReport
from datagen.host.tune_result import TuneResult, load_tune_result

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
# Share of each GPU's memory assumed for weights plus cache when deciding whether a model fits one GPU
# (the engine then sizes the real share from the probed memory, see Engine.plan_capacity).
PLANNED_MEM_FRACTION_STATIC = 0.85
# Memory a GPU shows as used with nothing on it (driver context, monitoring agents): not subtracted.
IDLE_GPU_MEMORY_MIB = 1024
# A model "fits" a GPU only if this share of the GPU's memory is left for the KV cache after its weights.
MIN_KV_CACHE_SHARE = 0.10
TP_SIZES = (2, 4, 8, 16)
# `transformers serve` continuous batching: tokens per cache page (its default page_size).
CB_PAGE_TOKENS = 256
# Tokens per forward step of a CPU server. The attention masks it allocates grow with this times the
# cache size; 512 keeps one tiny-model server's masks at a few hundred MiB.
CPU_MAX_BATCH_TOKENS = 512
# Bytes per element of the CPU attention masks (float32 activations).
CPU_MASK_BYTES = 4
# Prompt length assumed for sizing when no dataset caps its prompts.
DEFAULT_PROMPT_BUDGET_TOKENS = 1024
CONTEXT_ROUND_TOKENS = 256
ROUTER_MODULE = "sglang_router"
ROUTER_INSTALL_HINT = "pip install sglang-router (the `gpu` extra installs it with sglang)"


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
    max_inflight: int | None = Field(
        default=None, gt=0, description="Requests the dispatcher keeps in flight on this server (planned)."
    )


class ServerPlan(BaseModel):
    """The whole fleet as planned: engine, mode, servers, and the reasons behind each choice."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineKind
    mode: PlanMode
    servers: list[ServerSpec] = Field(min_length=1)
    reasons: list[str] = Field(default_factory=list)
    health_path: str = "/health"
    served_model_name: str = Field(description="Model name to send in requests.")
    router: ServerSpec | None = Field(
        default=None, description="sglang-router in front of the servers; clients talk to it only."
    )
    tensor_parallel: int = Field(default=1, ge=1, description="GPUs per server.")
    model_weights_gib: float | None = Field(default=None, description="Estimated weights, None if unknown.")

    @property
    def urls(self) -> list[str]:
        """Base URLs of every server, in index order."""
        return [server.url for server in self.servers]

    @property
    def client_urls(self) -> list[str]:
        """Where the dispatcher sends requests: the router when there is one, else every server."""
        return [self.router.url] if self.router is not None else self.urls

    def max_inflight_per_server(self, default: int) -> int:
        """The planned in-flight cap per server (the smallest of the servers'), ``default`` when unplanned."""
        planned = [server.max_inflight for server in self.servers if server.max_inflight is not None]
        return min(planned) if planned else default

    def inflight_per_client_url(self, per_server: int) -> int:
        """The dispatcher's in-flight cap per client URL: the router carries every server's share."""
        return per_server * len(self.servers) if self.router is not None else per_server

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
        for server in [*self.servers, *([self.router] if self.router else [])]:
            gpus = ",".join(str(gpu) for gpu in server.gpu_ids) or "none"
            title = "router" if server is self.router else f"server {server.index}"
            lines.append(f"### {title}: {server.url} (GPUs: {gpus})")
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


def engine_for_env(kind: EngineKind, env: EnvReport) -> Engine:
    """The launch recipe of ``kind``; for sglang, with the flags the probed sglang accepts."""
    if kind == "sglang" and env.sglang_flags is not None:
        return SGLangEngine.for_flags(env.sglang_flags)
    return get_engine(kind)


def router_problems(fleet: FleetConfig) -> list[str]:
    """Why ``fleet.router`` cannot work here (for preflight); empty when it can or is off."""
    if not fleet.router:
        return []
    try:
        found = importlib.util.find_spec(ROUTER_MODULE) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
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


def plan_servers(
    env: EnvReport, config: RunConfig, state_dir: Path, *, engine: Engine | None = None
) -> ServerPlan:
    """Plan the fleet for this host and config.

    No GPUs (or ``fleet.device: cpu``): ``fleet.cpu_servers`` CPU servers. GPUs: one server per GPU
    (data parallel) when the model fits one GPU, else tensor-parallel groups inside NVLink islands (see
    the module docstring). ``fleet.tensor_parallel`` forces a group size; ``fleet.num_servers`` overrides
    the CPU count and caps the GPU count. ``external``: the configured URLs, nothing to start.

    Args:
        env: The probed environment.
        config: The run config.
        state_dir: Host-local state folder; server logs go to ``<state_dir>/logs``.
        engine: The launch recipe; :func:`engine_for_env` when None.

    Returns:
        The plan.

    Raises:
        PlanError: The config asks for something this host cannot give (CUDA without GPUs, a model that
            fits no GPU group, tensor parallelism with an engine that has none, a flag the installed
            sglang lacks, the router without sglang-router, no free ports).

    """
    fleet = config.fleet
    recipe = engine or engine_for_env(fleet.engine, env)
    reasons: list[str] = []
    served_name = recipe.served_model_name(config.model)
    problems = router_problems(fleet)
    if problems:
        raise PlanError(problems[0])
    log_dir = Path(state_dir) / LOG_DIR_NAME
    if not recipe.launches_processes:
        servers = [
            ServerSpec(index=index, host=_url_host(url), port=_url_port(url), url=url.rstrip("/"))
            for index, url in enumerate(fleet.external_urls)
        ]
        reasons.append(f"engine {recipe.name}: {len(servers)} server(s) already running, nothing to start")
        plan = ServerPlan(
            engine=fleet.engine,
            mode="external",
            servers=servers,
            reasons=reasons,
            health_path=recipe.health_path,
            served_model_name=served_name,
        )
        return _with_router(plan, fleet, fleet.base_port, log_dir, reasons)

    shape = _model_shape(config, reasons)
    groups, mode = _gpu_groups(env, config, recipe, shape, reasons)
    gpus = {gpu.index: gpu for gpu in env.gpus}
    if mode == "cpu":
        count = fleet.num_servers or fleet.cpu_servers
        groups = [[] for _ in range(count)]
        if fleet.speculative != "off":
            raise PlanError("fleet.speculative needs GPU servers (sglang); set it to off for CPU servers")
    ports = choose_ports(fleet.host, fleet.base_port, len(groups), reasons)
    context = _context_length(config, shape, reasons)
    base = _cpu_slot_fields(config, shape, context, len(groups), reasons) if mode == "cpu" else {}
    if mode != "cpu":
        base["context_length_tokens"] = context
    if mode != "cpu" and fleet.fix_jit_env:
        jit_env = env.jit_env()
        base["extra_env"] = jit_env
        reasons.append(
            "fleet.fix_jit_env: servers get "
            + (
                ", ".join(f"{key}={value}" for key, value in sorted(jit_env.items()))
                or "nothing (none needed)"
            )
        )
    tuned = _tuned_inflight(fleet, reasons)
    if tuned is None and "max_inflight_per_server" in fleet.model_fields_set:
        reasons.append(
            f"in flight per server: {fleet.max_inflight_per_server} (fleet.max_inflight_per_server is set, so it "
            "wins over the engine's derived cap)"
        )
    told: set[str] = set()
    servers = []
    for index, (gpu_ids, port) in enumerate(zip(groups, ports, strict=True)):
        capability = gpus[gpu_ids[0]].compute_capability if gpu_ids else None
        fields = dict(base)
        max_inflight = fleet.max_inflight_per_server
        if mode != "cpu":
            capacity = recipe.plan_capacity(
                _capacity_request(env, config, shape, context, gpu_ids, capability), fleet
            )
            fields |= capacity.slot_fields
            max_inflight = capacity.max_inflight
            for reason in capacity.reasons:
                if reason not in told:
                    told.add(reason)
                    reasons.append(reason)
        if tuned is not None:
            max_inflight = tuned.best_inflight_per_server
            if tuned.setting_flag == "--max-running-requests" and tuned.best_setting and mode != "cpu":
                fields["max_running_requests"] = tuned.best_setting
                if fields.get("cuda_graph_max_bs"):
                    fields["cuda_graph_max_bs"] = min(tuned.best_setting, CUDA_GRAPH_MAX_BS_CAP)
        elif "max_inflight_per_server" in fleet.model_fields_set:
            # Set explicitly in the config: the operator's number wins over the derived one.
            max_inflight = fleet.max_inflight_per_server
        slot = ServerSlot(
            index=index,
            host=fleet.host,
            port=port,
            device="cpu" if mode == "cpu" else "cuda",
            gpu_ids=gpu_ids,
            compute_capability=capability,
            **fields,
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
                max_inflight=max_inflight,
            )
        )
    plan = ServerPlan(
        engine=fleet.engine,
        mode=mode,
        servers=servers,
        reasons=reasons,
        health_path=recipe.health_path,
        served_model_name=served_name,
        tensor_parallel=max(1, len(groups[0])) if groups else 1,
        model_weights_gib=round(shape.weight_bytes / BYTES_PER_GIB, 1) if shape else None,
    )
    plan = _with_router(plan, fleet, max(ports) + 1, log_dir, reasons)
    logger.info("plan engine=%s mode=%s servers=%d", plan.engine, plan.mode, len(plan.servers))
    return plan


def _with_router(
    plan: ServerPlan, fleet: FleetConfig, first_port: int, log_dir: Path, reasons: list[str]
) -> ServerPlan:
    if not fleet.router:
        return plan
    port = fleet.router_port or choose_ports(fleet.host, first_port, 1, reasons)[0]
    reasons.append(
        f"sglang-router ({fleet.router_policy}) on port {port} in front of {len(plan.servers)} server(s); "
        "the dispatcher talks to the router only"
    )
    router = ServerSpec(
        index=len(plan.servers),
        host=fleet.host,
        port=port,
        url=client_url(fleet.host, port),
        log_path=str(log_dir / "router.log"),
        launch=router_launch(plan.urls, fleet.host, port, fleet.router_policy),
    )
    return plan.model_copy(update={"router": router, "reasons": reasons})


def _model_shape(config: RunConfig, reasons: list[str]) -> ModelShape | None:
    try:
        shape = read_model_shape(config.model.path)
    except ValueError as error:
        raise PlanError(f"{config.model.path}/config.json: {error}") from error
    if shape is None:
        reasons.append(f"model size unknown ({config.model.path} has no local config.json): not checked")
        return None
    reasons.append(
        f"model: ~{shape.params / 1e9:.2f}B parameters, ~{shape.weight_bytes / BYTES_PER_GIB:.1f} GiB of "
        f"weights ({shape.dtype_bytes:g} bytes each)"
        + ("; hybrid (linear + full attention)" if shape.hybrid else "")
    )
    return shape


def _weight_budget_mib(memory_total_mib: int, fleet: FleetConfig) -> float:
    fraction = fleet.sglang.mem_fraction_static or PLANNED_MEM_FRACTION_STATIC
    return memory_total_mib * max(0.0, fraction - MIN_KV_CACHE_SHARE)


def _fits(shape: ModelShape, tp: int, budget_mib: float) -> bool:
    return shape.weight_bytes / tp / BYTES_PER_MIB <= budget_mib


def _gpu_groups(
    env: EnvReport, config: RunConfig, recipe: Engine, shape: ModelShape | None, reasons: list[str]
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
    tp = fleet.tensor_parallel or _auto_tensor_parallel(env, config, recipe, shape, reasons)
    if tp > 1 and not recipe.supports_tensor_parallel:
        raise PlanError(
            f"fleet.tensor_parallel={tp} but engine {recipe.name} serves one GPU per server; "
            "use engine sglang or unset fleet.tensor_parallel",
        )
    if tp > len(gpu_ids):
        raise PlanError(f"fleet.tensor_parallel={tp} exceeds the {len(gpu_ids)} GPU(s) of this host")
    if fleet.tensor_parallel and shape is not None:
        budget = _weight_budget_mib(_min_memory_mib(env), fleet)
        if budget and not _fits(shape, tp, budget):
            raise PlanError(
                f"the model's ~{shape.weight_bytes / BYTES_PER_GIB:.0f} GiB of weights do not fit "
                f"fleet.tensor_parallel={tp} GPUs ({budget / 1024:.0f} GiB for weights each); raise "
                "fleet.tensor_parallel or unset it to let the planner choose",
            )
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


def _min_memory_mib(env: EnvReport) -> int:
    sizes = [gpu.memory_total_mib for gpu in env.gpus if gpu.memory_total_mib]
    return min(sizes) if sizes else 0


def _auto_tensor_parallel(
    env: EnvReport, config: RunConfig, recipe: Engine, shape: ModelShape | None, reasons: list[str]
) -> int:
    """1 when the model fits one GPU (or its size is unknown), else the smallest TP inside an NVLink island."""
    memory_mib = _min_memory_mib(env)
    if shape is None or not memory_mib:
        return 1
    budget = _weight_budget_mib(memory_mib, config.fleet)
    weights_gib = shape.weight_bytes / BYTES_PER_GIB
    if _fits(shape, 1, budget):
        reasons.append(
            f"~{weights_gib:.1f} GiB of weights fit one GPU ({budget / 1024:.0f} GiB for weights of "
            f"{memory_mib / 1024:.0f} GiB, leaving {MIN_KV_CACHE_SHARE:.0%} for the KV cache): no tensor parallel"
        )
        return 1
    islands = env.interconnect.nvlink_islands or [[gpu.index] for gpu in env.gpus]
    largest = max(len(island) for island in islands)
    if not recipe.supports_tensor_parallel:
        raise PlanError(
            f"the model's ~{weights_gib:.0f} GiB of weights do not fit one GPU ({budget / 1024:.0f} GiB for "
            f"weights) and engine {recipe.name} cannot split a model across GPUs: use engine sglang "
            "(tensor parallel), a smaller or quantized model, or bigger GPUs",
        )
    for tp in TP_SIZES:
        if tp > largest:
            break
        if shape.num_attention_heads % tp == 0 and _fits(shape, tp, budget):
            reasons.append(
                f"~{weights_gib:.1f} GiB of weights do not fit one GPU ({budget / 1024:.0f} GiB for weights): "
                f"tensor parallel {tp} inside NVLink islands"
            )
            return tp
    raise PlanError(
        f"the model's ~{weights_gib:.0f} GiB of weights fit no GPU group here: one GPU offers "
        f"{budget / 1024:.0f} GiB for weights and the largest NVLink island has {largest} GPU(s) "
        f"({env.interconnect.summary}). Use a smaller or quantized model or a host with more GPU memory; "
        "set fleet.tensor_parallel to split it across PCIe GPUs anyway (slow)",
        weights_gib=round(weights_gib, 1),
        largest_island=largest,
    )


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


def _context_length(config: RunConfig, shape: ModelShape | None, reasons: list[str]) -> int | None:
    """Planned context: prompt cap + max_tokens when every dataset caps its prompts, else None."""
    if config.model.max_model_len_tokens:
        return None
    caps = [dataset.max_prompt_tokens for dataset in config.datasets]
    if any(cap is None for cap in caps):
        return None
    need = max(
        (cap or 0) + config.sampling_for(dataset).max_tokens
        for cap, dataset in zip(caps, config.datasets, strict=True)
    )
    context = math.ceil(need / CONTEXT_ROUND_TOKENS) * CONTEXT_ROUND_TOKENS
    if shape is not None and shape.max_position_embeddings:
        context = min(context, shape.max_position_embeddings)
    reasons.append(f"context length {context} tokens: the longest prompt cap plus max_tokens ({need})")
    return context


def _sampling_budget_tokens(config: RunConfig, context: int | None, shape: ModelShape | None) -> int:
    """Tokens one request may occupy in the KV cache."""
    budget = config.model.max_model_len_tokens or context
    if budget is None:
        budget = DEFAULT_PROMPT_BUDGET_TOKENS + max(
            config.sampling_for(dataset).max_tokens for dataset in config.datasets
        )
    if shape is not None and shape.max_position_embeddings:
        budget = min(budget, shape.max_position_embeddings)
    return budget


def _tuned_inflight(fleet: FleetConfig, reasons: list[str]) -> TuneResult | None:
    """The in-flight cap measured by ``datagen tune`` (``fleet.tune_result``), None when not given."""
    if fleet.tune_result is None:
        return None
    try:
        result = load_tune_result(fleet.tune_result)
    except (OSError, ValueError) as error:
        raise PlanError(
            f"fleet.tune_result {fleet.tune_result} is not a readable `datagen tune --output` file ({error}): "
            "run datagen tune again or unset fleet.tune_result"
        ) from error
    if result.engine != fleet.engine:
        raise PlanError(
            f"fleet.tune_result was measured with engine {result.engine}, this run uses {fleet.engine}: "
            "tune this engine or unset fleet.tune_result"
        )
    reasons.append(
        f"in flight per server: {result.best_inflight_per_server}, measured by datagen tune "
        f"({result.best_output_tokens_per_s:.0f} output tok/s, fleet.tune_result)"
        + (f"; {result.setting_flag} {result.best_setting}" if result.setting_flag else "")
    )
    return result


def _capacity_request(
    env: EnvReport,
    config: RunConfig,
    shape: ModelShape | None,
    context: int | None,
    gpu_ids: list[int],
    capability: str | None,
) -> CapacityRequest:
    """What the engine needs to size the server on ``gpu_ids`` (its smallest GPU decides)."""
    members = [gpu for gpu in env.gpus if gpu.index in gpu_ids]
    totals = [gpu.memory_total_mib for gpu in members if gpu.memory_total_mib]
    in_use = max((max(0, (gpu.memory_used_mib or 0) - IDLE_GPU_MEMORY_MIB) for gpu in members), default=0)
    return CapacityRequest(
        compute_capability=capability,
        gpu_memory_total_mib=min(totals) if totals else None,
        gpu_memory_in_use_mib=in_use,
        tensor_parallel=max(1, len(gpu_ids)),
        shape=shape,
        request_tokens=_sampling_budget_tokens(config, context, shape),
        configured_inflight=config.fleet.max_inflight_per_server,
        speculative=config.fleet.speculative,
    )


def _cpu_slot_fields(
    config: RunConfig, shape: ModelShape | None, context: int | None, servers: int, reasons: list[str]
) -> dict[str, object]:
    fleet = config.fleet
    threads = max(1, (os.cpu_count() or 1) // servers)
    fields: dict[str, object] = {"cpu_threads": threads}
    if shape is None:
        fraction = round(CPU_CACHE_MEMORY_FRACTION / servers, 4)
        fields["cache_memory_fraction"] = fraction
        reasons.append(
            f"{servers} CPU server(s) share {os.cpu_count()} cores and {CPU_CACHE_MEMORY_FRACTION:.0%} of free "
            f"RAM for KV caches: {threads} thread(s) and {fraction:.1%} of free RAM each (model size unknown)"
        )
        return fields
    request_tokens = _sampling_budget_tokens(config, context, shape)
    cache_tokens = fleet.max_inflight_per_server * request_tokens
    per_token = shape.kv_bytes_per_token(shape.dtype_bytes) + CPU_MAX_BATCH_TOKENS * CPU_MASK_BYTES
    available = _available_ram_bytes()
    if available is not None:
        share = CPU_CACHE_MEMORY_FRACTION * available / servers
        cache_tokens = max(CB_PAGE_TOKENS, min(cache_tokens, int(share // per_token)))
    blocks = math.ceil(cache_tokens / CB_PAGE_TOKENS)
    fields |= {"cache_num_blocks": blocks, "max_batch_tokens": CPU_MAX_BATCH_TOKENS}
    reasons.append(
        f"{servers} CPU server(s) share {os.cpu_count()} cores: {threads} thread(s) each; KV cache sized by "
        f"tokens: {blocks} blocks of {CB_PAGE_TOKENS} ({fleet.max_inflight_per_server} requests x "
        f"{request_tokens} tokens, ~{blocks * CB_PAGE_TOKENS * per_token / BYTES_PER_MIB:.0f} MiB with masks), "
        f"{CPU_MAX_BATCH_TOKENS} tokens per step"
    )
    return fields


def _available_ram_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _url_host(url: str) -> str:
    return urlsplit(url).hostname or "127.0.0.1"


def _url_port(url: str) -> int:
    parts = urlsplit(url)
    if parts.port is not None:
        return parts.port
    return 443 if parts.scheme == "https" else 80
