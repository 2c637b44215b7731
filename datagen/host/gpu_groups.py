"""Which GPUs each server gets: data parallel when the model fits one GPU, else tensor parallel inside NVLink.

The fit is computed from the model's ``config.json`` (:mod:`datagen.engines.model_size`) against a planned
memory share; a :class:`PlanError` says what to change when no group can hold the model. Every choice
appends a line to the plan's reasons.
"""

from __future__ import annotations

from typing import Literal

from datagen.config import FleetConfig, RunConfig
from datagen.engines import Engine
from datagen.engines.model_size import BYTES_PER_GIB, BYTES_PER_MIB, ModelShape
from datagen.errors import PlanError
from datagen.host.env_report import EnvReport

PlanMode = Literal["dp", "tp", "cpu", "external"]
# Share of each GPU's memory assumed for weights plus cache when deciding whether a model fits one GPU
# (the engine then sizes the real share from the probed memory, see Engine.plan_capacity).
PLANNED_MEM_FRACTION_STATIC = 0.85
# A model "fits" a GPU only if this share of the GPU's memory is left for the KV cache after its weights.
MIN_KV_CACHE_SHARE = 0.10
TP_SIZES = (2, 4, 8, 16)


def _weight_budget_mib(memory_total_mib: int, fleet: FleetConfig) -> float:
    fraction = fleet.sglang.mem_fraction_static or PLANNED_MEM_FRACTION_STATIC
    return memory_total_mib * max(0.0, fraction - MIN_KV_CACHE_SHARE)


def _fits(shape: ModelShape, tp: int, budget_mib: float) -> bool:
    return shape.weight_bytes / tp / BYTES_PER_MIB <= budget_mib


def gpu_groups(
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
        budget = _weight_budget_mib(min_memory_mib(env), fleet)
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


def min_memory_mib(env: EnvReport) -> int:
    """Memory of the smallest GPU of this host (0 when unknown)."""
    sizes = [gpu.memory_total_mib for gpu in env.gpus if gpu.memory_total_mib]
    return min(sizes) if sizes else 0


def _auto_tensor_parallel(
    env: EnvReport, config: RunConfig, recipe: Engine, shape: ModelShape | None, reasons: list[str]
) -> int:
    """1 when the model fits one GPU (or its size is unknown), else the smallest TP inside an NVLink island."""
    memory_mib = min_memory_mib(env)
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
