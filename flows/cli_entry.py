"""The `datagen` console script: the core's command line, wired to the flow the deployments run.

``datagen`` (``pyproject.toml``), ``python -m flows.cli_entry`` and ``make demo`` start here. The core
(:mod:`datagen.app.cli`) never imports ``flows``; this module hands it :func:`start_expand`, so ``datagen run``
and ``datagen demo`` run the very flow body a deployment runs, and Prefect is only imported once a run is asked
for. The path of a run: ``cli.run`` (the config resolved once: :func:`datagen.app.run_request.resolve_config_file`)
-> ``terminal.run_in_terminal`` -> :func:`start_expand` -> :func:`flows.expand.run_with_config`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from datagen.app import cli

if TYPE_CHECKING:
    from datagen.config import RunConfig
    from datagen.dataset.report import RunSummary

# Quiet, offline defaults for Prefect in this process; a user's own environment wins.
PREFECT_ENV_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
    "TOKENIZERS_PARALLELISM": "false",
    # datagen's own loggers (dispatcher retries, S3 retries, fleet restarts) go to the run log and the UI.
    "PREFECT_LOGGING_EXTRA_LOGGERS": "datagen",
}


def start_expand(
    config: RunConfig, config_name: str | None, retry_failed: bool = False
) -> Callable[[], RunSummary]:
    """Import Prefect and the `expand` flow, and return its run with a whole config (the box's operator).

    The run uses the configured Prefect API (``PREFECT_API_URL``) when there is one; else a temporary server
    this process owns in its own session, so a terminal's Ctrl-C does not kill it before the run has stopped
    (see :mod:`flows.api_server`). It boots while Prefect and the flow are imported (seconds each).

    Args:
        config: The resolved run config (its run id fixed).
        config_name: Its name when it is one of the checkout's configs (a multi-host run's hosts read it).
        retry_failed: Send the run's retryable failures again.

    Returns:
        Runs the flow in this process and returns its summary.
    """
    # Set before Prefect is imported (it reads some of them then) and before the API server starts.
    for name, value in PREFECT_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    from datagen.settings import get_settings
    from flows.api_server import prefect_api, spawn_early

    log_dir = Path(get_settings().state_dir).expanduser() / "logs"
    early = spawn_early(log_dir)
    try:
        from flows.expand import run_with_config
    except BaseException:
        if early is not None:
            early.stop()
        raise

    def run() -> RunSummary:
        with prefect_api(log_dir, early=early):
            return run_with_config(config, config_name, retry_failed)

    return run


def main() -> None:
    """Console-script entry point: the `datagen` command line with the `expand` flow."""
    cli.main(start_expand)


if __name__ == "__main__":
    main()
