"""A cancel through the Prefect API stops the run even when Prefect's own cancellation watch has given up.

Prefect stops a cancelled flow run from outside: the runner that started it (a worker, ``serve``) watches for
``Cancelling`` and SIGTERMs the flow process. That watch ends for good once three of its polls in a row fail
(``prefect/_internal/_observation_delivery.py`` polls through ``critical_service_loop``, which raises after
three consecutive errors, ``prefect/utilities/services.py``; the observer then logs ``Cancellation polling task
failed ... flow run cancellation will fail``, ``prefect/_internal/observers.py``): an API away for ~20 s leaves
the run uncancellable. A flow run started in-process (``datagen run``) has no such watch at all.

:func:`run_cancellable` runs the flow's body with a watch of its own: a thread reads the flow run's state
every :data:`CANCEL_POLL_S` through outages. When the run is ``Cancelling`` and nobody else stopped it (no
runner: at once; under a runner: after :data:`RUNNER_GRACE_S`), it SIGTERMs this process, the path every
interrupted run takes (servers stopped, training handed back, GPU lock released), and the run ends
``Cancelled``. When the runner does act (its SIGTERM arrives first), the watch stands down: one owner per cancel.
"""

from __future__ import annotations

import contextvars
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar
from uuid import UUID

from prefect import get_run_logger
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.objects import State, StateType
from prefect.context import FlowRunContext
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings
from prefect.states import Cancelled

T = TypeVar("T")

# How often the run reads its own state: a cancel takes effect within this (plus the grace under a runner).
CANCEL_POLL_S = 5.0
# One read's HTTP timeout, never retried by Prefect's client: the next poll is the retry.
CANCEL_READ_TIMEOUT_S = 5.0
# Under a runner (worker, serve), how long a Cancelling state is left to it first. Its watch polls every 10 s
# (+-30%) while its event stream is down, and SIGTERMs the run as soon as it sees the cancel: a runner that
# still watches has acted well within this.
RUNNER_GRACE_S = 30.0
# Prefect's runner sets this to "false" in the processes it starts: it owns their cancellation
# (prefect/flow_engine.py, ``_engine_owns_cancellation_handling``).
RUNNER_OWNS_CANCELLATION_ENV = "PREFECT__ENABLE_CANCELLATION_AND_CRASHED_HOOKS"


def is_cancelling(state_type: StateType | None, state_name: str | None) -> bool:
    """Whether a flow run's state asks it to stop: type CANCELLING, or a state named Cancelling (as Prefect reads it)."""
    return state_type == StateType.CANCELLING or state_name == "Cancelling"


def runner_owns_cancellation() -> bool:
    """Whether a Prefect runner (worker, ``serve``) started this process and stops it on a cancel."""
    return os.environ.get(RUNNER_OWNS_CANCELLATION_ENV, "true").lower() == "false"


class CancelWatch:
    """Reads the flow run's state from a thread and stops the run on a cancel nobody else acted on.

    Args:
        flow_run_id: The flow run this process runs.
        grace_s: How long a Cancelling state is left to whoever else owns the cancel (0: nobody else does).
        poll_s: Seconds between two reads of the state.
    """

    def __init__(self, flow_run_id: UUID, grace_s: float, poll_s: float = CANCEL_POLL_S) -> None:
        self.flow_run_id = flow_run_id
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.stopped_run = threading.Event()
        self._terminating = threading.Event()
        self._done = threading.Event()
        # Held while the watch decides to stop the run, and by stop(): no SIGTERM goes out after stop() returned.
        self._deciding = threading.Lock()
        self._previous_handler: Any = None
        self._thread = threading.Thread(
            target=contextvars.copy_context().run, args=(self._watch,), name="cancel-watch", daemon=True
        )

    def start(self) -> None:
        """Notice SIGTERMs (whoever sends one owns the run's end) and start watching; call from the main thread."""
        self._previous_handler = signal.getsignal(signal.SIGTERM)
        try:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: a SIGTERM goes unnoticed, the grace still applies
            self._previous_handler = None
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (a read under way is left to finish on its own) and give SIGTERM its handler back."""
        with self._deciding:
            self._done.set()
        if self._previous_handler is not None and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous_handler)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._terminating.set()
        previous = self._previous_handler
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _read_state(self, client: SyncPrefectClient) -> tuple[StateType | None, str | None]:
        flow_run = client.read_flow_run(self.flow_run_id)
        state = flow_run.state
        return (state.type, state.name) if state else (None, None)

    def _watch(self) -> None:
        logger = get_run_logger()
        seen_at: float | None = None
        away_since: float | None = None
        # Prefect's client would retry a failed read for about a minute: this thread polls again instead.
        with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}):
            while not self._done.wait(self.poll_s) and not self._terminating.is_set():
                try:
                    with get_client(
                        sync_client=True, httpx_settings={"timeout": CANCEL_READ_TIMEOUT_S}
                    ) as client:
                        state_type, state_name = self._read_state(client)
                except Exception as error:
                    if away_since is None:
                        away_since = time.monotonic()
                        logger.info("cancel watch cannot read the run's state (retrying) error=%s", error)
                    continue
                if away_since is not None:
                    logger.info(
                        "cancel watch reads the run's state again after %.0f s", time.monotonic() - away_since
                    )
                    away_since = None
                if not is_cancelling(state_type, state_name):
                    seen_at = None
                    continue
                now = time.monotonic()
                seen_at = now if seen_at is None else seen_at
                if now - seen_at >= self.grace_s:
                    self._stop_run(logger)
                    return

    def _stop_run(self, logger: Any) -> None:
        """SIGTERM this process for the cancel, unless the run ended or something else is stopping it."""
        with self._deciding:
            if self._done.is_set() or self._terminating.is_set():
                return
            waited = f" and not stopped by a runner within {self.grace_s:.0f} s" if self.grace_s else ""
            logger.warning(
                "run cancelled through the Prefect API%s: stopping it (servers stopped, training handed back)",
                waited,
            )
            self.stopped_run.set()
            os.kill(os.getpid(), signal.SIGTERM)


def run_cancellable(body: Callable[[], T]) -> T | State[Any]:
    """Run the flow's body; a cancel through the API that nobody else acts on ends it ``Cancelled``.

    Call it from the flow function (main thread). Whatever the body raises once the watch has stopped the run
    (the SIGTERM's exception, or one the interruption caused) becomes the ``Cancelled`` state the flow returns.

    Returns:
        The body's result, or the run's ``Cancelled`` state.
    """
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return body()
    grace_s = RUNNER_GRACE_S if runner_owns_cancellation() else 0.0
    watch = CancelWatch(context.flow_run.id, grace_s)
    watch.start()
    try:
        return body()
    except BaseException:
        if not watch.stopped_run.is_set():
            raise
    finally:
        watch.stop()
    message = (
        "cancelled through the Prefect API: servers stopped, training handed back; resume with the run id"
    )
    get_run_logger().warning("run %s", message)
    return Cancelled(message=message)
