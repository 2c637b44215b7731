"""How CPU servers (``transformers serve --continuous-batching``) share a small box: threads and a KV cache.

Several CPU servers run side by side on a laptop or CI box, so each gets its share of the cores and a KV cache
sized by tokens (``--cb-num-blocks``) instead of a memory share: the cache holds the configured in-flight
requests at their longest, within :data:`CPU_CACHE_MEMORY_FRACTION` of the RAM free now (``/proc/meminfo``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from datagen.engines.model_size import BYTES_PER_MIB, ModelShape
from datagen.processes import usable_cores

# Share of the host's free RAM that all CPU servers' KV caches may take together (the rest is for the
# models, the flow, and everything else on a laptop or CI box).
CPU_CACHE_MEMORY_FRACTION = 0.3
# `transformers serve` continuous batching: tokens per cache page (its default page_size).
CB_PAGE_TOKENS = 256
# Tokens per forward step of a CPU server. The attention masks it allocates grow with this times the
# cache size; 512 keeps one tiny-model server's masks at a few hundred MiB.
CPU_MAX_BATCH_TOKENS = 512
# Bytes per element of the CPU attention masks (float32 activations).
CPU_MASK_BYTES = 4
MEMINFO = Path("/proc/meminfo")


def cpu_slot_fields(
    shape: ModelShape | None, request_tokens: int, configured_inflight: int, servers: int
) -> tuple[dict[str, Any], str]:
    """Size each of ``servers`` CPU servers.

    Args:
        shape: The model's size; None when unknown (the cache then gets a share of free RAM instead).
        request_tokens: Prompt + answer tokens one request may occupy.
        configured_inflight: ``fleet.max_inflight_per_server``: the requests the cache is sized for.
        servers: CPU servers sharing this box.

    Returns:
        The ``ServerSlot`` fields of each server and the plan's reason line.

    """
    cores = usable_cores()
    threads = max(1, cores // servers)
    fields: dict[str, Any] = {"cpu_threads": threads}
    if shape is None:
        fraction = round(CPU_CACHE_MEMORY_FRACTION / servers, 4)
        fields["cache_memory_fraction"] = fraction
        return fields, (
            f"{servers} CPU server(s) share {cores} cores and {CPU_CACHE_MEMORY_FRACTION:.0%} of free "
            f"RAM for KV caches: {threads} thread(s) and {fraction:.1%} of free RAM each (model size unknown)"
        )
    cache_tokens = configured_inflight * request_tokens
    per_token = shape.kv_bytes_per_token(shape.dtype_bytes) + CPU_MAX_BATCH_TOKENS * CPU_MASK_BYTES
    available = available_ram_bytes()
    if available is not None:
        share = CPU_CACHE_MEMORY_FRACTION * available / servers
        cache_tokens = max(CB_PAGE_TOKENS, min(cache_tokens, int(share // per_token)))
    blocks = math.ceil(cache_tokens / CB_PAGE_TOKENS)
    fields |= {"cache_num_blocks": blocks, "max_batch_tokens": CPU_MAX_BATCH_TOKENS}
    return fields, (
        f"{servers} CPU server(s) share {cores} cores: {threads} thread(s) each; KV cache sized by "
        f"tokens: {blocks} blocks of {CB_PAGE_TOKENS} ({configured_inflight} requests x "
        f"{request_tokens} tokens, ~{blocks * CB_PAGE_TOKENS * per_token / BYTES_PER_MIB:.0f} MiB with masks), "
        f"{CPU_MAX_BATCH_TOKENS} tokens per step"
    )


def available_ram_bytes() -> int | None:
    """``MemAvailable`` of this box, None when ``/proc/meminfo`` cannot be read (not Linux)."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
