"""Generation engines: every engine rule behind one protocol (:class:`Engine`), see docs/engines.md.

:data:`ENGINES` is the one table of engines by their ``fleet.engine`` name (``EngineKind`` lists the same
names, checked on import); ``get_engine(kind)`` returns the recipe for ``fleet.engine``. :mod:`model_size`
reads a model's size and per-request state from its ``config.json``; :mod:`sglang_flags` asks the installed
sglang's own parser for its flags; :mod:`sglang_tuning` sizes SGLang servers, :mod:`cpu_sizing` CPU servers;
:mod:`router` is sglang-router's argv; :mod:`capacity` decides the dispatcher's in-flight cap per server,
once, for every engine (tuned, explicit config, the engine's sizing), reading ``datagen tune``'s result
(:mod:`tune_result`). Nothing here imports an engine package: availability is checked with
``importlib.util.find_spec`` so the orchestrator stays light.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import get_args

from datagen.config import EngineKind, RunConfig
from datagen.engines.base import COMMON_FATAL_LOG_PATTERNS, Engine, EngineRecipe, LaunchCommand, ServerSlot
from datagen.engines.external import ExternalEngine
from datagen.engines.router import ROUTER_PACKAGE
from datagen.engines.sglang import SGLangEngine
from datagen.engines.transformers import TransformersEngine
from datagen.errors import ConfigError

__all__ = [
    "COMMON_FATAL_LOG_PATTERNS",
    "ENGINES",
    "Engine",
    "ExternalEngine",
    "LaunchCommand",
    "SGLangEngine",
    "ServerSlot",
    "TransformersEngine",
    "engine_class",
    "engine_packages",
    "exact_tokens_enabled",
    "get_engine",
]

ENGINES: Mapping[str, type[EngineRecipe]] = {
    "transformers": TransformersEngine,
    "sglang": SGLangEngine,
    "external": ExternalEngine,
}
"""Every engine's recipe by its ``fleet.engine`` name: add an engine here (and its name to ``EngineKind``)."""
assert set(ENGINES) == set(get_args(EngineKind)), "EngineKind and ENGINES must name the same engines"
assert all(recipe.name == kind for kind, recipe in ENGINES.items()), "a recipe's name is its fleet.engine"


def engine_class(kind: EngineKind | str) -> type[EngineRecipe]:
    """The recipe class of an engine kind, for its class attributes, without building the recipe.

    Health/metrics paths, refused sampling fields and ``supports_generate`` are class attributes; building
    the sglang recipe asks the installed sglang for its flags (a subprocess), which reading them needs not.

    Raises:
        ConfigError: Unknown kind.

    """
    if kind not in ENGINES:
        raise ConfigError(f"unknown engine {kind!r}; use one of: {', '.join(ENGINES)}", kind=kind)
    return ENGINES[kind]


def engine_packages() -> tuple[str, ...]:
    """Every distribution the probe reports for the engines: each engine's in table order, then the router's."""
    names = [package for recipe in ENGINES.values() for package in recipe.packages]
    return (*dict.fromkeys(names), ROUTER_PACKAGE)


def get_engine(kind: EngineKind | str, accepted_flags: Collection[str] | None = None) -> Engine:
    """The launch recipe of an engine kind.

    Args:
        kind: A name of :data:`ENGINES` (as in ``fleet.engine``).
        accepted_flags: The launch flags a probe found the engine's install accepts (see
            ``EnvReport.engine_flags``); None: the recipe asks the install here, if its flags vary.

    Returns:
        The recipe; the sglang one has its flag names from ``accepted_flags`` or the installed sglang.

    Raises:
        ConfigError: Unknown kind.

    """
    recipe = engine_class(kind)
    return recipe.for_installed() if accepted_flags is None else recipe.for_flags(accepted_flags)


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
