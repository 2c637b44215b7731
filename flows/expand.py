"""The `expand` flow: halt training, serve the target on every GPU, generate, land, tokenize, report.

The DAG (see docs/architecture.md)::

    preflight -> open-run -> prepare-prompts (per dataset, CPU only, scanned in parallel) -> check-prompts
              -> halt-training -> probe-environment -> plan-servers -> start-fleet
              -> generate-shard (per dataset x shard, fed as the backlog runs low, one shared dispatcher)
              -> stop-fleet (always) -> merge-and-tokenize -> report -> manifest (last)

This module only orchestrates and decides the final state: the run's name is made in ``tasks/run_names.py``,
its parameters checked in ``flows/checked_flow.py``, its shards scheduled in ``tasks/shard_scheduler.py``, its
servers run by ``flows/serving.py`` (several boxes: ``flows/multihost.py``); every stage's work is in ``datagen``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, cast

from prefect import Flow, get_run_logger
from prefect.context import FlowRunContext
from prefect.exceptions import CancelledRun
from prefect.states import Completed

from datagen.app.run_request import (
    ResolvedRun,
    RunRequest,
    SamplingChoice,
    checked_request,
    operator_run,
    resolve_run,
    with_run_id,
)
from datagen.config import RunConfig
from datagen.dataset.report import RunReport, RunSummary
from datagen.errors import ConfigError, RunCancelled
from datagen.output.manifest import read_manifest
from datagen.progress import Stage, enter_stage
from flows.checked_flow import CheckedFlow, box_configs
from flows.generation import already_generated, generate_on_this_box, prepare_datasets
from flows.multihost import generate_on_hosts
from flows.publish import publish_run
from flows.serving import stop_servers_hook
from tasks.cancellation import run_cancellable
from tasks.context import RunContext, open_run_store
from tasks.run import (
    open_run,
    preflight,
    write_attempt_record,
)
from tasks.run_lease import hold_run_lease
from tasks.run_names import expand_run_name, generated_run_id
from tasks.run_origin import refuse_caller_retries, verify_work_queue
from tasks.runtime import (
    DeploymentResume,
    explain_failure,
    forward_thread_logs,
    hold_host_gpus,
    verify_code_version,
)
from tasks.series import continue_open_series_run, open_series_entry
from tasks.task_runner import InterruptibleThreadPoolTaskRunner

# Threads for concurrently running tasks (prepare and shard tasks). A shard task mostly waits for its results
# (the dispatcher's loop does the I/O), so threads are cheap; the dispatcher bounds the requests in play.
FLOW_TASK_WORKERS = 256

_FLOW_OPTIONS: dict[str, Any] = {
    "name": "expand",
    "flow_run_name": expand_run_name,
    "task_runner": InterruptibleThreadPoolTaskRunner(max_workers=FLOW_TASK_WORKERS),
    "on_cancellation": [stop_servers_hook],
    "on_crashed": [stop_servers_hook],
    "validate_parameters": True,
}


def _flow_run_id() -> str:
    context = FlowRunContext.get()
    return str(context.flow_run.id) if context and context.flow_run else "local"


def _completed(summary: RunSummary) -> RunSummary:
    """The run's Completed state, its message saying where everything landed (the run page shows it).

    Prefect ends a flow run in the state its function returns; calling the flow still returns ``summary``.
    """
    return cast(RunSummary, Completed(message=summary.state_message(), data=summary))


def _expand(
    config: str,
    run_id: str | None = None,
    max_prompts: int | None = None,
    series: str | None = None,
    output: str | None = None,
    sampling: SamplingChoice | None = None,
    datasets: list[str] | None = None,
    retry_failed: bool = False,
) -> RunSummary:
    """Expand the drafter's training data with completions of the target model.

    A run picks one of the box's configs by name and may change only the choices below; everything else
    (model, fleet, training job, datasets' paths, protected prefixes, output roots) is the config file's.

    Args:
        config: Name of a config of the box: configs/<name>.yaml in the worker's checkout.
        run_id: Run id; an existing run's id resumes it: its config made again from the same box config.
        max_prompts: Cap every dataset's quota at this many prompts (a quick or test run).
        series: Expansion series: take prompts no earlier run of the series took, publish the next version.
        output: Output root instead of the config's: its `output` or one of its `output_roots`, or a new
            folder directly under one (a name, not runs, series or datasets).
        sampling: Sampling defaults to change (a dataset's own sampling in the config still wins).
        datasets: Run only these of the config's datasets (by name); all when unset.
        retry_failed: With the run_id of a run that ended Failed: send again its failed requests whose
            reason was not the prompt's own (server errors, resets, timeouts, a wrong server or model).

    Returns:
        Where the run landed and its headline counts.
    """
    flow_run_id = _flow_run_id()
    parameters = {
        "config": config,
        "run_id": run_id,
        "max_prompts": max_prompts,
        "series": series,
        "output": output,
        "sampling": sampling,
        "datasets": datasets,
        "retry_failed": retry_failed,
    }
    resume = DeploymentResume()

    def body() -> RunSummary:
        refuse_caller_retries()  # first: a refusal after it must not be run again
        request = checked_request(config, parameters, box_configs(), RunRequest)
        verify_code_version(__file__)
        run = resolve_run(request, box_configs(), generated_run_id())
        if run.config.series:
            # The series' next run finishes the series' unfinished run before any run takes new prompts.
            run = continue_open_series_run(run, request, box_configs(), open_run_store(run.config))
        verify_work_queue(run.config)
        resume.config, resume.run_id = request.config, run.run_id
        return _completed(_run(run, flow_run_id))

    with forward_thread_logs(flow_run_id), explain_failure(resume):
        return cast(RunSummary, run_cancellable(body))


expand = CheckedFlow(fn=_expand, request_model=RunRequest, **_FLOW_OPTIONS)


def _expand_config(
    config: RunConfig, config_name: str | None = None, retry_failed: bool = False
) -> RunSummary:
    """The flow with a whole config, any field: for the box's operator (``datagen run --config``) only.

    Args:
        config: The run's whole configuration, as the operator wrote it, resolved (its run id fixed).
        config_name: Its name when it is one of the checkout's configs (a multi-host run's hosts read it).
        retry_failed: Send the run's retryable failures again.

    Returns:
        Where the run landed and its headline counts.
    """
    flow_run_id = _flow_run_id()

    def body() -> RunSummary:
        verify_code_version(__file__)
        return _completed(_run(operator_run(config, config_name, retry_failed), flow_run_id))

    with forward_thread_logs(flow_run_id), explain_failure():
        return cast(RunSummary, run_cancellable(body))


@functools.cache
def operator_flow() -> Flow[..., RunSummary]:
    """The `expand` flow taking a whole config, for the CLI on the box (its operator).

    Built on first use and never a module attribute, so no deployment's entrypoint can name it: a run started
    through the Prefect API always goes through :data:`expand` and its :class:`RunRequest`.
    """
    return Flow(fn=_expand_config, **_FLOW_OPTIONS)


def run_with_config(
    config: RunConfig, config_name: str | None = None, retry_failed: bool = False
) -> RunSummary:
    """Run the `expand` flow in this process with a whole config (the CLI and the tests, on the box).

    A config without a run id gets a new one here, before the flow run starts: its name and body read it.

    Raises:
        RunCancelled: The run was cancelled through the Prefect API (it ended Cancelled, servers stopped).
    """
    try:
        return operator_flow()(config=with_run_id(config), config_name=config_name, retry_failed=retry_failed)
    except CancelledRun as cancelled:
        raise RunCancelled(str(cancelled)) from cancelled


def _run(resolved: ResolvedRun, flow_run_id: str) -> RunSummary:
    """The run itself, once its entry point resolved it: the chain of the module docstring.

    The run id's lease is held from the start, this box's GPUs from the halt on, both until the run ends.
    """
    config = resolved.config
    if config.hosts and resolved.hosts is None:
        raise ConfigError(
            "hosts: a multi-host run's config must be one of the checkout's configs/ files (every box reads it "
            "from its own checkout by name): move it into configs/ and pass that file to --config"
        )
    logger = get_run_logger()
    with contextlib.ExitStack() as held:
        # One run id, one runner, for the whole run: a second flow run of it is refused before anything happens.
        held.enter_context(hold_run_lease(resolved.run_id))
        enter_stage(logger, Stage.PREFLIGHT, run_id=resolved.run_id)
        store = open_run_store(config)  # with the Prefect block's S3 credentials; every task reaches S3 by it
        preflight_report = preflight(config, store)
        run = open_run(config, store, resolved.origin)
        attempt_id = time.strftime("%Y%m%d-%H%M%S") + "-" + flow_run_id[:8]
        context = RunContext(config, store, run, attempt_id)
        if read_manifest(store, run.layout) is not None:
            if resolved.retry_failed:
                raise ConfigError(
                    f"run {run.run_id} is complete and its dataset version is published: its failures cannot "
                    "be retried into it (a published version never changes). Start a new run for those prompts."
                )
            logger.info("run run_id=%s is already complete: nothing to do", run.run_id)
            return _already_complete(context)
        write_attempt_record(context, "preflight", preflight_report)
        series_entry = open_series_entry(context) if config.series else None
        prepared_futures = prepare_datasets(context, series_entry)
        generated = already_generated(context, prepared_futures, resolved.retry_failed)
        if generated is None and config.hosts:
            # Several boxes: each host part halts its training and serves (flows/host_part.py); this flow holds
            # no GPU lock and halts nothing itself, it only sends the requests.
            enter_stage(logger, Stage.GENERATE, hosts=len(config.hosts))
            assert resolved.hosts is not None
            parent = flow_run_id if flow_run_id != "local" else None
            generated = generate_on_hosts(
                context, prepared_futures, resolved.hosts, parent, resolved.retry_failed
            )
        elif generated is None:
            enter_stage(logger, Stage.GPU_LOCK)
            gpus = held.enter_context(hold_host_gpus(run.run_id))
            if read_manifest(store, run.layout) is not None:
                # Completed by another runner of this run id while this one waited for the GPUs (a runner without
                # a lease: two `datagen run` on one box); nothing was halted yet.
                logger.info("run run_id=%s was completed while this run waited for the GPUs", run.run_id)
                return _already_complete(context)
            generated = generate_on_this_box(
                context, prepared_futures, gpus, flow_run_id, resolved.retry_failed
            )
        return publish_run(context, generated, series_entry)


def _already_complete(context: RunContext) -> RunSummary:
    report = RunReport.model_validate(context.store.read_json(context.layout.report_json))
    return RunSummary.of_report(report, context.store, context.layout, already_complete=True)
