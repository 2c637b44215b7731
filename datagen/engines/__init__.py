"""Generation engines: every engine rule behind one protocol (:class:`Engine`), see docs/engines.md.

``get_engine(kind)`` returns the recipe for ``fleet.engine``; :mod:`model_size` reads a model's size and
per-request state from its ``config.json``; :mod:`sglang_flags` asks the installed sglang's own parser for
its flags; :mod:`sglang_tuning` sizes SGLang servers, :mod:`cpu_sizing` CPU servers; :mod:`router` is
sglang-router's argv; :mod:`capacity` decides the dispatcher's in-flight cap per server, once, for every
engine (tuned, explicit config, the engine's sizing), reading ``datagen tune``'s result (:mod:`tune_result`).
Nothing here imports an engine package: availability is checked with ``importlib.util.find_spec`` so the
orchestrator stays light.
"""

from __future__ import annotations

from datagen.config import EngineKind, RunConfig
from datagen.engines.base import COMMON_FATAL_LOG_PATTERNS, Engine, LaunchCommand, ServerSlot
from datagen.engines.external import ExternalEngine
from datagen.engines.sglang import SGLangEngine
from datagen.engines.transformers import TransformersEngine
from datagen.errors import ConfigError

__all__ = [
    "COMMON_FATAL_LOG_PATTERNS",
    "Engine",
    "ExternalEngine",
    "LaunchCommand",
    "SGLangEngine",
    "ServerSlot",
    "TransformersEngine",
    "engine_class",
    "exact_tokens_enabled",
    "get_engine",
]

_ENGINE_CLASSES: dict[str, type[ExternalEngine] | type[SGLangEngine] | type[TransformersEngine]] = {
    "transformers": TransformersEngine,
    "sglang": SGLangEngine,
    "external": ExternalEngine,
}


def engine_class(
    kind: EngineKind | str,
) -> type[ExternalEngine] | type[SGLangEngine] | type[TransformersEngine]:
    """The recipe class of an engine kind, for its class attributes, without building the recipe.

    Health/metrics paths, refused sampling fields and ``supports_generate`` are class attributes; building
    the sglang recipe asks the installed sglang for its flags (a subprocess), which reading them needs not.

    Raises:
        ConfigError: Unknown kind.

    """
    if kind not in _ENGINE_CLASSES:
        raise ConfigError(f"unknown engine {kind!r}; use one of: transformers, sglang, external", kind=kind)
    return _ENGINE_CLASSES[kind]


def get_engine(kind: EngineKind | str) -> Engine:
    """The launch recipe of an engine kind.

    Args:
        kind: ``transformers``, ``sglang`` or ``external`` (as in ``fleet.engine``).

    Returns:
        The recipe; the sglang one has its flag names detected from the installed sglang.

    Raises:
        ConfigError: Unknown kind.

    """
    if kind == "transformers":
        return TransformersEngine()
    if kind == "sglang":
        return SGLangEngine.for_installed()
    if kind == "external":
        return ExternalEngine()
    raise ConfigError(f"unknown engine {kind!r}; use one of: transformers, sglang, external", kind=kind)


def exact_tokens_enabled(config: RunConfig) -> bool:
    """Whether the run generates in exact-token mode (``/generate``), from the config and the engine.

    Args:
        config: The run config; ``generation.exact_tokens`` unset means the engine's default.

    Returns:
        True to send token ids to ``/generate``; False for the OpenAI chat-completions path.

    Raises:
        ConfigError: ``generation.exact_tokens`` is true for an engine that has no ``/generate``.

    """
    rules = engine_class(config.fleet.engine)
    requested = config.generation.exact_tokens
    if requested is None:
        return rules.supports_generate
    if requested and not rules.allows_exact_tokens:
        raise ConfigError(
            f"generation.exact_tokens: true needs SGLang's /generate endpoint, and engine "
            f"{config.fleet.engine!r} has none (it serves only the OpenAI chat API). Remove the setting (or set it "
            "to false) to generate through chat completions, or use fleet.engine: sglang.",
            engine=config.fleet.engine,
        )
    return requested
