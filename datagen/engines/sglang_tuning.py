"""How one SGLang server is sized: memory share, concurrency, CUDA-graph batch, hybrid cache mode, MTP.

Pure arithmetic on the probed GPU and the model's ``config.json`` (:class:`ModelShape`); every number comes
with a reason line for the plan. The formulas and their sources are in ``docs/engines.md``:

- ``--mem-fraction-static``: SGLang's own estimate (``sglang/srt/arg_groups/memory_hook.py``):
  ``(gpu - reserved) / gpu`` with ``reserved = 512 + 1.5 * max(chunked_prefill, 2048) + tp/8 * 1024 +
  2 * cuda_graph_max_bs`` MiB, at least 10 GiB on GPUs over 60 GiB; we also subtract memory other processes
  held when the host was probed.
- ``--max-running-requests``: what the static pool holds after the weights, per request
  ``kv_bytes_per_token * request_tokens + recurrent_state`` (the state once more per draft token with
  MTP: SGLang keeps intermediate SSM states for verification), capped by :data:`MAX_RUNNING_REQUESTS_CAP`.
- Hybrid models: ``--disable-radix-cache`` with an explicit ``--max-running-requests`` makes SGLang size the
  mamba pool to exactly that many requests (``kv_cache_configurator.py``), the largest concurrency for
  unique prompts; with the radix cache on, ``no_buffer`` needs ``--disable-overlap-schedule``
  (``mamba_hook.py``) and holds ~1/3 as many requests, ``extra_buffer`` ~1/5.
- The dispatcher's in-flight cap: running slots plus a margin, so a finished request is replaced at once.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

from datagen.config import FleetConfig
from datagen.engines.base import CapacityPlan, CapacityRequest
from datagen.engines.model_size import BYTES_PER_GIB, BYTES_PER_MIB, ModelShape
from datagen.errors import PlanError

# Tokens per prefill chunk we pass explicitly, so the activation reserve below matches what runs.
CHUNKED_PREFILL_TOKENS = 8192
# sglang memory_hook.py: fixed metadata + activation slack per token of the prefill chunk (MiB).
RESERVE_BASE_MIB = 512
RESERVE_MIB_PER_PREFILL_TOKEN = 1.5
RESERVE_MIN_ACTIVATION_TOKENS = 2048
RESERVE_MIB_PER_TP_EIGHTH = 1024
RESERVE_MIB_PER_GRAPH_BATCH = 2
# sglang memory_hook.py: GPUs above 60 GiB reserve at least 10 GiB for activations and graphs.
LARGE_GPU_MIB = 60 * 1024
LARGE_GPU_MIN_RESERVE_MIB = 10 * 1024
# Never plan a static share above this: leaves room for NCCL, the CUDA context and allocator slack.
MAX_MEM_FRACTION_STATIC = 0.93
# A share below this leaves too little for the KV cache to be worth serving.
MIN_MEM_FRACTION_STATIC = 0.5
# Largest decode batch we capture CUDA graphs for (SGLang's own default ceiling on large GPUs).
CUDA_GRAPH_MAX_BS_CAP = 512
# Above this many running requests per server, decode steps get long for little throughput gain.
MAX_RUNNING_REQUESTS_CAP = 1024
# Extra requests the dispatcher keeps queued on a server, as a share of its running slots (at least 2).
INFLIGHT_MARGIN_SHARE = 0.125
MIN_INFLIGHT_MARGIN = 2
# Qwen3.5/3.6 built-in MTP (one MTP layer): SGLang's recipe for the family (EAGLE == NEXTN there).
MTP_RECIPE: dict[str, Any] = {
    "algorithm": "EAGLE",
    "num-steps": 3,
    "eagle-topk": 1,
    "num-draft-tokens": 4,
}

CUDA_GRAPH_FLAGS = ("--cuda-graph-max-bs-decode", "--cuda-graph-max-bs")


def cuda_graph_flag(accepted: Collection[str] | None) -> str | None:
    """The decode CUDA-graph batch flag of the target sglang (0.5.23 only has ``-decode``); None: neither."""
    if accepted is None:
        return CUDA_GRAPH_FLAGS[0]
    return next((flag for flag in CUDA_GRAPH_FLAGS if flag in accepted), None)


def reserved_mib(tensor_parallel: int, graph_bs: int, memory_total_mib: int) -> float:
    """Activation and CUDA-graph memory SGLang keeps outside the static pool (its own estimate)."""
    reserve = RESERVE_BASE_MIB + RESERVE_MIB_PER_PREFILL_TOKEN * max(
        CHUNKED_PREFILL_TOKENS, RESERVE_MIN_ACTIVATION_TOKENS
    )
    reserve += tensor_parallel / 8 * RESERVE_MIB_PER_TP_EIGHTH + RESERVE_MIB_PER_GRAPH_BATCH * graph_bs
    if memory_total_mib > LARGE_GPU_MIB:
        reserve = max(reserve, LARGE_GPU_MIN_RESERVE_MIB)
    return reserve


def mtp_args(shape: ModelShape | None) -> list[str]:
    """The MTP flags for the model family, or a PlanError saying why MTP cannot run.

    Raises:
        PlanError: The model's size is unknown or it has no MTP layers.

    """
    if shape is None:
        raise PlanError(
            "fleet.speculative is mtp but the model's config.json is not readable here, so its MTP layers "
            "cannot be checked: give model.path as a local directory, or set fleet.speculative: off"
        )
    if shape.mtp_layers < 1:
        raise PlanError(
            f"fleet.speculative is mtp but the model ({shape.model_type}) has no MTP layers "
            "(config.json: mtp_num_hidden_layers / num_nextn_predict_layers is 0 or absent): set "
            "fleet.speculative: off, or use a model with built-in MTP heads (e.g. Qwen3.6)"
        )
    argv: list[str] = []
    for key, value in MTP_RECIPE.items():
        argv += [f"--speculative-{key}", str(value)]
    return argv


def plan_sglang_capacity(
    request: CapacityRequest, fleet: FleetConfig, accepted_flags: Collection[str] | None
) -> CapacityPlan:
    """Size one SGLang server (see the module docstring for the formulas).

    Args:
        request: The server's GPUs, the model shape and the request length to plan for.
        fleet: ``fleet.sglang`` values set explicitly win over the derived ones.
        accepted_flags: Flags of the target sglang (None: unknown, current names assumed).

    Returns:
        Slot fields, the dispatcher's cap and the reasons.

    Raises:
        PlanError: MTP asked for a model without MTP layers, or the GPU is too small for one request.

    """
    options = fleet.sglang
    reasons: list[str] = []
    fields: dict[str, Any] = {"chunked_prefill_tokens": CHUNKED_PREFILL_TOKENS}
    shape = request.shape
    tp = request.tensor_parallel
    speculative = request.speculative == "mtp"
    if speculative:
        fields["speculative_args"] = mtp_args(shape)
        reasons.append(
            "MTP speculative decoding (fleet.speculative: mtp): "
            + " ".join(fields["speculative_args"])
            + "; verification is rejection sampling, so at temperature > 0 the outputs keep the target "
            "model's distribution (keep min_p unset: the verify path does not apply it)"
        )
    total = request.gpu_memory_total_mib
    if total is None or shape is None:
        fields["mem_fraction_static"] = options.mem_fraction_static
        fields["max_running_requests"] = options.max_running_requests or request.configured_inflight
        reasons.append(
            "GPU memory or model size unknown: --max-running-requests follows fleet.max_inflight_per_server "
            f"({fields['max_running_requests']}), sglang picks its memory share"
        )
        return CapacityPlan(
            slot_fields=fields,
            max_inflight=inflight_with_margin(fields["max_running_requests"]),
            inflight_reason=_inflight_reason(fields["max_running_requests"]),
            reasons=reasons,
        )

    graph_bs_bound = CUDA_GRAPH_MAX_BS_CAP
    reserve = reserved_mib(tp, graph_bs_bound, total)
    in_use = request.gpu_memory_in_use_mib
    fraction = options.mem_fraction_static
    if fraction is None:
        fraction = min(MAX_MEM_FRACTION_STATIC, round((total - reserve - in_use) / total, 3))
        if fraction < MIN_MEM_FRACTION_STATIC:
            raise PlanError(
                f"only {(total - reserve - in_use) / 1024:.0f} GiB of the GPU's {total / 1024:.0f} GiB are left "
                f"for weights and cache ({in_use} MiB held by other processes): free the GPUs (halt training) "
                "or set fleet.sglang.mem_fraction_static"
            )
        reasons.append(
            f"--mem-fraction-static {fraction:g}: (GPU {total} MiB - {reserve:.0f} MiB activations/CUDA graphs "
            f"(sglang's estimate for {CHUNKED_PREFILL_TOKENS}-token prefill chunks) - {in_use} MiB held by others)"
            f" / GPU, at most {MAX_MEM_FRACTION_STATIC}"
        )
    fields["mem_fraction_static"] = fraction
    weights = shape.weight_bytes + (shape.mtp_weight_bytes if speculative else 0)
    pool_bytes = fraction * total * BYTES_PER_MIB - weights / tp
    kv_per_request = shape.kv_bytes_per_token() * request.request_tokens / tp
    state_per_request = shape.recurrent_state_bytes_per_request() / tp
    draft_tokens = int(MTP_RECIPE["num-draft-tokens"]) if speculative else 0
    if speculative:
        # One more full-attention layer (the MTP layer) caches KV for the draft tokens.
        kv_per_request *= (shape.full_attention_layers + shape.mtp_layers) / shape.full_attention_layers
    per_request = kv_per_request + state_per_request * (1 + draft_tokens)
    fits = int(pool_bytes // per_request) if pool_bytes > 0 else 0
    if fits < 1:
        raise PlanError(
            f"the GPU's static pool ({fraction:g} x {total / 1024:.0f} GiB) leaves {pool_bytes / BYTES_PER_GIB:.1f} GiB "
            f"after {weights / tp / BYTES_PER_GIB:.1f} GiB of weights: not one {request.request_tokens}-token request "
            "fits. Use tensor parallelism, a shorter max_tokens / max_prompt_tokens, or bigger GPUs"
        )
    running = options.max_running_requests or min(fits, MAX_RUNNING_REQUESTS_CAP)
    if options.max_running_requests is None:
        state_text = (
            f" + {state_per_request * (1 + draft_tokens) / BYTES_PER_MIB:.0f} MiB recurrent state"
            + (f" (x{1 + draft_tokens} with MTP drafts)" if draft_tokens else "")
            if state_per_request
            else ""
        )
        reasons.append(
            f"--max-running-requests {running}: {pool_bytes / BYTES_PER_GIB:.1f} GiB left in the static pool after "
            f"{weights / tp / BYTES_PER_GIB:.1f} GiB of weights / ({kv_per_request / BYTES_PER_MIB:.0f} MiB KV for "
            f"{request.request_tokens} tokens{state_text}) per request = {fits}"
            + (f", capped at {MAX_RUNNING_REQUESTS_CAP}" if fits > MAX_RUNNING_REQUESTS_CAP else "")
        )
    fields["max_running_requests"] = running
    graph_flag = cuda_graph_flag(accepted_flags)
    if graph_flag is not None:
        fields["cuda_graph_max_bs"] = min(running, CUDA_GRAPH_MAX_BS_CAP)
        reasons.append(
            f"{graph_flag} {fields['cuda_graph_max_bs']}: every running batch size replays a captured CUDA graph"
        )
    if shape.hybrid:
        reasons += _hybrid_cache_reasons(fleet, fields)
    return CapacityPlan(
        slot_fields=fields,
        max_inflight=inflight_with_margin(running),
        inflight_reason=_inflight_reason(running),
        reasons=reasons,
    )


def _inflight_reason(running: int) -> str:
    max_inflight = inflight_with_margin(running)
    return (
        f"dispatcher in flight per server: {max_inflight} ({running} running + a margin of "
        f"{max_inflight - running} so a finished request is replaced at once)"
    )


def _hybrid_cache_reasons(fleet: FleetConfig, fields: dict[str, Any]) -> list[str]:
    options = fleet.sglang
    if options.disable_radix_cache:
        return [
            "hybrid model, radix cache off (unique prompts share no prefix): sglang sizes the recurrent-state "
            "pool to exactly --max-running-requests, the most concurrency per GPU; "
            "the mamba cache strategy has no effect and is not passed"
        ]
    strategy = options.mamba_cache_strategy
    if strategy == "no_buffer":
        fields["disable_overlap_schedule"] = True
        return [
            "hybrid model, radix cache on with no_buffer: sglang requires --disable-overlap-schedule for it "
            "(mamba_hook.py); the state pool holds ~1/3 as many requests as with the radix cache off"
        ]
    return [
        f"hybrid model, radix cache on, strategy {strategy or 'auto (sglang: extra_buffer with the overlap schedule)'}"
        ": the state pool holds ~1/5 as many requests as with the radix cache off"
    ]


def inflight_with_margin(running: int) -> int:
    """The dispatcher's cap for a server with ``running`` slots: the slots plus a refill margin."""
    return running + max(MIN_INFLIGHT_MARGIN, math.ceil(running * INFLIGHT_MARGIN_SHARE))
