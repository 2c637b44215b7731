"""What the flow needs around its tasks: the host's GPU lock, thread logs in the run log, the code check."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
from prefect.context import FlowRunContext
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.logging.handlers import APILogHandler
from prefect.runtime import deployment as runtime_deployment
from prefect.runtime import flow_run as runtime_flow_run

from datagen.app.codeversion import check_code_version
from datagen.app.deploy import pool_template, refused_job_variables
from datagen.app.terminal import REFUSALS, RUN_FAILED_LOG_PREFIX
from datagen.errors import (
    DatagenError,
    JobVariablesError,
    TooManyFailuresError,
    TrainingNotRestartedError,
)
from datagen.host.gpu_lock import (
    GpuLockHolder,
    HostGpuLock,
    current_holder,
    gpu_lock_name,
    hold_gpu_lock,
    lock_path,
)
from datagen.host.handback import halt_record_path, hand_back_gpus
from datagen.host.training import RestartRecord
from datagen.settings import get_settings

# The package whose loggers (fleet monitor, dispatcher thread, storage retries) belong in the run log.
DATAGEN_LOGGER = "datagen"
# Prefect's run loggers: its flow engine logs "Encountered exception during execution" on the first, its task
# engine "Task run failed with exception" on the second, each with the traceback.
PREFECT_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


def ensure_limit(name: str) -> None:
    """Create the limit (1 slot) when missing; another run creating it at the same time is fine."""
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
            return
        except ObjectNotFound:
            pass
        with contextlib.suppress(ObjectAlreadyExists):
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))


def release_stale_prefect_slot(name: str) -> None:
    """Free a slot of the Prefect limit ``name`` that an earlier datagen version or a crash left taken.

    Up to datagen 0.1 of 1 Dec 2026 the GPU lock was this global concurrency limit, leased through the
    Prefect server; a run killed with its temporary server left the slot taken for good. Called with the OS
    lock held, so any slot still taken belongs to nobody. A Prefect API that cannot be read is no reason to
    keep the GPUs idle: the OS lock is the lock.
    """
    try:
        with get_client(sync_client=True) as client:
            limit = client.read_global_concurrency_limit_by_name(name)
            if limit.active_slots <= 0:
                return
            client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))
    except ObjectNotFound:
        return
    except Exception as error:
        get_run_logger().debug("stale GPU lock slot not checked name=%s error=%s", name, error)
        return
    get_run_logger().warning(
        "released %d slot(s) of the Prefect global concurrency limit %s left taken by an earlier datagen "
        "version or a crashed run; this host's GPU lock is now a file lock, freed when its holder dies",
        limit.active_slots,
        name,
    )


@dataclass(frozen=True)
class HostGpus:
    """A run's hold on the host's GPUs: the lock file, and where the training halt is recorded."""

    lock_file: Path
    halt_record: Path


def _flow_run_id() -> str | None:
    context = FlowRunContext.get()
    return str(context.flow_run.id) if context and context.flow_run else None


@contextlib.contextmanager
def hold_host_gpus(run_id: str | None) -> Iterator[HostGpus]:
    """Hold this host's GPU lock for the block: a second run on the host waits here, never beside it.

    The lock is an OS file lock (:mod:`datagen.host.gpu_lock`): the kernel releases it when this process
    dies, however it dies. Waiting for it obeys SIGINT/SIGTERM at once.

    Args:
        run_id: The run taking the GPUs (named in the lock file for whoever waits).

    Yields:
        The held GPUs.

    Raises:
        GpuLockTimeoutError: Another run held the GPUs for longer than ``gpu_lock_timeout_s``.
    """
    settings = get_settings()
    name = gpu_lock_name()
    path = lock_path(settings.lock_dir, name)
    logger = get_run_logger()

    def say_waiting(holder: GpuLockHolder | None) -> None:
        logger.warning(
            "another run holds this host's GPUs (lock file %s, held by %s): waiting for it to finish, at most "
            "%.0f s; this run starts nothing until then",
            path,
            holder.describe() if holder else "a process that has not named itself yet",
            settings.gpu_lock_timeout_s,
        )

    holder = current_holder(run_id, _flow_run_id())
    with hold_gpu_lock(
        path, holder, timeout_s=settings.gpu_lock_timeout_s, on_wait=say_waiting, name=name
    ) as lock:
        logger.info("holding this host's GPUs lock=%s file=%s", name, lock.path)
        release_stale_prefect_slot(name)
        yield HostGpus(lock_file=path, halt_record=halt_record_path(path))


def hand_back_if_gpus_free() -> RestartRecord | None:
    """Hand training back for a run that ended without doing so, unless another run holds the GPUs now.

    For the cancellation/crash hook, which may run in the worker process after the flow process died: the
    kernel freed the dead run's lock, so the hook takes it (never waiting) while it restarts training. A run
    that took the GPUs meanwhile has adopted the halt and hands training back itself. Also for a resume that
    finds every shard stored (its attempt before was killed while stopping its fleet): it takes no GPUs, so
    it adopts no halt.
    """
    path = lock_path(get_settings().lock_dir, gpu_lock_name())
    lock = HostGpuLock(path)
    if not lock.try_acquire(current_holder(None, _flow_run_id())):
        return None
    try:
        return hand_back_gpus(halt_record_path(path))
    except TrainingNotRestartedError as held_back:
        logging.getLogger(__name__).error("%s", held_back)
        return None
    finally:
        lock.release()


class _StampRunId(logging.Handler):
    """Gives datagen records logged outside the run's context (threads) the flow run id, first in line.

    Prefect's API log handler sends a record only when it knows its flow run; threads the core starts (fleet
    monitor, dispatcher loop) carry no Prefect context, so their records would be dropped with a warning.
    """

    def __init__(self, flow_run_id: str) -> None:
        super().__init__()
        self.flow_run_id = flow_run_id

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "flow_run_id", None) is None:
            record.flow_run_id = self.flow_run_id


@contextlib.contextmanager
def forward_thread_logs(flow_run_id: str) -> Iterator[None]:
    """Send every ``datagen.*`` log record of this process, from any thread, to the flow run's log.

    Args:
        flow_run_id: The flow run the records belong to (this process runs one flow run at a time).
    """
    logger = logging.getLogger(DATAGEN_LOGGER)
    stamp = _StampRunId(flow_run_id)
    added_api: APILogHandler | None = None
    if not any(isinstance(handler, APILogHandler) for handler in logger.handlers):
        # PREFECT_LOGGING_EXTRA_LOGGERS=datagen was not set: attach Prefect's handler for this run.
        added_api = APILogHandler()
        logger.addHandler(added_api)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    # First in line, so the API handler after it sees the id.
    logger.handlers.insert(0, stamp)
    try:
        yield
    finally:
        logger.removeHandler(stamp)
        if added_api is not None:
            logger.removeHandler(added_api)


class _RefusalTracebacksAtDebug(logging.Filter):
    """Turns Prefect's records of a refusal's traceback into DEBUG records (dropped at the default level).

    A refusal (:data:`~datagen.app.terminal.REFUSALS`) is explained by one ``run failed:`` line and the run's
    state message; the flow and task engines' tracebacks of it (about 150 lines each) would bury that line at
    the end of a CI log. Records of every other error keep their level and traceback.
    """

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, REFUSALS) or record.levelno <= logging.DEBUG:
            return True
        # The logger's level was checked before the record existed: check it again for the new level.
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return self.logger.isEnabledFor(logging.DEBUG)


def refusal_tracebacks_at_debug() -> None:
    """Log a refusal's traceback at DEBUG only, on Prefect's run loggers of this process (once per process).

    The filter stays installed: the flow engine logs its record after the flow function has returned, and it
    changes nothing but records of a refusal.
    """
    for name in PREFECT_RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _RefusalTracebacksAtDebug) for existing in logger.filters):
            logger.addFilter(_RefusalTracebacksAtDebug(logger))


class DeploymentResume:
    """How a deployed run that failed resumes: the same deployment with its config and run id.

    The flow fills in ``config`` and ``run_id`` once the run's parameters are resolved; before that (a refused
    request) there is nothing to resume. The terminal says the same for ``datagen run`` in its own words.
    """

    def __init__(self) -> None:
        self.config: str | None = None
        self.run_id: str | None = None

    def __call__(self, error: Exception) -> str | None:
        """The one resume instruction after ``error``; None for a refusal or before the run id is known."""
        if self.config is None or self.run_id is None or isinstance(error, REFUSALS):
            return None
        retry = isinstance(error, TooManyFailuresError) and error.retryable
        return f"run the deployment again with config={self.config} run_id={self.run_id}" + (
            " retry_failed=true" if retry else ""
        )


@contextlib.contextmanager
def explain_failure(resume: Callable[[Exception], str | None] | None = None) -> Iterator[None]:
    """Log why the run failed, and how to resume it, and get that line to the API before the run turns Failed.

    ``prefect deployment run --watch`` prints the run's logs only until a few seconds after its final state,
    and Prefect ships logs in batches: without the flush the reason can arrive after the watch has stopped.
    A refusal's reason is that one line: Prefect's tracebacks of it are logged at DEBUG only
    (:func:`refusal_tracebacks_at_debug`).

    Args:
        resume: The resume instruction for an error (:class:`DeploymentResume`); None where another part
            says it (``datagen run``'s terminal line).
    """
    refusal_tracebacks_at_debug()
    try:
        yield
    except Exception as error:
        kind = "" if isinstance(error, DatagenError) else f"{type(error).__name__}: "
        hint = resume(error) if resume is not None else None
        get_run_logger().error(
            "%s%s%s%s", RUN_FAILED_LOG_PREFIX, kind, error, f"; resume: {hint}" if hint else ""
        )
        with contextlib.suppress(Exception):
            APILogHandler().flush()
        raise


def verify_code_version(flow_file: str) -> str | None:
    """Refuse to run other code than the deployment names, or a run started otherwise than the pool says.

    The code check: :mod:`datagen.app.codeversion`. The start check: :func:`verify_job_variables`.

    Args:
        flow_file: ``__file__`` of the flow module: its checkout is the code this process runs.

    Returns:
        The checkout's version.
    """
    checkout = Path(flow_file).resolve().parents[1]
    verify_job_variables(checkout)
    version = runtime_deployment.version
    actual = check_code_version(version, checkout)
    if version:
        get_run_logger().info("code version deployed=%s checkout=%s", version, actual)
    return actual


def verify_job_variables(checkout: Path) -> None:
    """Refuse a run that sent job variables the checkout's work-pool template keeps for the box.

    The server refuses them for a pool ``datagen deploy`` wrote (see :mod:`datagen.app.deploy`); a run that
    carries them anyway met a pool with another template or an API call that skips that check, and may have
    started with an environment of its caller's choosing: it stops here, before anything is halted or started.

    Raises:
        JobVariablesError: Names the variables and how to fix the pool.
    """
    sent = runtime_flow_run.job_variables
    if not sent:
        return
    refused = refused_job_variables(sent, pool_template(checkout))
    if refused:
        raise JobVariablesError(
            f"job variables {', '.join(refused)} are not a run's to set: the work pool's job template fixes "
            "the command, environment and folder of every run. Start the run without them; if the pool let "
            "them through, run `datagen deploy` to give it the template in deployments/work-pool.json."
        )
