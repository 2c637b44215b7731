"""The `expand` flow: halt training, serve the target on every GPU, generate, land, tokenize, report.

The DAG (see docs/architecture.md)::

    preflight -> open-run -> prepare-prompts (per dataset, CPU only, scanned in parallel) -> check-prompts
              -> halt-training -> probe-environment -> plan-servers -> start-fleet
              -> generate-shard (per dataset x shard, fed as the backlog runs low, one shared dispatcher)
              -> stop-fleet (always) -> merge-and-tokenize -> report -> manifest (last)

This module only orchestrates and decides the final state; every stage's work is in ``datagen``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC
from pathlib import Path
from typing import Any, TypeVar, cast
from uuid import UUID

from prefect import Flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.client.schemas.objects import FlowRun, State
from prefect.context import FlowRunContext
from prefect.exceptions import CancelledRun, ExternalSignal
from prefect.futures import PrefectFuture
from prefect.logging.loggers import flow_run_logger
from prefect.runtime import flow_run as runtime_flow_run
from prefect.states import Completed
from pydantic import BaseModel

import datagen.engines
from datagen.app.run_request import (
    HostRequest,
    ResolvedRun,
    RunRequest,
    SamplingChoice,
    configs_folder,
    operator_run,
    parse_run_request,
    resolve_run,
    with_run_id,
)
from datagen.config import RunConfig, is_valid_slug
from datagen.dataset.report import GenerationWindow, RunReport, RunSummary, record_generation_window
from datagen.errors import (
    ConfigError,
    RunCancelled,
    ShardsFailedError,
    TrainingNotRestartedError,
    UnfixableStorageError,
)
from datagen.escape import printable
from datagen.generation.dispatch_state import DispatcherStats
from datagen.generation.dispatcher import Dispatcher
from datagen.generation.failures import check_failed_share, retryable_failures
from datagen.generation.shard import latest_shard_summary
from datagen.host.fleet_registry import fleet_pidfile, stop_fleet_from_pidfile
from datagen.output.layout import RunLayout
from datagen.output.manifest import read_manifest
from datagen.output.runs import make_run_id
from datagen.output.store import Store
from datagen.progress import GenerationProgress, Stage, enter_stage, report_progress
from datagen.records import PreparedDataset, PromptShardRef, ShardSummary
from datagen.settings import get_settings, server_api_key
from flows.multihost import HostsOutcome, run_on_hosts
from flows.serving import fleet_state_dir, serve_on_this_box
from tasks.cancellation import run_cancellable
from tasks.context import RunContext, open_run_store
from tasks.data import (
    CorpusIds,
    ShardProgress,
    generate_shard,
    merge_and_tokenize,
    prepare_prompts,
    prompt_scans,
)
from tasks.run import (
    check_prompts,
    finalize_manifest,
    open_run,
    preflight,
    write_attempt_record,
    write_report,
)
from tasks.run_lease import hold_run_lease
from tasks.run_names import is_generated_run_name
from tasks.run_origin import refuse_caller_retries, verify_work_queue
from tasks.runtime import (
    DeploymentResume,
    explain_failure,
    forward_thread_logs,
    hand_back_if_gpus_free,
    hold_host_gpus,
    verify_code_version,
)
from tasks.series import open_series_entry, write_ledger
from tasks.task_runner import InterruptibleThreadPoolTaskRunner

R = TypeVar("R")
# Threads for concurrently running tasks (prepare and shard tasks). A shard task mostly waits for its results
# (the dispatcher's loop does the I/O), so threads are cheap; the dispatcher bounds the requests in play.
FLOW_TASK_WORKERS = 256
# Shard tasks running at once unless generation.max_concurrent_shards says otherwise: room for shards waiting
# on their slowest requests (a long tail keeps dozens open) while new ones feed the backlog, and for prepares.
MAX_SHARD_TASKS = 224
# How often the flow starts shard tasks when the dispatcher's backlog runs low (it holds seconds of work).
SCHEDULE_INTERVAL_S = 0.2
# How often a watcher of the run (the live terminal view) hears how far generation is: a bar that moves smoothly;
# the log line and the artifact keep progress_interval_s.
WATCHED_PROGRESS_INTERVAL_S = 0.5
# How long the end of generation waits for its last progress update to reach the API (it never waits longer:
# with the API away, the run goes on to the merge and reports there).
PROGRESS_CLOSE_TIMEOUT_S = 5.0


def _generated_run_id() -> str:
    """The run id of a run started without one: stable for the flow run (its id and creation time)."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return make_run_id()
    created = context.flow_run.created
    return make_run_id(seed=str(context.flow_run.id), now=created.astimezone(UTC) if created else None)


