"""What the flow needs around its tasks: the host's GPU lock, thread logs in the run log, the code check."""

from __future__ import annotations

import contextlib
import logging
import re
import socket
from collections.abc import Iterator
from pathlib import Path

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.logging.handlers import APILogHandler
from prefect.runtime import deployment as runtime_deployment

from datagen.app.codeversion import check_code_version
from datagen.app.terminal import REFUSALS, RUN_FAILED_LOG_PREFIX
from datagen.errors import DatagenError, GpuLockTimeoutError
from datagen.settings import get_settings

# A first, short try at the GPU lock: when it fails another run holds the GPUs, and the run says so.
GPU_LOCK_PROBE_S = 5.0
# The slot is leased and renewed in the background (every 3/4 of the lease); a run killed with SIGKILL
# cannot release it, so its lease expiring is what frees the box: the shortest lease Prefect's API accepts
# (60 s), so the next run waits at most a minute, not Prefect's default 5 min.
GPU_LOCK_LEASE_S = 60.0
# The package whose loggers (fleet monitor, dispatcher thread, storage retries) belong in the run log.
DATAGEN_LOGGER = "datagen"
# Prefect's run loggers: its flow engine logs "Encountered exception during execution" on the first, its task
# engine "Task run failed with exception" on the second, each with the traceback.
PREFECT_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


def gpu_lock_name() -> str:
    """The global concurrency limit guarding this host's GPUs: the setting, or one per hostname."""
    configured = get_settings().gpu_lock
    if configured:
        return configured
    host = re.sub(r"[^a-z0-9-]+", "-", socket.gethostname().lower()).strip("-") or "localhost"
    return f"datagen-gpus-{host}"


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


@contextlib.contextmanager
def hold_host_gpus() -> Iterator[str]:
    """Hold this host's GPU lock for the whole run: a second run on the host waits here, never beside it.

    Yields:
        The lock's name.

    Raises:
        GpuLockTimeoutError: Another run held the GPUs for longer than ``gpu_lock_timeout_s``.
    """
    name = gpu_lock_name()
    timeout_s = get_settings().gpu_lock_timeout_s
    logger = get_run_logger()
    ensure_limit(name)
    acquired = False  # a TimeoutError raised by the run itself must not look like a wait for the lock
    try:
        with concurrency(
            name, occupy=1, timeout_seconds=GPU_LOCK_PROBE_S, lease_duration=GPU_LOCK_LEASE_S, strict=True
        ):
            acquired = True
            logger.info("holding this host's GPUs lock=%s", name)
            yield name
            return
    except TimeoutError:
        if acquired:
            raise
        logger.warning(
            "another run holds this host's GPUs (global concurrency limit %s): waiting for it to finish, "
            "at most %.0f s; this run starts nothing until then",
            name,
            timeout_s,
        )
    try:
        with concurrency(
            name, occupy=1, timeout_seconds=timeout_s, lease_duration=GPU_LOCK_LEASE_S, strict=True
        ):
            acquired = True
            logger.info("holding this host's GPUs lock=%s", name)
            yield name
    except TimeoutError:
        if acquired:
            raise
        raise GpuLockTimeoutError(
            f"Another run held this host's GPUs (global concurrency limit {name!r}) for more than "
            f"{timeout_s:.0f} s. See the running flow runs in the Prefect UI; start this run again when "
            "that one is done (or raise DATAGEN_GPU_LOCK_TIMEOUT_S).",
            lock=name,
        ) from None


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


@contextlib.contextmanager
def explain_failure() -> Iterator[None]:
    """Log why the run failed, and get that line to the API before the run turns Failed.

    ``prefect deployment run --watch`` prints the run's logs only until a few seconds after its final state,
    and Prefect ships logs in batches: without the flush the reason can arrive after the watch has stopped.
    A refusal's reason is that one line: Prefect's tracebacks of it are logged at DEBUG only
    (:func:`refusal_tracebacks_at_debug`).
    """
    refusal_tracebacks_at_debug()
    try:
        yield
    except Exception as error:
        kind = "" if isinstance(error, DatagenError) else f"{type(error).__name__}: "
        get_run_logger().error("%s%s%s", RUN_FAILED_LOG_PREFIX, kind, error)
        with contextlib.suppress(Exception):
            APILogHandler().flush()
        raise


def verify_code_version(flow_file: str) -> str | None:
    """Refuse to run other code than the deployment names (see :mod:`datagen.app.codeversion`).

    Args:
        flow_file: ``__file__`` of the flow module: its checkout is the code this process runs.

    Returns:
        The checkout's version.
    """
    version = runtime_deployment.version
    actual = check_code_version(version, Path(flow_file).resolve().parents[1])
    if version:
        get_run_logger().info("code version deployed=%s checkout=%s", version, actual)
    return actual
