"""Run the `expand` flow in this process and print where the run landed: what the CLI and the demo share.

The core never imports Prefect, ``flows`` or ``tasks``: the flow arrives as a :data:`FlowLoader`, a function
that imports and returns it. The console script's entry module (``flows/cli_entry.py``) passes the loader
of the `expand` flow with a whole config (the box's operator may set any field; a deployment's run only picks a
config by name: :mod:`datagen.app.request`), so the CLI runs the very flow body the deployments run, and the
import of Prefect waits until a run is asked for (``datagen --help`` stays fast).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import typer

from datagen.config import RunConfig
from datagen.dataset.report import RunSummary

ExpandFlow = Callable[[RunConfig, str | None, bool], RunSummary]
"""The `expand` flow as the runner calls it: a run config, its name among the checkout's configs (if it is
one) and ``retry_failed`` in, the run's summary out."""

FlowLoader = Callable[[], ExpandFlow]
"""Imports the flow and returns it; called only once a run is asked for."""

# Quiet, offline defaults for Prefect in this process; a user's own environment wins.
PREFECT_ENV_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
    "TOKENIZERS_PARALLELISM": "false",
    # datagen's own loggers (dispatcher retries, S3 retries, fleet restarts) go to the run log and the UI.
    "PREFECT_LOGGING_EXTRA_LOGGERS": "datagen",
}


def prepare_flow_run(
    load_flow: FlowLoader, config: RunConfig, config_name: str | None = None, retry_failed: bool = False
) -> Callable[[], RunSummary]:
    """Import the `expand` flow (Prefect with it, which configures its logging) and return its run.

    The flow runs when the returned function is called, so the terminal can set up its log file once
    Prefect's logging exists (see :func:`datagen.app.terminal.run_in_terminal`).

    Args:
        load_flow: Imports and returns the flow; called after Prefect's environment defaults are set,
            since Prefect reads some of them when it is imported.
        config: The validated run config.
        config_name: Its name when it is one of the checkout's configs (a multi-host run needs one).
        retry_failed: Send the run's retryable failures again (the flow's ``retry_failed``).

    Returns:
        Runs the flow in this process (Prefect's configured API, or the temporary one the loader owns)
        and returns its summary.

    """
    for name, value in PREFECT_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    flow = load_flow()
    return lambda: flow(config, config_name, retry_failed)


def print_summary(summary: RunSummary) -> None:
    """Print where a run landed, for the terminal."""
    lines = [
        f"run {summary.run_id}: "
        + ("already complete, nothing regenerated" if summary.already_complete else "done"),
        f"  output        {summary.run_url}",
        f"  prompts       {summary.prompts}",
        f"  completions   {summary.completions} of {summary.requests} requests ({summary.failures} failures)",
        f"  training rows {summary.tokenized_rows}",
        f"  throughput    {summary.output_tokens_per_s:.1f} output tok/s",
        f"  dataset       {summary.dataset_version}",
        f"  report        {summary.report_url}",
        f"  manifest      {summary.manifest_url}",
    ]
    if summary.training:
        lines += ["  to train on it:", *[f"    {line}" for line in summary.training]]
    typer.echo("\n".join(lines))
