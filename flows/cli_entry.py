"""The `datagen` console script: the core's command line, wired to the flow the deployments run.

``datagen`` (``pyproject.toml``), ``python -m flows.cli_entry`` and ``make demo`` start here. The core
(:mod:`datagen.app.cli`) never imports ``flows``; this module hands it a loader of :func:`flows.expand.expand`,
so ``datagen run`` and ``datagen demo`` run the very flow a deployment runs, and Prefect is only imported
once a run is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from datagen.app import cli

if TYPE_CHECKING:
    from datagen.app.runner import ExpandFlow


def load_expand_flow() -> ExpandFlow:
    """Import the `expand` flow (and Prefect with it) and return it."""
    from flows.expand import expand

    return expand


def main() -> None:
    """Console-script entry point: the `datagen` command line with the `expand` flow."""
    cli.main(load_expand_flow)


if __name__ == "__main__":
    main()
