"""Watch, for real, which processes a block of code starts: /proc sampled in a thread while the block runs.

For checks such as "a small merge starts no tokenizer worker": a worker lives at least a few hundred
milliseconds (interpreter start and imports), far longer than the sampling interval, so one that starts is
seen. Processes that were already running when the block started (session servers) are not counted.
"""

from __future__ import annotations

import os
import threading
from types import TracebackType

from datagen.processes import descendants, read_command_line

SAMPLE_INTERVAL_S = 0.01


class ChildWatch:
    """Records every descendant of this process that appears while the ``with`` block runs.

    Attributes:
        started: Pid -> command line (its last one seen; None when it was gone before it could be read) of
            each new descendant.
    """

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.started: dict[int, str | None] = {}
        self._before: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="child-watch", daemon=True)

    def _sample(self) -> None:
        for pid in descendants(os.getpid()):
            if pid not in self._before:
                # Read again while it runs: a child seen between fork and exec still shows its parent's.
                command = read_command_line(pid)
                if command is not None or pid not in self.started:
                    self.started[pid] = command

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def commands(self, needle: str) -> list[str]:
        """Command lines of the new descendants that contain ``needle``."""
        return [command for command in self.started.values() if command and needle in command]

    def __enter__(self) -> ChildWatch:
        self._before = set(descendants(os.getpid()))
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
