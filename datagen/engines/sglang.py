"""SGLang (`python -m sglang.launch_server`): the production GPU engine.

Flag names are detected from the installed sglang's source rather than guessed from its version: the
hybrid-model cache strategy flag was renamed (``--mamba-scheduler-strategy`` ->
``--mamba-radix-cache-strategy``) and the old name is gone in recent releases.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from datagen.config import FleetConfig, ModelConfig
from datagen.engines.base import (
    COMMON_FATAL_LOG_PATTERNS,
    LaunchCommand,
    ServerSlot,
    compile_patterns,
    gpu_env,
)

logger = logging.getLogger(__name__)

MAMBA_FLAG_NEW = "--mamba-radix-cache-strategy"
MAMBA_FLAG_OLD = "--mamba-scheduler-strategy"
INSTALL_HINT = "pip install 'datagen[gpu]' on the GPU host"

# On SM120 (Blackwell workstation) hybrid models only run with flashinfer among the backends sglang allows.
SM120_ATTENTION_BACKEND = "flashinfer"

# A quoted flag literal: argparse definitions and aliases (every release).
_QUOTED_FLAG = re.compile(r"""["'](--[a-z0-9][a-z0-9-]*)["']""")
# A ServerArgs dataclass field declared as ``name: A[...]``: recent releases derive ``--name`` from it.
_ANNOTATED_FIELD = re.compile(r"^    ([a-z_][a-z0-9_]*): A\[", re.MULTILINE)
_NO_CLI = re.compile(r"no_cli\s*=\s*True")

SGLANG_FATAL_LOG_PATTERNS: tuple[str, ...] = (
    *COMMON_FATAL_LOG_PATTERNS,
    r"Not enough memory",
    r"RuntimeError: Initialization failed",
    r"launch_server\.py: error:",
)


def find_server_args_source() -> Path | None:
    """Locate ``sglang/srt/server_args.py`` of the installed sglang without importing sglang.

    Returns:
        The file, or None when sglang is not installed.

    """
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "srt" / "server_args.py"
        if candidate.is_file():
            return candidate
    return None


def parse_server_args_flags(source: str) -> list[str]:
    """Every launch flag sglang's ``server_args.py`` defines.

    Older releases spell each flag in ``parser.add_argument("--tp-size", ...)``; recent ones derive it
    from the ``ServerArgs`` field (``tp_size: A[...]`` -> ``--tp-size``) unless the field says
    ``no_cli=True``, and spell only aliases and deprecated names. Both are read.

    Args:
        source: Text of ``server_args.py``.

    Returns:
        The flags, sorted.

    """
    flags = set(_QUOTED_FLAG.findall(source))
    fields = list(_ANNOTATED_FIELD.finditer(source))
    for field, following in zip(fields, [*fields[1:], None], strict=False):
        block = source[field.start() : following.start() if following else len(source)]
        if not _NO_CLI.search(block):
            flags.add("--" + field.group(1).replace("_", "-"))
    return sorted(flags)


def installed_server_flags() -> list[str] | None:
    """:func:`parse_server_args_flags` of the installed sglang; None when sglang is not installed."""
    path = find_server_args_source()
    return parse_server_args_flags(path.read_text(encoding="utf-8")) if path else None


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


def detect_mamba_strategy_flag(server_args_source: str | None) -> str | None:
    """:func:`mamba_flag_from_flags` for the text of ``server_args.py`` (None: sglang absent)."""
    if server_args_source is None:
        return MAMBA_FLAG_NEW
    return mamba_flag_from_flags(parse_server_args_flags(server_args_source))


def installed_mamba_strategy_flag() -> str | None:
    """:func:`detect_mamba_strategy_flag` applied to the installed sglang (if any)."""
    return mamba_flag_from_flags(installed_server_flags())


class SGLangEngine:
    """Launch recipe for ``python -m sglang.launch_server``.

    Args:
        mamba_strategy_flag: The flag carrying ``fleet.sglang.mamba_cache_strategy``; None means the target
            sglang has no such flag. Use :meth:`for_installed` to detect it from the installed sglang.

    """

    name = "sglang"
    health_path = "/health"
    fatal_log_patterns = compile_patterns(SGLANG_FATAL_LOG_PATTERNS)
    supports_tensor_parallel = True
    launches_processes = True

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
        """The recipe with flag names detected from the sglang installed here (current names if none)."""
        return cls.for_flags(installed_server_flags())

    def check_available(self) -> list[str]:
        """Report whether sglang is importable here.

        Returns:
            One problem line with the install command when sglang is missing; empty otherwise.

        """
        try:
            found = importlib.util.find_spec("sglang") is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return [f"sglang is not installed in {sys.executable}: {INSTALL_HINT}"]
        return []

    def build_launch(self, slot: ServerSlot, model: ModelConfig, fleet: FleetConfig) -> LaunchCommand:
        """The argv and env of one SGLang server.

        Args:
            slot: GPUs of the server (its tensor-parallel size is their count) and where it listens.
            model: Model path, tokenizer, served name, context length.
            fleet: ``fleet.sglang`` knobs, ``extra_args`` (appended last) and ``env``.

        Returns:
            The launch command.

        Raises:
            ValueError: A cache strategy is configured but the installed sglang has no flag for it, or a
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
        if backend is None and slot.compute_capability == "12.0":
            backend = SM120_ATTENTION_BACKEND
        if backend is not None:
            argv += ["--attention-backend", backend]
        mem_fraction = options.mem_fraction_static or slot.mem_fraction_static
        if mem_fraction is not None:
            argv += ["--mem-fraction-static", f"{mem_fraction:g}"]
        max_running = options.max_running_requests or slot.max_running_requests
        if max_running is not None:
            argv += ["--max-running-requests", str(max_running)]
        if options.disable_radix_cache:
            argv.append("--disable-radix-cache")
        if options.reasoning_parser:
            argv += ["--reasoning-parser", options.reasoning_parser]
        if options.tool_call_parser:
            argv += ["--tool-call-parser", options.tool_call_parser]
        if options.mamba_cache_strategy is not None:
            if self.mamba_strategy_flag is None:
                raise ValueError(
                    "fleet.sglang.mamba_cache_strategy is set but the installed sglang has neither "
                    f"{MAMBA_FLAG_NEW} nor {MAMBA_FLAG_OLD}: upgrade sglang or unset the option"
                )
            argv += [self.mamba_strategy_flag, options.mamba_cache_strategy]
        argv += speculative_args(options.speculative or {})
        argv += fleet.extra_args
        self._check_flags(argv)
        return LaunchCommand(argv=argv, env={**gpu_env(slot), **slot.extra_env, **fleet.env})

    def _check_flags(self, argv: list[str]) -> None:
        if self.accepted_flags is None:
            return
        unknown = [
            arg for arg in argv[3:] if arg.startswith("--") and arg.split("=")[0] not in self.accepted_flags
        ]
        if unknown:
            raise ValueError(
                f"the installed sglang does not accept {', '.join(unknown)}: remove them from fleet.extra_args / "
                "fleet.sglang, or upgrade sglang"
            )

    def served_model_name(self, model: ModelConfig) -> str:
        """The configured served name, else the model path."""
        return model.served_name or model.path


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
