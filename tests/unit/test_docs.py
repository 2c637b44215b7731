"""The generated configuration reference matches the code."""

from __future__ import annotations

from pathlib import Path

from datagen.app.configdoc import render_configuration_reference

REPO = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_up_to_date() -> None:
    current = (REPO / "docs" / "configuration.md").read_text()
    assert current == render_configuration_reference(), (
        "docs/configuration.md is stale: run `python -m datagen.app.configdoc > docs/configuration.md`"
    )
