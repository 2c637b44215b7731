"""The `datagen` console script: the core's command line, wired to the flow the deployments run.

``datagen`` (``pyproject.toml``), ``python -m flows.cli_entry`` and ``make demo`` start here. The core
(:mod:`datagen.app.cli`) never imports ``flows``; this module hands it a loader of the `expand` flow with a
whole config (:func:`flows.expand.run_with_config`: the box's operator may set any field), so ``datagen run`` and
``datagen demo`` run the very flow body a deployment runs, and Prefect is only imported once a run is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from datagen.app import cli

if TYPE_CHECKING:
    from datagen.app.runner import ExpandFlow
    from datagen.config import RunConfig
    from datagen.dataset.report import RunSummary


def load_expand_flow() -> ExpandFlow:
    """Import the `expand` flow (and Prefect with it) and return it, run against an API server.

    The configured Prefect API (``PREFECT_API_URL``) when there is one; else a temporary server this
    process owns in its own session, so a terminal's Ctrl-C does not kill it before the run has stopped
    (see :mod:`flows.api_server`).
    """
    from datagen.settings import get_settings
    from flows.api_server import prefect_api, spawn_early

    log_dir = Path(get_settings().state_dir).expanduser() / "logs"
    # The temporary API server boots while this process imports Prefect and the flow (seconds each).
    early = spawn_early(log_dir)
    try:
        from flows.expand import run_with_config
    except BaseException:
        if early is not None:
            early.stop()
        raise

    def run_expand(config: RunConfig, config_name: str | None, retry_failed: bool = False) -> RunSummary:
        with prefect_api(log_dir, early=early):
            # Whoever runs the CLI on the box is its operator: the whole config, any field.
            return run_with_config(config, config_name, retry_failed)

    return run_expand


def main() -> None:
    """Console-script entry point: the `datagen` command line with the `expand` flow."""
    cli.main(load_expand_flow)


if __name__ == "__main__":
    main()
