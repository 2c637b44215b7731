"""The import contract of the core: no Prefect, no flows or tasks, stages import only lower stages, no cycles.

Every module under ``datagen/`` is parsed (never imported), and every import statement counts: at module
level, inside functions, under ``if TYPE_CHECKING``. docs/architecture.md draws the same map.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "datagen"

# Top-level packages the core must never import: the orchestration layer sits on top of the core.
FORBIDDEN_PACKAGES = frozenset({"prefect", "flows", "tasks"})
# The modules every stage shares, at the top of the package.
SHARED = "shared"
SHARED_MODULES = frozenset(
    {
        "config",
        "settings",
        "errors",
        "records",
        "samples",
        "templates",
        "processes",
        "literals",
        "escape",
        "progress",
        "conversation_turns",
    }
)
STAGES = ("output", "dataset", "engines", "host", "prompts", "generation", "app")
# What each layer may import (itself included); the app layer composes everything.
ALLOWED_LAYERS: Mapping[str, frozenset[str]] = {
    SHARED: frozenset({SHARED}),
    "output": frozenset({SHARED, "output"}),
    "dataset": frozenset({SHARED, "output", "dataset"}),
    "engines": frozenset({SHARED, "engines"}),
    "host": frozenset({SHARED, "engines", "output", "host"}),
    "prompts": frozenset({SHARED, "output", "dataset", "prompts"}),
    "generation": frozenset({SHARED, "engines", "output", "dataset", "generation"}),
    "app": frozenset({SHARED, *STAGES}),
}


def module_name(path: Path) -> str:
    """``datagen/host/fleet.py`` -> ``datagen.host.fleet``; a package's ``__init__`` is the package."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def core_sources() -> dict[str, str]:
    """Every module of the core by name, with its source."""
    return {module_name(path): path.read_text() for path in sorted(CORE.rglob("*.py"))}


def layer_of(module: str) -> str:
    """The layer of a ``datagen`` module: a stage, or ``shared`` for the top level."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in SHARED_MODULES:
        return SHARED
    if parts[1] not in STAGES:
        raise AssertionError(f"{module} is in no layer: add its folder to STAGES or SHARED_MODULES")
    return parts[1]


def imported_modules(module: str, source: str, known: Iterable[str] = ()) -> set[str]:
    """Every module ``source`` imports, at any depth of the tree.

    Args:
        module: The name of the module the source belongs to (resolves relative imports).
        source: Its Python source.
        known: The modules of the core: ``from package import name`` counts as an import of
            ``package.name`` when that is a module.
    """
    modules = set(known)
    package = module if module in modules and _is_package(module) else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules)
    return found


def _is_package(module: str) -> bool:
    return (REPO / Path(*module.split(".")) / "__init__.py").is_file()


def contract_violations(module: str, source: str, known: Iterable[str] = ()) -> list[str]:
    """The imports of ``module`` that break the contract, one line each."""
    own_layer = layer_of(module)
    problems = []
    for target in sorted(imported_modules(module, source, known)):
        top = target.split(".")[0]
        if top in FORBIDDEN_PACKAGES:
            problems.append(f"{module} imports {target}: the core never imports {top}")
        elif top == "datagen" and layer_of(target) not in ALLOWED_LAYERS[own_layer]:
            problems.append(
                f"{module} ({own_layer}) imports {target} ({layer_of(target)}): {own_layer} may import only "
                f"{', '.join(sorted(ALLOWED_LAYERS[own_layer]))}"
            )
    return problems


def import_graph(sources: Mapping[str, str]) -> dict[str, set[str]]:
    """Module -> the core modules it imports (function-level imports included)."""
    return {
        module: {target for target in imported_modules(module, source, sources) if target in sources}
        - {module}
        for module, source in sources.items()
    }


def import_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = lowlink[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                lowlink[node] = min(lowlink[node], lowlink[target])
            elif target in on_stack:
                lowlink[node] = min(lowlink[node], index[target])
        if lowlink[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_every_core_module_keeps_the_import_contract() -> None:
    sources = core_sources()
    problems = [
        line for module, source in sources.items() for line in contract_violations(module, source, sources)
    ]
    assert problems == []


def test_the_core_has_no_import_cycle_even_through_imports_inside_functions() -> None:
    assert import_cycles(import_graph(core_sources())) == []


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("datagen.output.x", "from flows.expand import expand\n", "datagen.output.x imports flows.expand"),
        ("datagen.host.fleet", "def f():\n    import prefect\n", "the core never imports prefect"),
        ("datagen.records", "from tasks.data import prepare_prompts\n", "the core never imports tasks"),
        ("datagen.output.x", "from datagen.app.cli import main\n", "imports datagen.app.cli (app)"),
        (
            "datagen.dataset.report",
            "from datagen.prompts.mix import mix_table\n",
            "(dataset) imports datagen",
        ),
        ("datagen.records", "def f():\n    from datagen.config import RunConfig\n", None),
        ("datagen.config", "from datagen.prompts import mix\n", "imports datagen.prompts.mix (prompts)"),
        ("datagen.prompts.prepare", "from ..generation import shard\n", "imports datagen.generation.shard"),
        (
            "datagen.engines.base",
            "import datagen.host.probe\n",
            "(engines) imports datagen.host.probe (host)",
        ),
    ],
)
def test_a_wrong_import_is_reported(module: str, source: str, expected: str | None) -> None:
    problems = contract_violations(module, source, core_sources())
    if expected is None:
        assert problems == []
    else:
        assert any(expected in line for line in problems), problems


def test_an_import_cycle_inside_functions_is_found() -> None:
    sources = {
        "datagen.config": "def f():\n    from datagen.prompts.mix import plan_mix\n",
        "datagen.prompts.mix": "from datagen.config import RunConfig\n",
        "datagen.records": "from datagen.errors import DatagenError\n",
        "datagen.errors": "",
    }
    assert import_cycles(import_graph(sources)) == [["datagen.config", "datagen.prompts.mix"]]
