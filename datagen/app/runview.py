"""The live view of a run in a terminal: its stages as a checklist, generation's bar, warnings above them.

When ``datagen run`` or ``datagen demo`` writes to a terminal, :func:`live_run_view` replaces the console's log
lines with this view for the run: the run's stages (announced through :mod:`datagen.progress`, the one source of
where a run is) as a checklist, each with its time, and under the generation stage a bar with answered/total,
output tok/s, the ETA and the failures. Warnings and errors still reach the screen, as lines above the view;
everything else goes only to the run's log file and to Prefect. The view stays on screen when the run ends, the
run's one outcome line after it. Not a terminal (CI, systemd, a pipe): none of this, the log lines as before.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from datagen.progress import GenerationProgress, Stage, WorkProgress, format_duration, watching

# The checklist: one row per step a person tells apart, each fed by the stages the run announces for it.
CHECKLIST: tuple[tuple[str, tuple[Stage, ...]], ...] = (
    ("preflight", (Stage.PREFLIGHT,)),
    ("prepare prompts", (Stage.PREPARE_PROMPTS,)),
    ("halt training", (Stage.GPU_LOCK, Stage.HALT_TRAINING)),
    ("probe", (Stage.PROBE,)),
    ("plan", (Stage.PLAN,)),
    ("start fleet", (Stage.START_SERVERS,)),
    ("generate", (Stage.GENERATE,)),
    ("stop fleet", (Stage.STOP_SERVERS,)),
    ("merge & tokenize", (Stage.MERGE_AND_TOKENIZE,)),
    ("report", (Stage.REPORT, Stage.MANIFEST)),
)
# Stages that run however the stage before them ended (the fleet is stopped after a failure too).
AFTERMATH = frozenset({Stage.STOP_SERVERS})
# What a row says while its stage waits on something a person should know about.
STAGE_NOTES = {Stage.GPU_LOCK: "waiting for this host's GPU lock"}
# Redraws per second: the spinner and the running stage's clock move; the figures change as often as they come.
REFRESH_PER_S = 4
BAR_WIDTH = 30
BAR_DONE, BAR_LEFT = "━", "─"
# The checklist's columns: a mark, the label, the stage's time; the bar starts under the labels.
LABEL_WIDTH = max(len(label) for label, _ in CHECKLIST)
TIME_WIDTH = 10
BAR_INDENT = 2
# Below this, a stage's time is shown to a tenth of a second.
TENTHS_BELOW_S = 10.0
# The console handlers' format is Prefect's; the lines above the view are short: time, level, message.
WARNING_FORMAT = "%(asctime)s %(levelname)s %(message)s"
WARNING_TIME_FORMAT = "%H:%M:%S"


class RowState(enum.Enum):
    """Where one checklist row is, and the mark it shows."""

    PENDING = "·"
    RUNNING = ""  # a spinner
    DONE = "✓"
    SKIPPED = "-"
    FAILED = "✗"


@dataclass
class Row:
    """One checklist row: its label, state and times (``time.monotonic()``)."""

    label: str
    state: RowState = RowState.PENDING
    started: float | None = None
    ended: float | None = None
    note: str = ""


def _seconds(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < TENTHS_BELOW_S else format_duration(seconds)


class RunView:
    """What the view shows, fed by the run's announcements (every event of :data:`datagen.progress.RunWatcher`).

    Every change and every render holds one lock: the run announces from its own threads, rich draws from its
    refresh thread.

    Args:
        title: The header line (the run, where its full log is).
        clock: Seconds, monotonic (the rows' times).
    """

    def __init__(self, title: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.title = title
        self.clock = clock
        self.rows = [Row(label) for label, _ in CHECKLIST]
        self.progress: GenerationProgress | None = None
        self._row_of = {stage: index for index, (_, stages) in enumerate(CHECKLIST) for stage in stages}
        self._generate_row = self._row_of[Stage.GENERATE]
        self._current: int | None = None
        # The row an aftermath stage followed, its verdict open until the next stage or the end.
        self._unsettled: int | None = None
        # One spinner for the view: it animates by the time since it was made.
        self._spinner = Spinner("dots", style="cyan")
        self._lock = threading.Lock()

    def stage_entered(self, stage: Stage) -> None:
        """The run entered ``stage``: its row runs, the row before it is done, rows passed over are skipped.

        A stage that runs however the one before it ended (:data:`AFTERMATH`, stopping the fleet) leaves that
        one's verdict to what comes next: the next stage confirms it, a failure marks it failed.
        """
        with self._lock:
            now = self.clock()
            index = self._row_of[stage]
            row = self.rows[index]
            row.note = STAGE_NOTES.get(stage, "")
            if index == self._current:
                return
            if self._current is not None:
                self._end_row(self._current, RowState.DONE, now)
            if stage in AFTERMATH:
                self._unsettled = self._current
            else:
                self._unsettled = None
                for skipped in self.rows[:index]:
                    if skipped.state is RowState.PENDING:
                        skipped.state = RowState.SKIPPED
            row.state, row.started, row.ended = RowState.RUNNING, now, None
            self._current = index

    def generation_progressed(self, progress: GenerationProgress) -> None:
        """Generation so far: the bar's figures."""
        with self._lock:
            self.progress = progress

    def work_progressed(self, progress: WorkProgress) -> None:
        """A long step of the running stage (the merge's tokenization): said beside its row."""
        with self._lock:
            if self._current is not None:
                detail = f" · {progress.detail}" if progress.detail else ""
                self.rows[self._current].note = f"{progress.done}/{progress.total} {progress.unit}{detail}"

    def finish(self, succeeded: bool) -> None:
        """The run ended: its last stage done and the rest skipped; or the stage it failed in marked failed."""
        with self._lock:
            now = self.clock()
            failed = self._current if self._unsettled is None else self._unsettled
            if self._current is not None:
                self._end_row(self._current, RowState.DONE, now)
                self._current = None
            if not succeeded and failed is not None:
                self.rows[failed].state = RowState.FAILED
            if succeeded:
                for row in self.rows:
                    if row.state is RowState.PENDING:
                        row.state = RowState.SKIPPED

    def _end_row(self, index: int, state: RowState, now: float) -> None:
        row = self.rows[index]
        row.state, row.ended, row.note = state, now, ""

    def __rich__(self) -> RenderableType:
        with self._lock:
            now = self.clock()
            # The bar goes between two tables of the same fixed widths: the rows line up, the bar is not squeezed.
            upper, lower = self._table(), self._table()
            for index, row in enumerate(self.rows):
                (upper if index <= self._generate_row else lower).add_row(*self._cells(row, now))
            parts: list[RenderableType] = [Text(self.title, style="bold"), upper]
            if self.progress is not None:
                parts.append(self._bar(self.progress))
            parts.append(lower)
            return Group(*parts)

    @staticmethod
    def _table() -> Table:
        table = Table.grid(padding=(0, 1))
        table.add_column(width=1)
        table.add_column(width=LABEL_WIDTH, no_wrap=True)
        table.add_column(justify="right", width=TIME_WIDTH, no_wrap=True)
        table.add_column(no_wrap=True)
        return table

    def _cells(self, row: Row, now: float) -> tuple[RenderableType, Text, Text, Text]:
        if row.state is RowState.RUNNING:
            mark: RenderableType = self._spinner
        else:
            style = {RowState.DONE: "green", RowState.FAILED: "bold red"}.get(row.state, "dim")
            mark = Text(row.state.value, style=style)
        label_style = "dim" if row.state in (RowState.PENDING, RowState.SKIPPED) else ""
        took = ""
        if row.started is not None:
            took = _seconds((row.ended if row.ended is not None else now) - row.started)
        return (
            mark,
            Text(row.label, style=label_style),
            Text(took, style="dim"),
            Text(row.note, style="yellow"),
        )

    @staticmethod
    def _bar(progress: GenerationProgress) -> RenderableType:
        """Short lines under the generation row (they fit an 80-column terminal): the bar, then the rates.

        A third line says what training pays so far and the window's time left, when the flow gave them.
        """
        filled = min(BAR_WIDTH, BAR_WIDTH * progress.answered // max(progress.total, 1))
        # Two shapes, not only two colours: the bar reads the same without colour (a log viewer, a capture).
        bar = Text(" " * BAR_INDENT)
        bar.append(BAR_DONE * filled, style="green")
        bar.append(BAR_LEFT * (BAR_WIDTH - filled), style="dim")
        bar.append(f" {progress.percent:.1f}% · {progress.answered}/{progress.total} answered")
        for line in progress.conversation_lines():
            bar.append(f" · {line}")
        rates = Text(
            " " * BAR_INDENT + f"{progress.tokens_per_s:.1f} output tok/s · ETA {progress.eta_text} · "
        )
        rates.append(f"{progress.failed} failed", style="red" if progress.failed else "")
        cost = progress.cost_lines()
        if not cost:
            return Group(bar, rates)
        # What training pays so far, and the window's time left (yellow once admission stopped for its end).
        paid = Text(" " * BAR_INDENT + " · ".join(cost), style="yellow" if progress.window_closing else "")
        return Group(bar, rates, paid)


class _LinesAbove(logging.Handler):
    """Prints warnings and errors as short lines above the live view (tracebacks stay in the log file)."""

    def __init__(self, console: Console, keep: logging.Filter) -> None:
        super().__init__(logging.WARNING)
        self.console = console
        self.addFilter(keep)
        self.setFormatter(logging.Formatter(WARNING_FORMAT, WARNING_TIME_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            style = "yellow" if record.levelno < logging.ERROR else "red"
            self.console.print(Text(self.format(record), style=style), soft_wrap=True)
        except Exception:
            self.handleError(record)


class _DropAll(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def stdout_is_terminal() -> bool:
    """Whether the live view fits: stdout is a terminal that understands cursor movement."""
    try:
        return sys.stdout.isatty() and os.environ.get("TERM", "") not in ("", "dumb")
    except ValueError:  # a closed stdout
        return False


@contextlib.contextmanager
def live_run_view(
    run_id: str,
    log_path: Path,
    consoles: list[logging.Handler],
    log_targets: list[logging.Logger],
    keep: logging.Filter,
) -> Iterator[RunView]:
    """Show the run's live view for the block, instead of the console's log lines.

    Args:
        run_id: The run (the header names it).
        log_path: The run's full log (the header names it).
        consoles: The console log handlers to silence meanwhile (Prefect's, on stderr).
        log_targets: The loggers whose warnings and errors are printed above the view.
        keep: Which of those records reach the screen (no tracebacks, no echo of the outcome line).

    Yields:
        The view; it ends done when the block returns, failed when it raises.
    """
    view = RunView(f"run {run_id} · full log {log_path}")
    console = Console()
    above = _LinesAbove(console, keep)
    drop = _DropAll()
    for handler in consoles:
        handler.addFilter(drop)
    for logger in log_targets:
        logger.addHandler(above)
    succeeded = False
    try:
        with Live(view, console=console, refresh_per_second=REFRESH_PER_S), watching(view):
            try:
                yield view
                succeeded = True
            finally:
                view.finish(succeeded)
    finally:
        for logger in log_targets:
            logger.removeHandler(above)
        for handler in consoles:
            handler.removeFilter(drop)


@contextlib.contextmanager
def starting_notice(run_id: str) -> Iterator[None]:
    """A spinner while Prefect and the flow load (seconds of silence otherwise); gone when the block ends.

    Nothing is redirected meanwhile: the console handlers Prefect makes while it loads keep the real stderr.
    """
    notice = Spinner(
        "dots", text=Text(f"run {run_id}: starting Prefect and the flow", style="dim"), style="cyan"
    )
    with Live(
        notice,
        console=Console(),
        refresh_per_second=REFRESH_PER_S,
        transient=True,
        redirect_stdout=False,
        redirect_stderr=False,
    ):
        yield
