"""``transformers serve --continuous-batching``: CPU engine (laptops, CI, demo), GPU engine of the H200 hosts.

Only flags present in both transformers 5.17 (the H200 hosts) and 5.24 (the project venv) are used.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping

from datagen.config import FleetConfig, ModelConfig
from datagen.engines.base import (
    COMMON_FATAL_LOG_PATTERNS,
    CapacityPlan,
    CapacityRequest,
    EngineProblem,
    LaunchCommand,
    ServerSlot,
    compile_patterns,
    gpu_env,
)

# What `transformers[serving]` adds on top of transformers (see transformers.utils.is_serve_available).
SERVING_MODULES: tuple[str, ...] = ("torch", "fastapi", "uvicorn", "openai", "pydantic")
INSTALL_HINT = "pip install 'datagen[local]'"

TRANSFORMERS_FATAL_LOG_PATTERNS: tuple[str, ...] = (
    *COMMON_FATAL_LOG_PATTERNS,
    r"Missing dependencies for serving",
)


class TransformersEngine:
    """Launch recipe for ``python -m transformers.cli.transformers serve``."""

    name = "transformers"
    health_path = "/health"
    # `transformers serve` has no Prometheus endpoint: `datagen tune` measures throughput client-side.
    metrics_path: str | None = None
    # `transformers serve` answers 422 to top_k and min_p in chat completions.
    unsupported_sampling_fields = frozenset({"top_k", "min_p"})
    # `transformers serve` speaks only the OpenAI API: no token ids in or out.
    supports_generate = False
    allows_exact_tokens = False
    fatal_log_patterns = compile_patterns(TRANSFORMERS_FATAL_LOG_PATTERNS)
    # One server is one model on one device: transformers serve has no tensor parallelism.
    supports_tensor_parallel = False
    launches_processes = True

    def check_available(self) -> list[str]:
        """Report missing serving packages, with the install command.

        Returns:
            One problem line per missing module group; empty when the engine can start.

        """
        missing = [module for module in ("transformers", *SERVING_MODULES) if not _importable(module)]
        if missing:
            return [f"transformers serving deps missing ({', '.join(missing)}): {INSTALL_HINT}"]
        return []

    def build_launch(self, slot: ServerSlot, model: ModelConfig, fleet: FleetConfig) -> LaunchCommand:
        """The argv and env of one ``transformers serve`` process.

        Args:
            slot: Where the server runs; GPU slots are pinned with ``CUDA_VISIBLE_DEVICES`` and then see
                their GPU as ``cuda:0``.
            model: The served model (its path is the model the server preloads and names itself after).
            fleet: ``extra_args`` are appended and ``env`` merged over the engine's own variables.

        Returns:
            The launch command.

        """
        device = "cpu" if slot.device == "cpu" else "cuda:0"
        argv = [
            sys.executable,
            "-m",
            "transformers.cli.transformers",
            "serve",
            "--continuous-batching",
            "--device",
            device,
            "--host",
            slot.host,
            "--port",
            str(slot.port),
            model.path,
        ]
        if slot.cache_num_blocks is not None:
            # Sized by tokens: a share of free RAM grows with the host and the attention masks grow with
            # the cache, so a memory share alone made one tiny-model CPU server take ~4 GiB.
            argv += ["--cb-num-blocks", str(slot.cache_num_blocks)]
        elif slot.cache_memory_fraction is not None:
            # Unset, each CPU server's paged cache takes 60% of free RAM: two servers exhaust the host.
            argv += ["--cb-max-memory-percent", f"{slot.cache_memory_fraction:g}"]
        if slot.max_batch_tokens is not None:
            argv += ["--cb-max-batch-tokens", str(slot.max_batch_tokens)]
        # Last, so a flag repeated in extra_args overrides the recipe's (click keeps the last value).
        argv += fleet.extra_args
        return LaunchCommand(argv=argv, env={**gpu_env(slot), **slot.extra_env, **fleet.env})

    def served_model_name(self, model: ModelConfig) -> str:
        """The name ``transformers serve`` gives the preloaded model: the path it was given."""
        return model.path

    def api_key_args(self, key_file: str) -> None:
        """`transformers serve` has no API key option: its servers must stay on the loopback address."""
        return None

    def plan_capacity(self, request: CapacityRequest, fleet: FleetConfig) -> CapacityPlan:
        """Continuous batching sizes itself from free memory: the dispatcher keeps the configured cap.

        ``datagen tune`` measures the best in-flight count on a live fleet (no /metrics here).
        """
        return CapacityPlan(
            max_inflight=request.configured_inflight,
            inflight_reason=(
                f"in flight per server: {request.configured_inflight} (fleet.max_inflight_per_server; "
                "`datagen tune` measures the best value)"
            ),
        )

    def host_problems(
        self, packages: Mapping[str, str | None], compute_capabilities: list[str]
    ) -> list[EngineProblem]:
        """Missing transformers is reported by preflight (engine availability), not by the probe."""
        return []


def _importable(module: str) -> bool:
    # find_spec locates the package without importing it (importing torch costs seconds).
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
