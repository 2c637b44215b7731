"""Stream the elements of a JSON file whose top level is one array, without loading the file whole.

MetaMathQA (395k rows) and the Hermes function-calling configs ship as one JSON array per file. The
reader decodes the bytes incrementally and pulls one element at a time out of a sliding text buffer with
:meth:`json.JSONDecoder.raw_decode`, so memory stays bounded by the chunk size plus the largest element.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from typing import IO, Any

from datagen.errors import DatasetError

CHUNK_CHARS = 1 << 20  # 1 Mi characters per read: few Python-level iterations, bounded memory
# One element larger than this means the file is broken (an unterminated string would otherwise make
# the reader buffer the rest of the file while it waits for the element to end).
MAX_ELEMENT_CHARS = 256 << 20

_WHITESPACE = " \t\r\n"


class _Buffer:
    """A text window over a byte stream with a read position."""

    def __init__(self, handle: IO[bytes], source: str) -> None:
        self._handle = handle
        self._decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="strict")
        self.source = source
        self.text = ""
        self.pos = 0
        self.eof = False
        self.consumed_chars = 0  # characters dropped from the front, for error offsets

    def fill(self) -> bool:
        """Append one chunk; return False at end of file."""
        if self.eof:
            return False
        raw = self._handle.read(CHUNK_CHARS)
        try:
            chunk = self._decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as error:
            raise DatasetError(f"{self.source} is not UTF-8 text ({error}); re-encode it as UTF-8.") from None
        if not raw:
            self.eof = True
        # Drop what was consumed before growing, so the buffer holds at most one chunk + one element.
        self.consumed_chars += self.pos
        self.text = self.text[self.pos :] + chunk
        self.pos = 0
        return bool(raw)

    def skip_whitespace(self) -> str:
        """Advance past whitespace and return the next character ('' at end of file)."""
        while True:
            while self.pos < len(self.text) and self.text[self.pos] in _WHITESPACE:
                self.pos += 1
            if self.pos < len(self.text):
                return self.text[self.pos]
            if not self.fill():
                return ""

    def offset(self) -> int:
        """The character offset of the read position in the file."""
        return self.consumed_chars + self.pos


def _decode_value(buffer: _Buffer, decoder: json.JSONDecoder) -> Any:
    """Decode the JSON value starting at the read position, reading more text until it is complete."""
    while True:
        try:
            value, end = decoder.raw_decode(buffer.text, buffer.pos)
        except json.JSONDecodeError as error:
            if buffer.eof:
                raise DatasetError(
                    f"{buffer.source} is not valid JSON near character {buffer.offset()}: {error.msg}. "
                    "Repair or re-export the file."
                ) from None
            if len(buffer.text) - buffer.pos > MAX_ELEMENT_CHARS:
                raise DatasetError(
                    f"{buffer.source}: an element starting at character {buffer.offset()} does not end "
                    f"within {MAX_ELEMENT_CHARS} characters; the file is truncated or not valid JSON."
                ) from None
            buffer.fill()
            continue
        # A value that ends exactly at the end of the buffer may continue (a number split by a chunk).
        if end == len(buffer.text) and not buffer.eof:
            buffer.fill()
            continue
        buffer.pos = end
        return value


def iter_json_array(handle: IO[bytes], source: str) -> Iterator[Any]:
    """Yield the elements of the top-level JSON array in ``handle`` one at a time.

    Args:
        handle: A binary file handle positioned at the start of the file.
        source: The file's name, quoted in errors.

    Yields:
        Each element, parsed.

    Raises:
        DatasetError: The top level is not an array, or the file is not valid JSON.

    """
    buffer = _Buffer(handle, source)
    decoder = json.JSONDecoder()
    first = buffer.skip_whitespace()
    if first == "":
        return
    if first != "[":
        kind = "an object" if first == "{" else "not an array"
        raise DatasetError(
            f"{source}: the top level of this JSON file is {kind}; datagen reads a .json file as one array "
            "of rows. If it holds one JSON object per line, rename it to .jsonl."
        )
    buffer.pos += 1
    if buffer.skip_whitespace() == "]":
        buffer.pos += 1
        _expect_end(buffer)
        return
    while True:
        if buffer.skip_whitespace() == "":
            raise DatasetError(f"{source} ends inside the top-level array; the file is truncated.")
        yield _decode_value(buffer, decoder)
        separator = buffer.skip_whitespace()
        if separator == ",":
            buffer.pos += 1
            continue
        if separator == "]":
            buffer.pos += 1
            _expect_end(buffer)
            return
        if separator == "":
            raise DatasetError(f"{source} ends inside the top-level array; the file is truncated.")
        raise DatasetError(
            f"{source} is not valid JSON near character {buffer.offset()}: expected ',' or ']' "
            f"between array elements, found {separator!r}."
        )


def _expect_end(buffer: _Buffer) -> None:
    trailing = buffer.skip_whitespace()
    if trailing:
        raise DatasetError(
            f"{buffer.source}: unexpected data after the top-level array at character {buffer.offset()}."
        )
