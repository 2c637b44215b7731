"""No room too big: every module of the product at most 600 lines, every class at most 300 (P14).

The product is ``datagen/``, ``flows/`` and ``tasks/``. Sources are parsed, never imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("datagen", "flows", "tasks")
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300


def oversized(name: str, source: str) -> list[str]:
    """What in one module breaks the size rules, one line each (empty when it keeps them)."""
    found = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{name}: {lines} lines (at most {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            span = (node.end_lineno or node.lineno) - node.lineno + 1
            if span > MAX_CLASS_LINES:
                found.append(f"{name}: class {node.name} has {span} lines (at most {MAX_CLASS_LINES})")
    return found


def test_no_product_module_or_class_is_over_its_size() -> None:
    found = [
        line
        for package in PRODUCT
        for path in sorted((REPO / package).rglob("*.py"))
        for line in oversized(str(path.relative_to(REPO)), path.read_text())
    ]
    assert found == [], "split these by concern:\n" + "\n".join(found)


def test_the_size_check_finds_a_long_class_and_a_long_module() -> None:
    long_class = "class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES
    assert oversized("big.py", long_class) == ["big.py: class Big has 301 lines (at most 300)"]
    long_module = "x = 1\n" * (MAX_MODULE_LINES + 1)
    assert oversized("long.py", long_module) == ["long.py: 601 lines (at most 600)"]
    assert oversized("small.py", "class Small:\n    x = 1\n") == []