# The checkout this flow runs from: its configs/ folder holds the configs a run may pick by name.
CHECKOUT = Path(__file__).resolve().parents[1]


def box_configs() -> Path:
    """The box's configs a run may pick by name: ``configs/`` of the worker's checkout."""
    return configs_folder(CHECKOUT)


def _run_id_of(parameters: dict[str, Any]) -> str | None:
    """The run id a flow run's parameters give, if any, for its name (never reads the box's configs).

    The operator's flow receives its config resolved, run id included; a deployment's run gives its
    ``run_id`` parameter, else takes the flow run's own (:func:`_generated_run_id`), as its body does.
    """
    run_id = parameters.get("run_id")
    config = parameters.get("config")
    if not run_id and isinstance(config, RunConfig | dict):  # the operator's flow: a whole config
        run_id = config.run_id if isinstance(config, RunConfig) else config.get("run_id")
    return run_id if isinstance(run_id, str) and is_valid_slug(run_id) else None


def given_run_name(name: str | None) -> str | None:
    """The name a person gave the flow run at creation (the run form's Name, ``--flow-run-name``), if any.

    Prefect names every flow run at creation and records no flag saying who chose it: a name one of its
    generators could have produced (:func:`tasks.run_names.is_generated_run_name`) counts as Prefect's, and so
    does ours, ``expand-<run id>``, from an earlier attempt. Control characters in it are shown as their
    escapes (the name is renamed to that at the run's start), so the name never forges a log line.
    """
    if not name or is_generated_run_name(name) or name.startswith("expand-"):
        return None
    return printable(name)


def _flow_run_name() -> str:
    """The name given at creation when a person gave one, else ``expand-<run id>``.

    ``expand-<run id>`` uses the given run id, else the one the run will generate.
    """
    context = FlowRunContext.get()
    given = given_run_name(context.flow_run.name if context and context.flow_run else None)
    if given is not None:
        return given
    parameters = dict(runtime_flow_run.parameters or {})
    if isinstance(parameters.get("config"), RefusedParameters):
        return "expand-refused"
    return f"expand-{_run_id_of(parameters) or _generated_run_id()}"


def _stop_servers_hook(flow: Any, flow_run: FlowRun, state: State[Any]) -> None:
    """Cancellation/crash hook: may run in another process, so it stops servers through the pidfile."""
    state_dir = fleet_state_dir(str(flow_run.id))
    logger = flow_run_logger(flow_run, flow)
    stopped = stop_fleet_from_pidfile(fleet_pidfile(state_dir))
    logger.warning("stopped servers after %s count=%d", state.type.value, stopped)
    restarted = hand_back_if_gpus_free()
    if restarted is not None:
        logger.warning("training restarted after %s pid=%d", state.type.value, restarted.pid)


def _summary_from_report(report: RunReport, store: Store, layout: RunLayout, complete: bool) -> RunSummary:
    return RunSummary(
        run_id=layout.run_id,
        run_url=store.url(layout.root),
        already_complete=complete,
        prompts=report.totals.prompts,
        requests=report.totals.requests,
        completions=report.totals.completions,
        failures=report.totals.failures,
        tokenized_rows=report.totals.tokenized_rows,
        output_tokens_per_s=report.output_tokens_per_s,
        dataset_version=report.tokenize.get("dataset_version"),
        report_url=store.url(layout.report_md),
        manifest_url=store.url(layout.manifest),
        dataset_version_url=report.tokenize.get("dataset_version_url"),
        training=report.training,
        training_job=report.training_job,
        accounting=report.accounting,  # GPU-hours and paused training, for the Completed message
    )


