"""Only ``datagen/engines/`` tells engines apart by name: everything else asks ``ENGINES`` for a capability.

Every module of the core, the tasks and the flows is parsed (never imported); a comparison (``==``, ``!=``,
``in``, ``not in``) or a ``match`` case against an engine's ``fleet.engine`` name fails the test, so adding an
engine means its recipe and its row in ``ENGINES``, not a hunt for the places that test names.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from datagen.engines import ENGINES

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("datagen", "flows", "tasks")
ENGINES_PACKAGE = Path("datagen", "engines")
# The config schema sits below the engines (it cannot read ENGINES without an import cycle) and refuses a
# config on load: its two rules name the engine whose fields they are (external_urls for `external`, MTP's
# flags for `sglang`). Everything that acts on a config asks the engine's recipe.
SCHEMA_MODULES = frozenset({Path("datagen", "config", "fleet.py")})


def string_constants(node: ast.expr) -> Iterator[str]:
    """The string literals of an expression: itself, or the items of a tuple, list or set literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.Tuple | ast.List | ast.Set):
        for item in node.elts:
            yield from string_constants(item)


def engine_name_tests(source: str, names: frozenset[str]) -> list[tuple[int, str]]:
    """Every comparison or ``match`` case of ``source`` against one of ``names``: (line, code)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(value in names for side in sides for value in string_constants(side)):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.match_case):
            patterns = [node.pattern, *getattr(node.pattern, "patterns", [])]
            for pattern in patterns:
                if isinstance(pattern, ast.MatchValue) and set(string_constants(pattern.value)) & names:
                    found.append((pattern.value.lineno, ast.unparse(pattern.value)))
    return found


def modules_outside_engines() -> Iterator[Path]:
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            relative = path.relative_to(REPO)
            if not relative.is_relative_to(ENGINES_PACKAGE) and relative not in SCHEMA_MODULES:
                yield relative


def test_nothing_outside_the_engines_compares_against_an_engine_name() -> None:
    names = frozenset(ENGINES)
    offenders = [
        f"{path}:{line}: {code}"
        for path in modules_outside_engines()
        for line, code in engine_name_tests((REPO / path).read_text(encoding="utf-8"), names)
    ]
    assert not offenders, "ask ENGINES for a capability instead of testing a name:\n" + "\n".join(offenders)


def test_the_check_sees_every_form_of_a_name_test() -> None:
    source = """
if engine == "sglang": pass
if "external" != kind: pass
if kind in ("transformers", "other"): pass
if kind not in {"sglang"}: pass
match kind:
    case "external": pass
    case "x" | "sglang": pass
"""
    lines = sorted(line for line, _ in engine_name_tests(source, frozenset(ENGINES)))
    assert lines == [2, 3, 4, 5, 7, 8]
    assert engine_name_tests('if package == "torch": pass\nname = "sglang"', frozenset(ENGINES)) == []
