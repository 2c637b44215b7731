"""A command on a pseudo-terminal, and the screen a person would see: test infrastructure, not datagen code.

:class:`PtyRun` starts a command with a pseudo-terminal as its stdin, stdout and stderr (as a shell in a terminal
window would) and reads everything it writes. :class:`Screen` replays those bytes as a terminal of a fixed size
does, for the control sequences a line-oriented program (rich's live display among them) writes: printable text
with wrapping, carriage return, line feed, backspace, tab, cursor movement, erasing, colours (ignored), cursor
visibility (ignored). Any other sequence fails the test, so a screen is never silently wrong.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Callable, Sequence

# CSI (ESC [ parameters final), OSC (ESC ] ... BEL or ESC \), and two-character escapes.
_CSI = re.compile(r"\x1b\[([0-9;?]*)([@-~])")
_OSC = re.compile(r"\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")
_ESC_PAIR = re.compile(r"\x1b[()][0-9A-Za-z]|\x1b[=>78]")
TAB_STOP = 8
READ_CHUNK = 65536


class Screen:
    """A terminal's screen of ``rows`` x ``columns`` cells, fed what a program wrote; scrolls like a terminal.

    Lines scrolled off the top are kept in :attr:`scrolled`, so :meth:`lines` reads like a terminal's scrollback
    followed by its screen.
    """

    def __init__(self, rows: int, columns: int) -> None:
        self.rows, self.columns = rows, columns
        self.cells = [[" "] * columns for _ in range(rows)]
        self.scrolled: list[str] = []
        self.row = self.column = 0
        self._pending = ""

    def feed(self, text: str) -> None:
        """Apply ``text`` (decoded output; a sequence cut at the end waits for the next call)."""
        text = self._pending + text
        self._pending = ""
        index = 0
        while index < len(text):
            char = text[index]
            if char == "\x1b":
                match = _CSI.match(text, index) or _OSC.match(text, index) or _ESC_PAIR.match(text, index)
                if match is None:
                    if len(text) - index < 64:  # cut off mid-sequence: wait for the rest
                        self._pending = text[index:]
                        return
                    raise AssertionError(f"unknown escape sequence {text[index : index + 12]!r}")
                if match.re is _CSI:
                    self._csi(match.group(1), match.group(2))
                index = match.end()
                continue
            self._char(char)
            index += 1

    def _char(self, char: str) -> None:
        if char == "\r":
            self.column = 0
        elif char == "\n":
            self._line_feed()
        elif char == "\b":
            self.column = max(0, self.column - 1)
        elif char == "\t":
            self.column = min(self.columns - 1, (self.column // TAB_STOP + 1) * TAB_STOP)
        elif char == "\x07":
            pass
        elif char >= " ":
            if self.column >= self.columns:
                self.column = 0
                self._line_feed()
            self.cells[self.row][self.column] = char
            self.column += 1
        else:
            raise AssertionError(f"unknown control character {char!r}")

    def _line_feed(self) -> None:
        if self.row == self.rows - 1:
            self.scrolled.append("".join(self.cells.pop(0)).rstrip())
            self.cells.append([" "] * self.columns)
        else:
            self.row += 1

    def _csi(self, parameters: str, final: str) -> None:
        if parameters.startswith("?"):  # private modes: cursor visibility, bracketed paste...
            return
        numbers = [int(part) if part else 0 for part in parameters.split(";")] if parameters else []
        count = max(1, numbers[0]) if numbers else 1
        if final == "m":
            return
        if final == "A":
            self.row = max(0, self.row - count)
        elif final == "B":
            self.row = min(self.rows - 1, self.row + count)
        elif final == "C":
            self.column = min(self.columns - 1, self.column + count)
        elif final == "D":
            self.column = max(0, self.column - count)
        elif final == "G":
            self.column = min(self.columns - 1, count - 1)
        elif final == "H":
            self.row = min(self.rows - 1, (numbers[0] if numbers else 1) - 1)
            self.column = min(self.columns - 1, (numbers[1] if len(numbers) > 1 else 1) - 1)
        elif final == "K":
            mode = numbers[0] if numbers else 0
            line = self.cells[self.row]
            start, end = {0: (self.column, self.columns), 1: (0, self.column + 1), 2: (0, self.columns)}[mode]
            line[start:end] = [" "] * (end - start)
        elif final == "J":
            mode = numbers[0] if numbers else 0
            if mode == 0:
                self.cells[self.row][self.column :] = [" "] * (self.columns - self.column)
                for row in range(self.row + 1, self.rows):
                    self.cells[row] = [" "] * self.columns
            else:
                raise AssertionError(f"unexpected erase-display mode {mode}")
        else:
            raise AssertionError(f"unknown control sequence CSI {parameters}{final}")

    def lines(self) -> list[str]:
        """Scrollback then screen, each line without trailing blanks, trailing empty lines dropped."""
        lines = self.scrolled + ["".join(row).rstrip() for row in self.cells]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    def text(self) -> str:
        """:meth:`lines`, joined."""
        return "\n".join(self.lines())


class PtyRun:
    """A command whose stdin, stdout and stderr are one pseudo-terminal of ``rows`` x ``columns``.

    A thread reads all it writes into :attr:`output` and a :class:`Screen`; :meth:`screen_when` waits for a
    screen a test expects.
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: dict[str, str],
        *,
        rows: int = 50,
        columns: int = 120,
        cwd: str | None = None,
    ) -> None:
        self.screen = Screen(rows, columns)
        self.output = bytearray()
        self._lock = threading.Lock()
        primary, secondary = pty.openpty()
        fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.process = subprocess.Popen(
            list(argv),
            stdin=secondary,
            stdout=secondary,
            stderr=secondary,
            env={**env, "TERM": "xterm-256color", "COLUMNS": str(columns), "LINES": str(rows)},
            cwd=cwd,
            start_new_session=True,
        )
        os.close(secondary)
        self._primary = primary
        self._reader = threading.Thread(target=self._read, name="pty-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        import codecs

        decoder = codecs.getincrementaldecoder("utf-8")()
        while True:
            ready, _, _ = select.select([self._primary], [], [], 0.2)
            if not ready:
                if self.process.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(self._primary, READ_CHUNK)
            except OSError:  # the last writer closed the terminal
                break
            if not chunk:
                break
            with self._lock:
                self.output += chunk
                self.screen.feed(decoder.decode(chunk))

    def screen_when(self, check: Callable[[str], bool], timeout_s: float) -> str:
        """The screen's text once ``check`` holds for it (fails the test after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                text = self.screen.text()
            if check(text):
                return text
            if time.monotonic() > deadline or (
                self.process.poll() is not None and not self._reader.is_alive()
            ):
                raise AssertionError(f"the screen never showed what was expected:\n{text}")
            time.sleep(0.1)

    def wait(self, timeout_s: float) -> tuple[int, str]:
        """The exit code and the final screen (scrollback included)."""
        try:
            code = self.process.wait(timeout_s)
        finally:
            if self.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._reader.join(10)
        os.close(self._primary)
        with self._lock:
            return code, self.screen.text()
