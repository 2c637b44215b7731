"""The `datagen` console script: the core's command line, wired to the flow the deployments run.

``datagen`` (``pyproject.toml``), ``python -m flows.cli_entry`` and ``make demo`` start here. The core
(:mod:`datagen.app.cli`) never imports ``flows``; this module hands it a loader of :func:`flows.expand.expand`,
so ``datagen run`` and ``datagen demo`` run the very flow a deployment runs, and Prefect is only imported
once a run is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from datagen.app import cli
from datagen.gc_tuning import tune_garbage_collector
from datagen.stack_room import call_with_stack_room

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
        from flows.expand import expand
    except BaseException:
        if early is not None:
            early.stop()
        raise

    def run_expand(config: RunConfig, retry_failed: bool = False) -> RunSummary:
        with prefect_api(log_dir, early=early):
            # `config` is the flow's advanced parameter (config_path, run_id... come first): by name.
            return expand(config=config, retry_failed=retry_failed)

    return run_expand


def main() -> None:
    """Console-script entry point: the `datagen` command line with the `expand` flow."""
    tune_garbage_collector()
    # The whole command with room on the frame stack: see datagen.stack_room (a run maps and unmaps ~8,000
    # chunks of it otherwise).
    call_with_stack_room(cli.main, load_expand_flow)


if __name__ == "__main__":
    main()
