"""Progress bars for the commands that work outside a run (``corpus adopt``, ``export``, ``tune``), on a terminal.

The core reports how far a long step is (:func:`datagen.progress.report_work`); :func:`work_bars` draws one bar
per step for the block when stdout is a terminal, and nothing otherwise (a pipe gets the command's lines as
before). The command's own lines come after the block, under the finished bars.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from datagen.app.runview import stdout_is_terminal
from datagen.progress import WorkProgress, watching


class WorkBars:
    """One rich bar per step the core reports: a :class:`datagen.progress.WorkWatcher`.

    Stages and generation belong to a run's view (:mod:`datagen.app.runview`), so the bars do not follow them.

    Args:
        progress: The bars' display.
    """

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self._tasks: dict[str, TaskID] = {}

    def work_progressed(self, progress: WorkProgress) -> None:
        """Move the step's bar (made at its first report)."""
        task = self._tasks.get(progress.what)
        if task is None:
            task = self._tasks[progress.what] = self.progress.add_task(
                progress.what, total=progress.total, unit=progress.unit, detail=progress.detail
            )
        self.progress.update(
            task, completed=progress.done, total=progress.total, unit=progress.unit, detail=progress.detail
        )


@contextlib.contextmanager
def work_bars() -> Iterator[None]:
    """Bars of the long steps the block reports, when stdout is a terminal; nothing otherwise."""
    if not stdout_is_terminal():
        yield
        return
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(bar_width=30),
        MofNCompleteColumn(),
        TextColumn("{task.fields[unit]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[detail]}", style="dim"),
    )
    with Progress(*columns) as progress, watching(WorkBars(progress)):
        yield