def _completed(summary: RunSummary) -> RunSummary:
    """The run's Completed state, its message saying where everything landed (the run page shows it).

    Prefect ends a flow run in the state its function returns; calling the flow still returns ``summary``.
    """
    return cast(RunSummary, Completed(message=summary.state_message(), data=summary))


def _prepared_outcomes(
    config: RunConfig, futures: list[PrefectFuture[PreparedDataset]]
) -> tuple[list[PreparedDataset], dict[str, str]]:
    """Wait for every dataset's preparation: the summaries, and why each failed dataset failed."""
    prepared: list[PreparedDataset] = []
    unprepared: dict[str, str] = {}
    for dataset, future in zip(config.datasets, futures, strict=True):
        try:
            prepared.append(future.result())
        except Exception as error:
            # A dataset after a failed one never starts (it dedupes against it): name the first cause only.
            if not unprepared:
                unprepared[dataset.name] = str(error)
    return prepared, unprepared


def _record_generation_window(
    context: RunContext, wall_s: float, servers: int, finished: bool, hosts: HostsOutcome | None = None
) -> None:
    attempt_id = context.attempt_id
    window = GenerationWindow(
        attempt_id=attempt_id,
        wall_s=wall_s,
        servers=servers,
        interrupted=not finished,
        hosts=list(hosts.served) if hosts else [],
        lost_hosts=dict(hosts.lost) if hosts else {},
    )
    try:
        record_generation_window(context.store, context.layout, window)
    except Exception as error:  # never mask why generation ended
        get_run_logger().warning("generation time not recorded attempt=%s error=%s", attempt_id, error)


def _progress(
    answered: int, total: int, stats: DispatcherStats, elapsed_s: float
) -> tuple[GenerationProgress, str]:
    """Generation so far and the progress artifact's text: the figures, then the dispatcher's queues."""
    progress = GenerationProgress(
        answered=answered,
        total=total,
        failed=stats.failed,
        output_tokens=stats.output_tokens,
        elapsed_s=elapsed_s,
        answered_here=stats.completed + stats.failed,
    )
    detail = f"{sum(stats.in_flight.values())} in flight · {stats.queued} queued · {stats.retries} retries"
    return progress, progress.card(detail)


def _stored_summary(store: Store, layout: RunLayout, shard: PromptShardRef) -> ShardSummary:
    """The latest summary of a shard known to be done (its highest retry round)."""
    summary = latest_shard_summary(store, layout, shard.dataset, shard.shard_index)
    assert summary is not None, f"shard {shard.dataset}/{shard.shard_index} has no done marker"
    return summary


def _all_shards_done(store: Store, layout: RunLayout, prepared: list[PreparedDataset]) -> bool:
    return all(store.exists(layout.shard_done(s.dataset, s.shard_index)) for p in prepared for s in p.shards)


def _max_shard_tasks(config: RunConfig) -> int:
    """Shard tasks allowed to run at once (each holds a worker thread, mostly waiting)."""
    return config.generation.max_concurrent_shards or MAX_SHARD_TASKS


