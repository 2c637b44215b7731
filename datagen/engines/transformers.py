"""``transformers serve --continuous-batching``: CPU engine (laptops, CI, demo), GPU engine of the H200 hosts.

Only flags present in both transformers 5.17 (the H200 hosts) and 5.24 (the project venv) are used.
"""

from __future__ import annotations

import sys

from datagen.config import FleetConfig, ModelConfig
from datagen.engines.base import (
    EngineRecipe,
    LaunchCommand,
    ServerSlot,
    compile_fatal_patterns,
    module_importable,
)

# What `transformers[serving]` adds on top of transformers (see transformers.utils.is_serve_available).
SERVING_MODULES: tuple[str, ...] = ("torch", "fastapi", "uvicorn", "openai", "pydantic")
INSTALL_HINT = "pip install 'datagen[local]'"

# Its own fatal log lines; COMMON_FATAL_LOG_PATTERNS are added by compile_fatal_patterns.
TRANSFORMERS_FATAL_LOG_PATTERNS: tuple[str, ...] = (r"Missing dependencies for serving",)


class TransformersEngine(EngineRecipe):
    """Launch recipe for ``python -m transformers.cli.transformers serve``.

    It has no API key option (its servers must stay on the loopback address), and continuous batching
    sizes itself from free memory, so the dispatcher keeps the configured cap (``datagen tune`` measures
    the best in-flight count on a live fleet). Missing transformers is reported by preflight (engine
    availability), not by the probe.
    """

    name = "transformers"
    packages = ("transformers",)
    # `transformers serve` has no Prometheus endpoint: `datagen tune` measures throughput client-side.
    # `transformers serve` answers 422 to top_k and min_p in chat completions.
    unsupported_sampling_fields = frozenset({"top_k", "min_p"})
    # `transformers serve` speaks only the OpenAI API: no token ids in or out.
    fatal_log_patterns = compile_fatal_patterns(*TRANSFORMERS_FATAL_LOG_PATTERNS)
    # One server is one model on one device: transformers serve has no tensor parallelism (the default).
    configured_cap_note = "fleet.max_inflight_per_server; `datagen tune` measures the best value"

    def check_available(self) -> list[str]:
        """Report missing serving packages, with the install command.

        Returns:
            One problem line per missing module group; empty when the engine can start.

        """
        missing = [module for module in ("transformers", *SERVING_MODULES) if not module_importable(module)]
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
        return self.launch_command(argv, slot, fleet)

    def served_model_name(self, model: ModelConfig) -> str:
        """The name ``transformers serve`` gives the preloaded model: the path it was given."""
        return model.path
