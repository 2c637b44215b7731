"""What a `datagen run` in a terminal shows and how it ends: one message per outcome, documented exit codes.

The exit codes (README and docs/operations.md list them too):

====  =========================================================================================
0     done (or already complete)
1     the run failed after it started, or was cancelled through the Prefect API; everything finished is stored,
      rerun with ``--run-id``
2     bad configuration or a preflight refusal: nothing was halted or started
3     the run is complete, but training was not restarted: its environment changed since the halt, or its
      job still runs
130   interrupted by SIGINT (Ctrl-C); servers stopped, resumable with ``--run-id``
143   interrupted by SIGTERM; servers stopped, resumable with ``--run-id``
====  =========================================================================================

Tracebacks never reach the terminal: the console handlers drop records that carry one (and Prefect's
"Finished in state Failed" echo of the same failure), while a log file per run keeps everything, and
Prefect's own log keeps what it sends to the API. When stdout is a terminal, the run's live view
(:mod:`datagen.app.runview`) takes the console's place for the run, warnings and errors printed above it;
elsewhere (CI, systemd, a pipe) the console prints the log lines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, TypeVar

import typer

from datagen.errors import (
    ConfigError,
    DatagenError,
    NoTrainingRowsError,
    PreflightError,
    RunCancelled,
    RunInterrupted,
    TooManyFailuresError,
    TrainingNotRestartedError,
    WindowEndedError,
)

if TYPE_CHECKING:
    from datagen.config import RunConfig
    from datagen.dataset.report import RunSummary

StartFlow = Callable[["RunConfig", "str | None", bool], Callable[[], "RunSummary"]]
"""How the command line reaches the `expand` flow (the console script, ``flows/cli_entry.py``, passes it in).

