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
  cache mode, MTP, and only flags the target sglang accepts. See docs/engines.md.
- The dispatcher's in-flight cap per server: decided by :func:`datagen.engines.capacity.decide_inflight_cap`
  (tuned, explicit config, the engine's sizing) and carried by the plan (``ServerPlan.dispatcher_inflight``).
- CPU servers: threads and a KV cache sized by tokens, so several fit on a small CI box
  (:mod:`datagen.engines.cpu_sizing`).
- Optionally an sglang-router in front of the servers (:mod:`datagen.engines.router`).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from datagen.config import EngineKind, FleetConfig, RunConfig
from datagen.engines import Engine, LaunchCommand, ServerSlot, get_engine
from datagen.engines.base import CapacityRequest
from datagen.engines.capacity import decide_inflight_cap, per_client_url, tuned_slot_fields
from datagen.engines.cpu_sizing import cpu_slot_fields
from datagen.engines.model_size import BYTES_PER_GIB, ModelShape, read_model_shape
from datagen.engines.router import router_launch, router_problems
from datagen.engines.tune_result import TuneResult, load_tune_result
from datagen.errors import PlanError
from datagen.escape import markdown_block, markdown_code
from datagen.host.env_report import IDLE_GPU_MEMORY_MIB, EnvReport
from datagen.host.gpu_groups import PlanMode, gpu_groups
from datagen.host.ports import choose_ports, client_url, url_host, url_port

logger = logging.getLogger(__name__)

LOG_DIR_NAME = "logs"
# Prompt length assumed for sizing when no dataset caps its prompts.
DEFAULT_PROMPT_BUDGET_TOKENS = 1024
CONTEXT_ROUND_TOKENS = 256


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

    @property
    def dispatcher_inflight(self) -> int:
        """The dispatcher's in-flight cap per client URL, as planned (:func:`per_client_url`).

        Raises:
            ValueError: A server has no planned cap (a plan not made by :func:`plan_servers`).

        """
        caps = [server.max_inflight for server in self.servers]
        if any(cap is None for cap in caps):
            raise ValueError("a server has no planned in-flight cap: plan the fleet with plan_servers")
        return per_client_url([cap for cap in caps if cap is not None], router=self.router is not None)

    def to_markdown(self) -> str:
        """The plan as an artifact: mode, reasons, and the exact command of every server."""
        lines = [
            f"# Server plan: {len(self.servers)} x {self.engine} ({self.mode})",
            "",
            f"Model name in requests: {markdown_code(self.served_model_name)}; readiness: "
            f"{markdown_code(f'GET {self.health_path}')}",
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
                lines += markdown_block(server.launch.shell_block().splitlines(), "bash")
            else:
                lines.append("external: not started by datagen")
            if server.log_path:
                lines.append(f"log: `{server.log_path}`")
            lines.append("")
        return "\n".join(lines)


def engine_for_env(kind: EngineKind, env: EnvReport) -> Engine:
    """The launch recipe of ``kind``, with the launch flags the probe found its install accepts."""
    return get_engine(kind, env.engine_flags(kind))


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
    explicit_inflight = "max_inflight_per_server" in fleet.model_fields_set
    if not recipe.launches_processes:
        reasons.append(
            f"engine {recipe.name}: {len(fleet.external_urls)} server(s) already running, nothing to start"
        )
        # Someone else sized these servers: the engine sizes nothing, a tune result or the config decides.
        cap = decide_inflight_cap(
            None, configured=fleet.max_inflight_per_server, explicit=explicit_inflight, tuned=_tuned(fleet)
        )
        reasons.extend(cap.reasons)
        servers = [
            ServerSpec(
                index=index,
                host=url_host(url),
                port=url_port(url),
                url=url.rstrip("/"),
                max_inflight=cap.per_server,
            )
            for index, url in enumerate(fleet.external_urls)
        ]
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
    groups, mode = gpu_groups(env, config, recipe, shape, reasons)
    gpus = {gpu.index: gpu for gpu in env.gpus}
    if mode == "cpu":
        count = fleet.num_servers or fleet.cpu_servers
        groups = [[] for _ in range(count)]
        if fleet.speculative != "off":
            raise PlanError("fleet.speculative needs GPU servers (sglang); set it to off for CPU servers")
    ports = choose_ports(fleet.host, fleet.base_port, len(groups), reasons)
    context = _context_length(config, shape, reasons)
    base: dict[str, object] = {}
    if mode == "cpu":
        base, why = cpu_slot_fields(
            shape, _sampling_budget_tokens(config, context, shape), fleet.max_inflight_per_server, len(groups)
        )
        reasons.append(why)
    else:
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
    tuned = _tuned(fleet)
    told = set(reasons)
    servers = []
    for index, (gpu_ids, port) in enumerate(zip(groups, ports, strict=True)):
        capability = gpus[gpu_ids[0]].compute_capability if gpu_ids else None
        fields = dict(base)
        capacity = None
        if mode != "cpu":
            capacity = recipe.plan_capacity(
                _capacity_request(env, config, shape, context, gpu_ids, capability), fleet
            )
            fields |= tuned_slot_fields(capacity.slot_fields, tuned)
        cap = decide_inflight_cap(
            capacity, configured=fleet.max_inflight_per_server, explicit=explicit_inflight, tuned=tuned
        )
        for reason in [*(capacity.reasons if capacity else []), *cap.reasons]:
            if reason not in told:
                told.add(reason)
                reasons.append(reason)
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
                max_inflight=cap.per_server,
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


def _context_length(config: RunConfig, shape: ModelShape | None, reasons: list[str]) -> int | None:
    """Planned context: prompt cap + max_tokens when every dataset caps its prompts, else None."""
    if config.model.max_model_len_tokens:
        return None
    caps = [dataset.max_prompt_tokens for dataset in config.datasets]
    if any(cap is None for cap in caps):
        return None
    need = max(
        (cap or 0) + config.max_tokens_for(dataset)
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
            config.max_tokens_for(dataset) for dataset in config.datasets
        )
    if shape is not None and shape.max_position_embeddings:
        budget = min(budget, shape.max_position_embeddings)
    return budget


def _tuned(fleet: FleetConfig) -> TuneResult | None:
    """What ``datagen tune`` measured (``fleet.tune_result``), None when not given."""
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
