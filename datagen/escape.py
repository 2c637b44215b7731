r"""Text a caller chose, made safe for where it is shown: one log line, a markdown artifact.

A run's caller picks strings that end up in the run's log and in its markdown artifacts (an ``output`` URL, a
flow run's name, the paths built from them, an engine's error text). A control character in one forges a
second log line (a newline, then a prefix of the caller's choosing) or rewrites a terminal (an escape
sequence); markdown in one closes a code span and renders a heading, an image or a link to another host. So
everything shown passes through here: control characters become their visible escapes (``\n``, ``\x1b``),
and markdown shows the text as text.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from typing import Final

# C0 and C1 controls, DEL, the line and paragraph separators, and the bidirectional overrides and isolates
# (which reorder what a reader sees).
_CONTROL: Final = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
# Characters markdown gives a meaning to wherever they stand (emphasis, code, links, images, HTML, entities,
# table cells), and what starts a block when it opens the text (a heading, a list item, a quote).
_MARKDOWN_INLINE: Final = re.compile(r"([\\`*_\[\]<>!|&~])")
_MARKDOWN_BLOCK_START: Final = re.compile(r"^([#+\-=>]|\d+(?=[.)]))")
# A URL shown as a link only when it has none of the characters that could end or extend the link.
_PLAIN_URL: Final = re.compile(r"https?://[A-Za-z0-9._~:/?#@!$&'*+,;=%-]+")
_BACKTICKS: Final = re.compile(r"`+")


def printable(text: str) -> str:
    r"""``text`` on one line: every control character replaced by its visible escape (``\n``, ``\x1b``)."""
    return _CONTROL.sub(lambda found: found.group().encode("unicode_escape").decode("ascii"), text)


def markdown_text(text: str) -> str:
    """``text`` as plain markdown text: printable, every character markdown would read escaped."""
    escaped = _MARKDOWN_INLINE.sub(r"\\\1", printable(text))
    return _MARKDOWN_BLOCK_START.sub(lambda found: _escape_block_start(found.group()), escaped)


def _escape_block_start(start: str) -> str:
    # A marker character is escaped itself; an ordered list's number keeps its digits and loses the list.
    return f"\\{start}" if not start.isdigit() else f"{start}\\"


def markdown_code(text: str) -> str:
    """``text`` as an inline code span that nothing in it can close (its fence outgrows any backtick run)."""
    shown = printable(text)
    fence = "`" * (max((len(run) for run in _BACKTICKS.findall(shown)), default=0) + 1)
    pad = " " if shown.startswith("`") or shown.endswith("`") else ""
    return f"{fence}{pad}{shown}{pad}{fence}"


def markdown_location(value: str) -> str:
    """A location: a link when it is a plain http(s) URL a browser opens, else code (a path, an ``s3://`` URL)."""
    if _PLAIN_URL.fullmatch(value):
        text = _MARKDOWN_INLINE.sub(r"\\\1", value)
        return f"[{text}]({value})"
    return markdown_code(value)


def markdown_block(lines: Iterable[str], info: str = "") -> list[str]:
    """Fenced code block lines around ``lines`` (each made printable); no line inside can close the fence."""
    shown = [printable(line) for line in lines]
    longest = max((len(run) for line in shown for run in _BACKTICKS.findall(line)), default=0)
    fence = "`" * max(3, longest + 1)
    return [f"{fence}{info}", *shown, fence]


def _printable_argument(value: object) -> object:
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, BaseException | os.PathLike):
        return printable(str(value))
    return value


class PrintableArguments(logging.Filter):
    """Makes a record's arguments printable in place, so a value a caller chose stays on its log line.

    The message's format string is the program's own; the values filled into it (or a message given without
    arguments, such as the worker's line naming a flow run) are what a caller may have chosen. The worker's
    logging configuration (``deployments/logging.yml``) puts it on every handler.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite ``record.args`` (and a message given without arguments); never drop a record."""
        if isinstance(record.args, Mapping):
            record.args = {key: _printable_argument(value) for key, value in record.args.items()}
        elif isinstance(record.args, tuple) and record.args:
            record.args = tuple(_printable_argument(value) for value in record.args)
        elif isinstance(record.msg, str):
            record.msg = printable(record.msg)
        return True


__all__ = [
    "PrintableArguments",
    "markdown_block",
    "markdown_code",
    "markdown_location",
    "markdown_text",
    "printable",
]