Called with the resolved config (:func:`datagen.app.run_request.resolve_config_file`), its name when it is one of
the checkout's configs (a multi-host run's hosts resolve it by it) and ``retry_failed``: imports Prefect and
the flow, which configures Prefect's logging, and returns the run, so :func:`run_in_terminal` sets up its log
file in between. The core never imports Prefect, and ``datagen --help`` stays fast.
"""

# The errors that refuse a run before anything was halted or started (exit 2): their message is the whole story.
REFUSALS: tuple[type[DatagenError], ...] = (PreflightError, ConfigError)
# `datagen run`'s option that sends a run's retryable failures again.
RETRY_FAILED_FLAG = "--retry-failed"

EXIT_DONE = 0
EXIT_RUN_FAILED = 1
EXIT_REFUSED = 2
EXIT_TRAINING_HELD_BACK = 3
# The generation window ended the run before every request was answered: training runs again, what finished is
# published as a dataset version, and the same command (its run id) sends the rest and publishes the next one.
EXIT_WINDOW_ENDED = 4
# The shell's convention for a process ended by a signal: 128 + the signal number.
SIGNAL_EXIT_BASE = 128
INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"

T = TypeVar("T")

# The run's own failure, with its traceback, for the log file only. Not a child of ``datagen``'s logger: the
# flow has ended by now, and Prefect's API handler on that logger would warn about a record without a flow run.
_FILE_ONLY = logging.getLogger("datagen_terminal")
_FILE_ONLY.propagate = False
_FILE_ONLY.setLevel(logging.DEBUG)
_FILE_ONLY.addHandler(logging.NullHandler())  # before the log file exists: nothing, not Python's last resort


def exit_code_for_signal(signum: int) -> int:
    """The exit code of a run interrupted by ``signum`` (130 for SIGINT, 143 for SIGTERM)."""
    return SIGNAL_EXIT_BASE + signum


class _Interrupts:
    """Turns the first SIGINT/SIGTERM into :class:`RunInterrupted`; later ones only say cleanup is under way.

    A second Ctrl-C while servers are being stopped must not abandon them half-stopped.
    """

    def __init__(self) -> None:
        self.received: int | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            raise RunInterrupted(signum)
        print(
            f"datagen: {signal.Signals(signum).name} again: still stopping the servers, one moment",
            file=sys.stderr,
        )


@contextlib.contextmanager
def interrupt_signals() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise :class:`RunInterrupted` in the main thread (once)."""
    handler = _Interrupts()
    previous = {signum: signal.signal(signum, handler) for signum in INTERRUPT_SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


# The flow logs why a run failed under this prefix (for the Prefect UI and `--watch`); the terminal prints
# its own one line for the same failure, so the console leaves this one out.
RUN_FAILED_LOG_PREFIX = "run failed: "


class _ConsoleFilter(logging.Filter):
    """Keeps tracebacks (and Prefect's echoes of a failure) off the terminal; the log file has them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info or record.exc_text or record.stack_info:
            return False
        if not record.name.startswith("prefect"):
            return True
        message = record.getMessage()
        return not message.startswith(
            ("Finished in state Failed", "Finished in state Crashed", RUN_FAILED_LOG_PREFIX)
        )


def _console_handlers() -> list[logging.Handler]:
    loggers: list[logging.Logger] = [logging.getLogger()]
    loggers += [item for item in logging.root.manager.loggerDict.values() if isinstance(item, logging.Logger)]
    found: list[logging.Handler] = []
    for item in loggers:
        for handler in item.handlers:
            if (
                isinstance(handler, logging.StreamHandler)
                and not isinstance(handler, logging.FileHandler)
                and handler not in found
            ):
                found.append(handler)
    return found


def _run_loggers() -> list[logging.Logger]:
    """The loggers every record of a run reaches: the root, and those that do not propagate to it.

    datagen's logger does not when Prefect adds it as an extra logger.
    """
    return [logging.getLogger()] + [
        logging.getLogger(name) for name in ("datagen",) if not logging.getLogger(name).propagate
    ]


@contextlib.contextmanager
def _live_view(run_id: str, log_path: Path) -> Iterator[None]:
    """The run's live view for the block instead of the console's log lines (within :func:`terminal_logging`)."""
    from datagen.app.runview import live_run_view

    with live_run_view(run_id, log_path, _console_handlers(), _run_loggers(), _ConsoleFilter()):
        yield


@contextlib.contextmanager
def terminal_logging(log_path: Path) -> Iterator[Path]:
    """Log everything (tracebacks included) to ``log_path``; keep tracebacks off the console.

    Call it after Prefect configured logging (Prefect is imported), so its console handlers are found.

    Args:
        log_path: The run's log file (its folder is created).

    Yields:
        ``log_path``.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(log_path, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter(LOG_FORMAT))
    console_filter = _ConsoleFilter()
    consoles = _console_handlers()
    targets = _run_loggers()
    for handler in consoles:
        handler.addFilter(console_filter)
    targets.append(_FILE_ONLY)
    for target in targets:
        target.addHandler(file_handler)
    try:
        yield log_path
    finally:
        for target in targets:
            target.removeHandler(file_handler)
        for handler in consoles:
            handler.removeFilter(console_filter)
        file_handler.close()


def run_log_path(state_dir: str, run_id: str) -> Path:
    """Where the log of one `datagen run` invocation goes: ``<state_dir>/logs/<run_id>-<time>.log``."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(state_dir).expanduser() / "logs" / f"{run_id}-{stamp}.log"


def _echo_error(message: str) -> None:
    print(message, file=sys.stderr)


def resume_for(error: BaseException, resume_command: str) -> str:
    """The one command that resumes after ``error``: with ``--retry-failed`` when only that gets further.

    A run ended by its failed share (:class:`TooManyFailuresError`) whose failures are worth sending again
    would end the same way on a plain resume: its failures are final until they are sent again on purpose.
    """
    if (
        isinstance(error, TooManyFailuresError)
        and error.retryable
        and RETRY_FAILED_FLAG not in resume_command
    ):
        return f"{resume_command} {RETRY_FAILED_FLAG}"
    return resume_command


def run_in_terminal(
    load_run: Callable[[], Callable[[], T]],
    *,
    run_id: str,
    resume_command: str,
    log_path: Path,
) -> tuple[int, T | None]:
    """Run under the terminal's rules: signals, one message per outcome, an exit code.

    Args:
        load_run: Imports what the run needs (Prefect, which configures its console logging on import)
            and returns the run itself; :func:`terminal_logging` starts in between.
        run_id: The run's id (for the messages).
        resume_command: The command that resumes this run, quoted in failure and interrupt messages.
        log_path: The run's log file, quoted in failure messages.

    Returns:
        The exit code, and what the run returned when it finished (code 0).
    """
    from datagen.app.runview import starting_notice, stdout_is_terminal

    with interrupt_signals(), contextlib.ExitStack() as stack:
        try:
            live = stdout_is_terminal()
            with starting_notice(run_id) if live else contextlib.nullcontext():
                run = load_run()
            stack.enter_context(terminal_logging(log_path))
            # Ended before any outcome line below: the view stays on screen, the line after it.
            with _live_view(run_id, log_path) if live else contextlib.nullcontext():
                result = run()
            return EXIT_DONE, result
        except RunInterrupted as interrupted:
            _echo_error(
                f"datagen: run {run_id} interrupted by {interrupted.signal_name}: servers stopped, everything "
                f"finished so far is stored. Resume with: {resume_command}"
            )
            return exit_code_for_signal(interrupted.signum), None
        except RunCancelled:
            _FILE_ONLY.info("run cancelled", exc_info=True)
            _echo_error(
                f"datagen: run {run_id} cancelled through the Prefect API: servers stopped, everything finished "
                f"so far is stored. Resume with: {resume_command}"
            )
            return EXIT_RUN_FAILED, None
        except WindowEndedError as ended:
            _FILE_ONLY.info("window ended", exc_info=True)
            published = f"{ended.published_rows} rows published as {ended.published}"
            if not ended.published:
                because = ended.unpublished_because
                published = f"nothing published yet ({because})" if because else "nothing published yet"
            _echo_error(
                f"datagen: run {run_id}: the generation window ended with {ended.unsent} of {ended.requests} "
                f"requests not yet answered; training runs again, every answer is stored, {published}. Send the "
                f"rest (the next version) with: {resume_command}"
            )
            return EXIT_WINDOW_ENDED, None
        except TrainingNotRestartedError as held_back:
            logging.getLogger(__name__).info("training held back", exc_info=True)
            _echo_error(f"datagen: run {run_id} is complete and stored, but {held_back}")
            return EXIT_TRAINING_HELD_BACK, None
        except REFUSALS as refused:
            _FILE_ONLY.info("run refused", exc_info=True)
            _echo_error(f"datagen: {refused}")
            return EXIT_REFUSED, None
        except NoTrainingRowsError as nothing:
            _FILE_ONLY.error("run failed", exc_info=True)
            _echo_error(f"datagen: run {run_id} failed: {nothing} (full log: {log_path})")
            return EXIT_RUN_FAILED, None
        except DatagenError as error:
            _FILE_ONLY.error("run failed", exc_info=True)
            _echo_error(
                f"datagen: run {run_id} failed: {error}; resume with: {resume_for(error, resume_command)} "
                f"(full log: {log_path})"
            )
            return EXIT_RUN_FAILED, None
        except Exception as error:
            _FILE_ONLY.error("run failed", exc_info=True)
            _echo_error(
                f"datagen: run {run_id} failed: {type(error).__name__}: {error}; resume with: "
                f"{resume_command} (full log: {log_path})"
            )
            return EXIT_RUN_FAILED, None
        except BaseException as error:
            # Prefect's own SIGTERM bridge (TerminationSignal) when it re-raises before ours runs.
            signum = getattr(error, "signal", None)
            if isinstance(signum, int) and signum in INTERRUPT_SIGNALS:
                name = signal.Signals(signum).name
                _echo_error(
                    f"datagen: run {run_id} interrupted by {name}: servers stopped, everything finished so "
                    f"far is stored. Resume with: {resume_command}"
                )
                return exit_code_for_signal(signum), None
            raise


def exit_now_if_threads_linger(code: int) -> None:
    """After an interrupt, end the process at once when worker threads are still busy; else return.

    By the time the terminal has printed its message the run has stopped its servers, handed training back
    and stopped its API server. A thread still blocked in I/O (an S3 request held by a slow endpoint, a
    dataset read) would keep the interpreter from exiting until it returns, minutes later: it is left
    behind instead. What it would still write is write-once, and the resume checks it.

    Args:
        code: The exit code (130 or 143).
    """
    busy = [
        thread
        for thread in threading.enumerate()
        if thread is not threading.main_thread() and thread.is_alive() and not thread.daemon
    ]
    if not busy:
        return
    # Not logged: the run's log file is closed by now, and datagen's loggers would reach for the stopped API.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
    # Last, where the eye lands: what the halt or the restart of training could not do or check.
    lines += [f"  training job  {note}" for note in summary.training_job]
    typer.echo("\n".join(lines))
