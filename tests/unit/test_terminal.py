"""`datagen run` at a terminal: one message per outcome, documented exit codes, signals, no tracebacks."""

from __future__ import annotations

import io
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from datagen.app.terminal import (
    EXIT_REFUSED,
    EXIT_RUN_FAILED,
    EXIT_WINDOW_ENDED,
    run_in_terminal,
    terminal_logging,
)
from datagen.errors import (
    DatagenError,
    NoTrainingRowsError,
    PreflightError,
    TooManyFailuresError,
    WindowEndedError,
)

RESUME = "datagen run --config run.yaml --run-id r-1"
# A signalled run must stop at once; a generous bound for a loaded 2-core box.
SIGNAL_EXIT_MAX_S = 5.0


def _run(tmp_path: Path, body: Callable[[], object]) -> tuple[int, object]:
    return run_in_terminal(
        lambda: body, run_id="r-1", resume_command=RESUME, log_path=tmp_path / "logs" / "r-1.log"
    )


def test_a_finished_run_exits_0_with_its_summary(tmp_path: Path) -> None:
    assert _run(tmp_path, lambda: "summary") == (0, "summary")


def test_a_preflight_refusal_exits_2_with_its_message_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse() -> None:
        raise PreflightError(["dataset 'junk' yields 0 prompt(s)"])

    assert _run(tmp_path, refuse) == (EXIT_REFUSED, None)
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "datagen: Preflight refused the run; nothing was stopped or started: dataset 'junk' yields 0 prompt(s)"
    ]


def test_a_failed_run_exits_1_saying_how_to_resume_and_where_the_traceback_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail() -> None:
        raise DatagenError("3 shard(s) failed")

    assert _run(tmp_path, fail) == (EXIT_RUN_FAILED, None)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "run r-1 failed: 3 shard(s) failed" in line and RESUME in line and "r-1.log" in line
    assert "Traceback" in (tmp_path / "logs" / "r-1.log").read_text()


@pytest.mark.parametrize(("retryable", "resume"), [(12, f"{RESUME} --retry-failed"), (0, RESUME)])
def test_a_run_ended_by_its_failures_names_the_one_resume_that_gets_further(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], retryable: int, resume: str
) -> None:
    def fail() -> None:
        raise TooManyFailuresError("12 of 12 requests failed", retryable=retryable)

    assert _run(tmp_path, fail) == (EXIT_RUN_FAILED, None)
    (line,) = capsys.readouterr().err.strip().splitlines()
    # A plain resume of a run whose failures are worth sending again would end the same way.
    assert f"resume with: {resume} (full log:" in line, line
    assert line.count("resume with") == 1 and line.count("--retry-failed") == (1 if retryable else 0), line


def test_a_run_whose_every_answer_was_dropped_names_no_resume_that_would_end_the_same(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail() -> None:
        raise NoTrainingRowsError("every one of the 3 completions merged was dropped (truncated 3)")

    assert _run(tmp_path, fail) == (EXIT_RUN_FAILED, None)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "run r-1 failed: every one of the 3 completions" in line and "r-1.log" in line, line
    assert RESUME not in line and "resume" not in line, line


@pytest.mark.parametrize(
    ("published", "rows", "said"),
    [
        ("/out/datasets/d/v0001.json", 40, "40 rows published as /out/datasets/d/v0001.json"),
        (None, 0, "nothing"),
    ],
)
def test_a_run_the_window_ended_exits_4_naming_what_it_published_and_the_command_that_sends_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], published: str | None, rows: int, said: str
) -> None:
    def end() -> None:
        raise WindowEndedError("window", unsent=56, requests=96, published=published, published_rows=rows)

    assert _run(tmp_path, end) == (EXIT_WINDOW_ENDED, None)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "the generation window ended with 56 of 96 requests not yet answered" in line, line
    assert said in line and line.endswith(RESUME), line


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_the_run_with_128_plus_its_number_and_the_resume_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], signum: signal.Signals, code: int
) -> None:
    cleaned: list[bool] = []

    def interrupted_mid_run() -> None:
        try:
            os.kill(os.getpid(), signum)
            time.sleep(30)
        finally:
            cleaned.append(True)  # the run's own finally blocks (stopping servers) still run

    started = time.monotonic()
    assert _run(tmp_path, interrupted_mid_run) == (code, None)
    assert time.monotonic() - started < SIGNAL_EXIT_MAX_S
    assert cleaned == [True]
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"interrupted by {signum.name}" in line and RESUME in line
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the previous handlers are restored"


def test_the_console_shows_no_traceback_while_the_log_file_keeps_it(tmp_path: Path) -> None:
    console = io.StringIO()
    handler = logging.StreamHandler(console)
    logger = logging.getLogger("datagen.tests.console")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with terminal_logging(tmp_path / "run.log") as log_path:
            logger.info("progress %d%%", 50)
            try:
                raise ValueError("deep inside")
            except ValueError:
                logger.exception("task failed")
            logging.getLogger("prefect.flow_runs").error("Finished in state Failed('deep inside')")
    finally:
        logger.removeHandler(handler)
    assert console.getvalue() == "progress 50%\n"
    logged = log_path.read_text()
    assert (
        "Traceback" in logged and "ValueError: deep inside" in logged and "Finished in state Failed" in logged
    )


def _logged_with_traceback(logger: logging.Logger, error: Exception) -> list[logging.LogRecord]:
    """What a handler on ``logger`` receives when Prefect's engine logs ``error`` with its traceback."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    # Only this handler: Prefect's API handler would warn that no flow run is running.
    handlers, propagate = logger.handlers, logger.propagate
    logger.handlers, logger.propagate = [handler], False
    try:
        try:
            raise error
        except Exception as raised:
            logger.error("Encountered exception during execution: %r", raised, exc_info=True)
    finally:
        logger.handlers, logger.propagate = handlers, propagate
    return records


@pytest.mark.parametrize("name", ["prefect.flow_runs", "prefect.task_runs"])
def test_under_a_worker_a_refusals_traceback_is_debug_only_and_other_errors_keep_theirs(name: str) -> None:
    from tasks.runtime import refusal_tracebacks_at_debug

    logger = logging.getLogger(name)
    refusal_tracebacks_at_debug()
    installed = list(logger.filters)
    refusal_tracebacks_at_debug()
    assert logger.filters == installed, "installed once per process, however often a flow starts"
    level = logger.level
    try:
        logger.setLevel(logging.INFO)
        assert _logged_with_traceback(logger, PreflightError(["dataset 'x' is missing"])) == []
        (kept,) = _logged_with_traceback(logger, RuntimeError("a bug"))
        assert kept.levelno == logging.ERROR and kept.exc_info is not None
        logger.setLevel(logging.DEBUG)
        (debug,) = _logged_with_traceback(logger, PreflightError(["dataset 'x' is missing"]))
        assert debug.levelno == logging.DEBUG and debug.exc_info is not None
    finally:
        logger.setLevel(level)
