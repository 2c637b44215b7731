"""SGLang (`python -m sglang.launch_server`): the production GPU engine.

Flag names are taken from the target sglang's own argument parser (:mod:`datagen.engines.sglang_flags`),
never guessed from its version: the hybrid-model cache strategy flag was renamed
(``--mamba-scheduler-strategy`` -> ``--mamba-radix-cache-strategy``) and ``--cuda-graph-max-bs`` became
``--cuda-graph-max-bs-decode``. Sizing lives in :mod:`datagen.engines.sglang_tuning`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Collection, Mapping
from typing import Any

from datagen.config import FleetConfig, ModelConfig
from datagen.engines.base import (
    CapacityPlan,
    CapacityRequest,
    EngineProblem,
    EngineRecipe,
    LaunchCommand,
    ServerSlot,
    compile_fatal_patterns,
    module_importable,
)
from datagen.engines.sglang_flags import sglang_flags
from datagen.engines.sglang_tuning import cuda_graph_flag, plan_sglang_capacity

logger = logging.getLogger(__name__)

MAMBA_FLAG_NEW = "--mamba-radix-cache-strategy"
MAMBA_FLAG_OLD = "--mamba-scheduler-strategy"
INSTALL_HINT = "pip install 'datagen[gpu]' on the GPU host"
SM90 = "9.0"
SM120 = "12.0"
# On SM120 (RTX PRO 6000 Blackwell) sglang rejects fa3/fa4 (and trtllm_mha lacks SM120): flashinfer runs.
SM120_ATTENTION_BACKEND = "flashinfer"
# On SM90 hybrid models run their full-attention layers on FlashAttention 3.
SM90_HYBRID_ATTENTION_BACKEND = "fa3"

# Its own fatal log lines; COMMON_FATAL_LOG_PATTERNS are added by compile_fatal_patterns.
SGLANG_FATAL_LOG_PATTERNS: tuple[str, ...] = (
    r"Not enough memory",
    r"RuntimeError: Initialization failed",
    r"launch_server\.py: error:",
)


def installed_server_flags() -> list[str] | None:
    """Flags of the sglang installed for this interpreter, from its own parser; None without sglang."""
    return sglang_flags()


def mamba_flag_from_flags(flags: Collection[str] | None) -> str | None:
    """Choose the cache-strategy flag among the flags an sglang accepts.

    Args:
        flags: What the target sglang accepts; None when unknown (no sglang here).

    Returns:
        The new flag name when accepted (or when unknown: plans made elsewhere target current sglang),
        the old name when only it is accepted, None when neither is.

    """
    if flags is None or MAMBA_FLAG_NEW in flags:
        return MAMBA_FLAG_NEW
    if MAMBA_FLAG_OLD in flags:
        return MAMBA_FLAG_OLD
    return None


def attention_backend_for(capability: str | None, hybrid: bool) -> tuple[str | None, str]:
    """The attention backend sglang needs on a GPU of ``capability`` (None: sglang's default), and why."""
    if capability == SM120:
        return SM120_ATTENTION_BACKEND, "SM 12.0: sglang rejects fa3/fa4 there (and for hybrid models)"
    if capability == SM90 and hybrid:
        return SM90_HYBRID_ATTENTION_BACKEND, "SM 9.0 with a hybrid model"
    return None, ""


class SGLangEngine(EngineRecipe):
    """Launch recipe for ``python -m sglang.launch_server``.

    Args:
        mamba_strategy_flag: The flag carrying ``fleet.sglang.mamba_cache_strategy``; None means the target
            sglang has no such flag. Use :meth:`for_installed` to detect it from the installed sglang.
        accepted_flags: Every flag the target sglang accepts (None: unknown, nothing is checked).

    """

    name = "sglang"
    metrics_path: str | None = "/metrics"
    supports_generate = True
    allows_exact_tokens = True
    fatal_log_patterns = compile_fatal_patterns(*SGLANG_FATAL_LOG_PATTERNS)
    supports_tensor_parallel = True
    launch_flags_vary = True
    packages = ("sglang", "flashinfer-python")

    def __init__(
        self, mamba_strategy_flag: str | None = MAMBA_FLAG_NEW, accepted_flags: Collection[str] | None = None
    ) -> None:
        self.mamba_strategy_flag = mamba_strategy_flag
        self.accepted_flags = frozenset(accepted_flags) if accepted_flags is not None else None

    @classmethod
    def for_flags(cls, flags: Collection[str] | None) -> SGLangEngine:
        """The recipe for an sglang accepting ``flags`` (None: unknown, current names assumed)."""
        return cls(mamba_strategy_flag=mamba_flag_from_flags(flags), accepted_flags=flags)

    @classmethod
    def for_installed(cls) -> SGLangEngine:
        """The recipe with flag names read from the sglang installed here (current names if none)."""
        return cls.for_flags(installed_server_flags())

    def check_available(self) -> list[str]:
        """Report whether sglang is importable here.

        Returns:
            One problem line with the install command when sglang is missing; empty otherwise.

        """
        if not module_importable("sglang"):
            return [f"sglang is not installed in {sys.executable}: {INSTALL_HINT}"]
        return []

    def plan_capacity(self, request: CapacityRequest, fleet: FleetConfig) -> CapacityPlan:
        """Memory share, running requests, CUDA-graph batch, hybrid cache mode, MTP, attention backend."""
        plan = plan_sglang_capacity(request, fleet, self.accepted_flags)
        hybrid = request.shape is not None and request.shape.hybrid
        backend, why = attention_backend_for(request.compute_capability, hybrid)
        if backend is not None and not fleet.sglang.attention_backend:
            plan.slot_fields["attention_backend"] = backend
            plan.reasons.append(f"--attention-backend {backend}: {why}")
        return plan

    def host_problems(
        self, packages: Mapping[str, str | None], compute_capabilities: list[str]
    ) -> list[EngineProblem]:
        """Report a missing sglang or flashinfer, and the SM 12.0 attention restriction."""
        problems: list[EngineProblem] = []
        if packages and packages.get("sglang") is None:
            return [
                EngineProblem(
                    "info",
                    "sglang is not installed: only the transformers engine can serve here",
                    "`pip install 'datagen[gpu]'` on this host to use fleet.engine: sglang",
                )
            ]
        if SM120 in compute_capabilities:
            backend, why = attention_backend_for(SM120, hybrid=True)
            problems.append(
                EngineProblem(
                    "info",
                    f"SM 12.0 GPUs: {why}",
                    f"nothing to do: the planner passes --attention-backend {backend} on SM 12.0",
                )
            )
        if packages.get("sglang") is not None and packages.get("flashinfer-python") is None:
            problems.append(
                EngineProblem(
                    "warning",
                    "sglang is installed without flashinfer-python",
                    "`pip install flashinfer-python` at the version sglang pins",
                )
            )
        return problems

    def build_launch(self, slot: ServerSlot, model: ModelConfig, fleet: FleetConfig) -> LaunchCommand:
        """The argv and env of one SGLang server.

        Args:
            slot: GPUs of the server (its tensor-parallel size is their count), where it listens, and the
                planned sizing (:meth:`plan_capacity`).
            model: Model path, tokenizer, served name, context length.
            fleet: ``fleet.sglang`` knobs, ``extra_args`` (appended last) and ``env``.

        Returns:
            The launch command.

        Raises:
            ValueError: A cache strategy is configured but the target sglang has no flag for it, or a
                flag is not accepted by the sglang whose flags the recipe knows.

        """
        options = fleet.sglang
        argv: list[str] = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            model.path,
            "--host",
            slot.host,
            "--port",
            str(slot.port),
            "--tp-size",
            str(max(1, len(slot.gpu_ids))),
            "--served-model-name",
            self.served_model_name(model),
            "--enable-metrics",
        ]
        if model.tokenizer_path:
            argv += ["--tokenizer-path", model.tokenizer_path]
        context = model.max_model_len_tokens or slot.context_length_tokens
        if context is not None:
            argv += ["--context-length", str(context)]
        # Explicit config wins over the planner's choice, which wins over sglang's own default.
        backend = options.attention_backend or slot.attention_backend
        if backend is None:
            backend, _ = attention_backend_for(slot.compute_capability, hybrid=False)
        if backend is not None:
            argv += ["--attention-backend", backend]
        mem_fraction = options.mem_fraction_static or slot.mem_fraction_static
        if mem_fraction is not None:
            argv += ["--mem-fraction-static", f"{mem_fraction:g}"]
        max_running = options.max_running_requests or slot.max_running_requests
        if max_running is not None:
            argv += ["--max-running-requests", str(max_running)]
        if slot.chunked_prefill_tokens is not None:
            argv += ["--chunked-prefill-size", str(slot.chunked_prefill_tokens)]
        graph_flag = cuda_graph_flag(self.accepted_flags)
        if slot.cuda_graph_max_bs is not None and graph_flag is not None:
            argv += [graph_flag, str(slot.cuda_graph_max_bs)]
        if options.disable_radix_cache:
            argv.append("--disable-radix-cache")
        elif options.mamba_cache_strategy is not None:
            # With the radix cache off the strategy has no effect (sglang returns before reading it).
            if self.mamba_strategy_flag is None:
                raise ValueError(
                    "fleet.sglang.mamba_cache_strategy is set but the target sglang has neither "
                    f"{MAMBA_FLAG_NEW} nor {MAMBA_FLAG_OLD}: upgrade sglang or unset the option"
                )
            argv += [self.mamba_strategy_flag, options.mamba_cache_strategy]
        if slot.disable_overlap_schedule or (
            not options.disable_radix_cache and options.mamba_cache_strategy == "no_buffer"
        ):
            argv.append("--disable-overlap-schedule")
        if options.reasoning_parser:
            argv += ["--reasoning-parser", options.reasoning_parser]
        if options.tool_call_parser:
            argv += ["--tool-call-parser", options.tool_call_parser]
        argv += slot.speculative_args
        argv += speculative_args(options.speculative or {})
        argv += fleet.extra_args
        self._check_flags(argv)
        return self.launch_command(argv, slot, fleet)

    def _check_flags(self, argv: list[str]) -> None:
        if self.accepted_flags is None:
            return
        unknown = [
            arg for arg in argv[3:] if arg.startswith("--") and arg.split("=")[0] not in self.accepted_flags
        ]
        if unknown:
            raise ValueError(
                f"the target sglang does not accept {', '.join(unknown)}: remove them from fleet.extra_args / "
                "fleet.sglang, or upgrade sglang"
            )

    def api_key_args(self, key_file: str) -> list[str]:
        """``--config KEY_FILE``: sglang reads ``api-key`` from that YAML file (0.5.14 and later).

        sglang merges a config file's options under the command line's, so the key stays out of the argv.
        """
        return ["--config", key_file]


def speculative_args(options: dict[str, Any]) -> list[str]:
    """Turn ``{algorithm: EAGLE, num_steps: 3}`` into ``--speculative-algorithm EAGLE ...``.

    Args:
        options: Speculative flags without the ``speculative-`` prefix (a prefix given anyway is kept
            once); True means a bare flag, False/None drop it.

    Returns:
        The argv fragment, in the mapping's order.

    """
    argv: list[str] = []
    for key, value in options.items():
        name = key.strip("-").replace("_", "-")
        if not name.startswith("speculative-"):
            name = f"speculative-{name}"
        if value is None or value is False:
            continue
        if value is True:
            argv.append(f"--{name}")
        else:
            argv += [f"--{name}", str(value)]
    return argv