class _ProgressPublisher:
    """Publishes the progress artifact from a thread of its own: Prefect's API is never on the scheduler's path.

    The scheduler only leaves the latest (progress, description) here. While the API is away, a call blocks
    this thread for as long as Prefect's client retries (about a minute) and the updates made meanwhile are
    dropped, only the latest kept: the first call that goes through once the API is back shows it. Runs in
    a copy of the flow run's context (the client and the run logger need it).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: tuple[float, str] | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._idle = threading.Event()
        self._idle.set()
        self.progress_id: UUID | None = None
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._publish_forever,), name="progress-artifact", daemon=True
        )
        self._thread.start()

    def publish(self, progress: float, description: str) -> None:
        """Leave the latest progress for the thread (never waits for the API)."""
        with self._lock:
            self._latest = (progress, description)
            self._idle.clear()
        self._wake.set()

    def close(self, timeout_s: float) -> None:
        """Publish what is left (waiting at most ``timeout_s``), then stop the thread."""
        self._idle.wait(timeout_s)
        self._stopping = True
        self._wake.set()

    def _publish_forever(self) -> None:
        logger = get_run_logger()
        away_since: float | None = None
        while not self._stopping:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                latest, self._latest = self._latest, None
            if latest is None:
                self._idle.set()
                continue
            try:
                if self.progress_id is None:
                    self.progress_id = cast(
                        UUID,
                        create_progress_artifact(latest[0], key="generation-progress", description=latest[1]),
                    )
                else:
                    update_progress_artifact(self.progress_id, latest[0], description=latest[1])
            except Exception as error:  # progress is for humans: never worth failing a run over
                if away_since is None:
                    away_since = time.monotonic()
                    logger.warning("progress update failed (generation goes on) error=%s", error)
                continue
            finally:
                with self._lock:
                    if self._latest is None:
                        self._idle.set()
            if away_since is not None:
                logger.info(
                    "progress updates reach the Prefect API again after %.0f s", time.monotonic() - away_since
                )
                away_since = None


class _GenerationProgress:
    """The progress bar and the periodic progress line; a failed read or update never fails the run.

    ``started`` is when generation started (``time.monotonic()``): the report's generation wall time starts
    there too, so the tok/s shown here is the report's definition (:mod:`datagen.progress`).
    What Prefect 3.9.1's run page (``/v2``) shows of it: its Logs tab (the default) polls every 5 s while the
    run runs, so the progress line is what updates by itself; the Artifacts tab's card shows the artifact's
    figures as of when the tab was opened (switching tabs or reloading fetches them again). The header shows
    no state message, and a new Running state would count as another run attempt: nothing goes there.
    """

    def __init__(self, dispatcher: Dispatcher, started: float) -> None:
        self.dispatcher = dispatcher
        self.started = started
        self.last_report = 0.0
        self.last_watched = 0.0
        self.publisher = _ProgressPublisher()
        self.publisher.publish(0.0, "**0.0%** · generation starting")

    def close(self) -> None:
        """Let the last update reach the API if it can, briefly (the run's end never waits on the API)."""
        self.publisher.close(PROGRESS_CLOSE_TIMEOUT_S)

    def report(
        self, answered: int, total: int, shards_done: int, shards_total: int, *, force: bool = False
    ) -> None:
        now = time.monotonic()
        due = force or now - self.last_report >= get_settings().progress_interval_s
        if not due and now - self.last_watched < WATCHED_PROGRESS_INTERVAL_S:
            return
        self.last_watched = now
        logger = get_run_logger()
        try:
            stats = self.dispatcher.stats()
        except Exception as error:  # progress is for humans: never worth failing a run over
            if due:
                self.last_report = now
                logger.warning("progress read failed error=%s", error)
            return
        progress, description = _progress(answered, total, stats, now - self.started)
        report_progress(progress)
        if not due:
            return
        self.last_report = now
        self.publisher.publish(100.0 if force else progress.percent, description)
        logger.info(
            "progress %s | in_flight=%d queued=%d backlog=%d shards_done=%d/%d req/s=%.1f",
            progress.line(),
            sum(stats.in_flight.values()),
            stats.queued,
            stats.backlog,
            shards_done,
            shards_total,
            stats.requests_per_s,
        )


def _generate_all(
    context: RunContext,
    prepared_futures: list[PrefectFuture[PreparedDataset]],
    dispatcher: Dispatcher,
    retry_failed: bool = False,
    started: float | None = None,
) -> tuple[list[PreparedDataset], list[ShardSummary], list[BaseException]]:
    """Run one task per shard, started as datasets are prepared, so the dispatcher's backlog never runs dry.

    A shard task registers all its requests with the dispatcher as one stream; the dispatcher admits
    requests (not shards) as slots free. A new shard task starts whenever the requests registered but not
    yet admitted (plus those of shard tasks still starting) fall below the dispatcher's admission limit,
    so work is always waiting, however long the slowest request of any shard takes. ``started`` is when
    generation started (the report's wall time starts there; default: now).
    """
    logger = get_run_logger()
    config, run = context.config, context.run
    pending: deque[PromptShardRef] = deque()
    waiting_prepare = list(prepared_futures)
    prepared: list[PreparedDataset] = []
    running: dict[PrefectFuture[ShardSummary], PromptShardRef] = {}
    summaries: list[ShardSummary] = []
    errors: list[BaseException] = []
    total_requests = 0
    max_tasks = _max_shard_tasks(config)
    progress = _GenerationProgress(dispatcher, time.monotonic() if started is None else started)
    shard_progress = ShardProgress()

    def take_prepared(block: bool) -> None:
        nonlocal total_requests
        while waiting_prepare and (block or waiting_prepare[0].state.is_final()):
            item = waiting_prepare.pop(0).result()
            prepared.append(item)
            total_requests += item.prompts * _samples(config, item.dataset)
            pending.extend(item.shards)
            block = False

    def backlog() -> int:
        """Requests registered but not admitted, counting shard tasks that have not registered yet."""
        try:
            registered = dispatcher.stats().backlog
        except Exception:  # a read that fails counts as a full backlog: start nothing this turn
            return dispatcher.admission_limit
        starting = sum(
            shard.prompts * _samples(config, shard.dataset)
            for shard in running.values()
            if not shard_progress.registered(run.run_id, shard.dataset, shard.shard_index)
        )
        return registered + starting

    # Finished shard futures arrive here (their done-callback runs on the worker thread). Not prefect's wait(
    # timeout=): its SIGALRM timeout, armed five times a second, escaped as a CancelledError under load.
    finished: queue.SimpleQueue[PrefectFuture[ShardSummary]] = queue.SimpleQueue()
    # Set by a storage fault no retry cures (a full disk, no permission, the bucket gone): no new shard starts,
    # since each would generate answers it cannot store; the running ones end and the run stops.
    storage_fault: UnfixableStorageError | None = None
    while (waiting_prepare or pending or running) and not (storage_fault and not running):
        if storage_fault is None:
            take_prepared(block=not pending and not running)
        while (
            storage_fault is None
            and pending
            and len(running) < max_tasks
            and backlog() < dispatcher.admission_limit
        ):
            shard = pending.popleft()
            future = generate_shard.submit(
                context, shard, dispatcher, shard_progress, retry_failed=retry_failed
            )
            running[future] = shard
            future.add_done_callback(finished.put)
        if not running:
            continue
        done = []
        with contextlib.suppress(queue.Empty):
            done.append(finished.get(timeout=SCHEDULE_INTERVAL_S))
            while True:
                done.append(finished.get_nowait())
        for future in done:
            shard = running.pop(future)
            try:
                summaries.append(future.result())
            except (KeyboardInterrupt, SystemExit, ExternalSignal):  # signalled while it waited here
                raise
            except BaseException as error:  # a shard's own failure: the run fails at the end
                logger.error(
                    "shard failed dataset=%s shard=%05d error=%r", shard.dataset, shard.shard_index, error
                )
                errors.append(error)
                if isinstance(error, UnfixableStorageError) and storage_fault is None:
                    storage_fault = error
                    logger.error(
                        "no new shard starts: %s (shards running=%d not started=%d)",
                        error,
                        len(running),
                        len(pending),
                    )
        # Finished shards count all their requests (stored by any attempt); running ones what they have so far.
        answered = sum(s.completions + s.failures for s in summaries) + sum(
            shard_progress.done(run.run_id, shard.dataset, shard.shard_index) for shard in running.values()
        )
        progress.report(
            answered, total_requests, len(summaries), len(summaries) + len(running) + len(pending)
        )
    answered = sum(s.completions + s.failures for s in summaries)
    progress.report(answered, total_requests, len(summaries), len(summaries), force=True)
    progress.close()
    return prepared, summaries, errors


def _generate_on_hosts(
    context: RunContext,
    prepared_futures: list[PrefectFuture[PreparedDataset]],
    flow_run_id: str,
    hosts_request: HostRequest | None,
    retry_failed: bool = False,
) -> tuple[list[PreparedDataset], list[ShardSummary], list[BaseException], int, float]:
    """Generate over every host's servers (``config.hosts``): the host parts halt and serve, this flow sends."""
    outcome = HostsOutcome()
    wall_s: float | None = None
    finished = False

    def generate(
        dispatcher: Dispatcher,
    ) -> tuple[list[PreparedDataset], list[ShardSummary], list[BaseException]]:
        nonlocal wall_s, finished
        started = time.monotonic()
        try:
            result = _generate_all(context, prepared_futures, dispatcher, retry_failed, started)
            finished = True
            return result
        finally:
            wall_s = time.monotonic() - started

    try:
        parent = flow_run_id if flow_run_id != "local" else None
        assert hosts_request is not None, "refused before the run opened"
        prepared, summaries, errors = run_on_hosts(context, hosts_request, parent, generate, outcome)
    finally:
        # Recorded once the hosts are released, so a box lost at the very end of generation is named too.
        if wall_s is not None:
            _record_generation_window(context, wall_s, outcome.servers, finished, outcome)
    if outcome.lost:
        get_run_logger().warning(
            "hosts lost during the run: %s",
            "; ".join(f"{name} ({reason})" for name, reason in sorted(outcome.lost.items())),
        )
    return prepared, summaries, errors, outcome.servers, wall_s or 0.0


def _samples(config: RunConfig, dataset: str) -> int:
    return config.sampling_for(config.dataset(dataset)).samples_per_prompt


class RefusedParameters:
    """What a flow body receives as its ``config`` when :class:`CheckedFlow` refused the run's parameters.

    The body raises :attr:`refusal` inside its own failure reporting (:func:`refuse_if_refused`), so the run
    ends like every other refusal: one ``run failed:`` line, no traceback of Prefect's, under the flow's own
    run name. Raised from parameter validation instead, Prefect would log its engine's traceback and keep the
    random name it gave the run at creation.
    """

    def __init__(self, refusal: ConfigError) -> None:
        self.refusal = refusal


def refuse_if_refused(config: object) -> None:
    """Raise the refusal :class:`CheckedFlow` deferred to the body, if ``config`` stands for one."""
    if isinstance(config, RefusedParameters):
        raise config.refusal


class CheckedFlow(Flow[..., R]):
    """A flow whose run parameters pass ``check`` before Prefect validates them against the signature.

    A deployment's flow run gets its parameters from whoever started it. ``check`` (a request model of
    :mod:`datagen.app.run_request`) refuses a value that is no run choice (a run id that climbs, a config the box
    lacks) in one line that names the parameter and the fix, before the flow reads any file or starts anything.
    A parameter the signature lacks (``config_path``, ``training``...) the server refuses at create-flow-run
    (``datagen deploy`` closes the deployments' parameter schemas), and Prefect on a worker for a run that
    skipped that check; ``check`` refuses it too when the flow is called in-process. A refused run's body
    receives only :class:`RefusedParameters` (every other parameter None) and raises its refusal first.
    """

    def __init__(
        self, fn: Callable[..., R], check: Callable[[dict[str, Any]], object], **options: Any
    ) -> None:
        super().__init__(fn=fn, **options)
        self.check_parameters = check

    def validate_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        """Refuse what is no run choice (deferred to the body, see above), then validate as Prefect does."""
        try:
            self.check_parameters(parameters)
        except ConfigError as refusal:
            return {
                name: RefusedParameters(refusal) if name == "config" else None
                for name in self.parameters.required
            }
        return super().validate_parameters(parameters)


_FLOW_OPTIONS: dict[str, Any] = {
    "name": "expand",
    "flow_run_name": _flow_run_name,
    "task_runner": InterruptibleThreadPoolTaskRunner(max_workers=FLOW_TASK_WORKERS),
    "on_cancellation": [_stop_servers_hook],
    "on_crashed": [_stop_servers_hook],
    "validate_parameters": True,
}


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
    context = FlowRunContext.get()
    flow_run_id = str(context.flow_run.id) if context and context.flow_run else "local"
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
        refuse_if_refused(config)
        verify_code_version(__file__)
        request = parse_run_request(parameters, box_configs(), RunRequest)
        run = resolve_run(request, box_configs(), _generated_run_id())
        verify_work_queue(run.config)
        resume.config, resume.run_id = request.config, run.run_id
        # Taken just before training is halted: everything before it needs no GPU, so a run refused by
        # preflight says so at once instead of after waiting for another run to give the GPUs back.
        with contextlib.ExitStack() as gpu_lock:
            summary = _run(run, flow_run_id, gpu_lock)
        return _completed(summary)

    with forward_thread_logs(flow_run_id), explain_failure(resume):
        return cast(RunSummary, run_cancellable(body))


def _check_parameters(parameters: dict[str, Any]) -> None:
    parse_run_request(parameters, box_configs(), RunRequest)


expand = CheckedFlow(fn=_expand, check=_check_parameters, **_FLOW_OPTIONS)


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
    context = FlowRunContext.get()
    flow_run_id = str(context.flow_run.id) if context and context.flow_run else "local"

    def body() -> RunSummary:
        verify_code_version(__file__)
        run = operator_run(config, config_name, retry_failed)
        with contextlib.ExitStack() as gpu_lock:
            summary = _run(run, flow_run_id, gpu_lock)
        return _completed(summary)

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


def _run(resolved: ResolvedRun, flow_run_id: str, gpu_lock: contextlib.ExitStack) -> RunSummary:
    """The run itself, once its entry point resolved it.

    ``gpu_lock`` holds the run id's lease from the start and this host's GPUs from the halt on, until the run ends.
    """
    config, hosts_request, retry_failed = resolved.config, resolved.hosts, resolved.retry_failed
    logger = get_run_logger()
    # The run's store, opened once with the Prefect block's S3 credentials (None: the AWS chain); every task
    # reaches S3 through it (its run context).
    store = open_run_store(config)
    attempt_id = time.strftime("%Y%m%d-%H%M%S") + "-" + flow_run_id[:8]
    state_dir = fleet_state_dir(flow_run_id)

    # `stage=<name>` lines mark where a run is (in the terminal, the run log and the Prefect UI): a run that
    # seems stuck says which step it waits in.
    if config.hosts and hosts_request is None:
        raise ConfigError(
            "hosts: a multi-host run's config must be one of the checkout's configs/ files (every box reads it "
            "from its own checkout by name): move it into configs/ and pass that file to --config"
        )
    assert config.run_id is not None, "a resolved run has its run id"
    # One run id, one runner, for the whole run: a second flow run of it is refused before anything happens.
    gpu_lock.enter_context(hold_run_lease(config.run_id))
    enter_stage(logger, Stage.PREFLIGHT, run_id=config.run_id)
    preflight_report = preflight(config, store)
    run = open_run(config, store, resolved.origin)
    layout = run.layout
    context = RunContext(config, store, run, attempt_id)
    if read_manifest(store, layout) is not None:
        if retry_failed:
            raise ConfigError(
                f"run {run.run_id} is complete and its dataset version is published: its failures cannot be "
                "retried into it (a published version never changes). Start a new run for those prompts."
            )
        logger.info("run run_id=%s is already complete: nothing to do", run.run_id)
        report = RunReport.model_validate(store.read_json(layout.report_json))
        return _summary_from_report(report, store, layout, complete=True)
    write_attempt_record(context, "preflight", preflight_report)
    series_entry = open_series_entry(context) if config.series else None

    enter_stage(logger, Stage.PREPARE_PROMPTS, datasets=len(config.datasets))
    prepared_futures: list[PrefectFuture[PreparedDataset]] = []
    corpus = CorpusIds()
    # Every dataset is read and normalised at once in worker processes; each prepare task then waits for
    # (and dedupes against) the datasets before it, in config order.
    with prompt_scans(context) as scans:
        for dataset in config.datasets:
            earlier: Any = list(prepared_futures)
            prepared_futures.append(prepare_prompts.submit(context, dataset.name, earlier, corpus, scans))
        # Every dataset is prepared before training is halted: one that yields too few prompts refuses the
        # run while training still runs, and the shards written here are the ones the run generates from.
        check_prompts(context, *_prepared_outcomes(config, prepared_futures))
    if series_entry is not None:
        # Recorded before any GPU work: a later run of the series never takes these prompts again.
        taken = [future.result() for future in prepared_futures]
        write_ledger(context, series_entry, taken)

    held_back: list[TrainingNotRestartedError] = []
    done = run.resumed and _all_shards_done(store, layout, [future.result() for future in prepared_futures])
    if done:
        prepared = [future.result() for future in prepared_futures]
        shard_summaries = [_stored_summary(store, layout, s) for p in prepared for s in p.shards]
        if retry_failed:
            retryable = retryable_failures(store, shard_summaries)
            logger.info("failures to send again: %d", retryable)
            done = not retryable
    if done:
        logger.info("every shard is already generated: training is not halted, no server is started")
        servers, generation_wall_s = 0, 0.0
        errors: list[BaseException] = []
    elif config.hosts:
        # Several boxes: each host part halts its training and serves (flows/host_part.py); this flow holds no
        # GPU lock and halts nothing itself, it only sends the requests.
        enter_stage(logger, Stage.GENERATE, hosts=len(config.hosts))
        prepared, shard_summaries, errors, servers, generation_wall_s = _generate_on_hosts(
            context, prepared_futures, flow_run_id, hosts_request, retry_failed
        )
    else:
        enter_stage(logger, Stage.GPU_LOCK)
        gpus = gpu_lock.enter_context(hold_host_gpus(run.run_id))
        if read_manifest(store, layout) is not None:
            # Completed by another runner of this run id while this one waited for the GPUs (a runner without
            # a lease: two `datagen run` on one box); nothing was halted yet.
            logger.info("run run_id=%s was completed while this run waited for the GPUs", run.run_id)
            report = RunReport.model_validate(store.read_json(layout.report_json))
            return _summary_from_report(report, store, layout, complete=True)

        def record(name: str, value: BaseModel) -> str:
            return write_attempt_record(context, name, value)

        with serve_on_this_box(config, gpus, run.run_id, state_dir, record) as serving:
            servers = len(serving.plan.servers)
            enter_stage(logger, Stage.GENERATE)
            with Dispatcher(
                serving.urls,
                model=serving.plan.served_model_name,
                engine=config.fleet.engine,
                max_inflight_per_server=serving.plan.dispatcher_inflight,
                generation=config.generation,
                liveness=serving.fleet.is_alive,
                api_key=server_api_key(),
                exact_tokens=datagen.engines.exact_tokens_enabled(config),
            ) as dispatcher:
                serving.fleet.on_server_moved(dispatcher.move_server)
                generation_started = time.monotonic()
                finished = False
                try:
                    prepared, shard_summaries, errors = _generate_all(
                        context, prepared_futures, dispatcher, retry_failed, generation_started
                    )
                    finished = True
                finally:
                    # Recorded even when interrupted: the report's throughput counts every attempt's time.
                    generation_wall_s = time.monotonic() - generation_started
                    _record_generation_window(context, generation_wall_s, servers, finished)
        held_back = serving.held_back
    unfixable = [error for error in errors if isinstance(error, UnfixableStorageError)]
    if unfixable:
        raise unfixable[0]  # its own line names the fault and where; the terminal adds the resume command
    if errors:
        raise ShardsFailedError(
            f"{len(errors)} shard(s) failed (first: {errors[0]!r}); everything else is stored and a resume "
            "does not generate finished requests again",
            run_id=run.run_id,
            failed_shards=len(errors),
        ) from errors[0]
    # A run that mostly failed publishes nothing: a 0-row version would read as done (everything stays stored).
    check_failed_share(store, shard_summaries, config.generation.max_failed_share)
    merge_context = context
    if series_entry is not None:
        # The series' last version is the base (fixed in series.json when the run opened).
        merge_context = context.with_config(
            config.model_copy(
                update={
                    "tokenize": config.tokenize.model_copy(update={"base_version": series_entry.base_version})
                }
            )
        )
    enter_stage(logger, Stage.MERGE_AND_TOKENIZE)
    tokenize_summary = merge_and_tokenize(merge_context, shard_summaries)
    enter_stage(logger, Stage.REPORT)
    report = write_report(context, prepared, shard_summaries, tokenize_summary, servers, generation_wall_s)
    enter_stage(logger, Stage.MANIFEST)
    finalize_manifest(context, report)
    summary = _summary_from_report(report, store, layout, complete=False)
    logger.info(
        "run complete run_id=%s completions=%d failures=%d tokenized_rows=%d url=%s",
        summary.run_id,
        summary.completions,
        summary.failures,
        summary.tokenized_rows,
        summary.run_url,
    )
    if held_back:
        # Every object is stored and the run is complete; only training's restart was held back.
        raise held_back[0]
    return summary


if __name__ == "__main__":
    import sys

    from datagen.app.run_request import resolve_config_file

    run_with_config(resolve_config_file(Path(sys.argv[1])))
