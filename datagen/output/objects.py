"""What every store backend shares: the record of a written object, the backend protocol, sizes in words."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO, Protocol

_SIZE_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB")


def size_text(size: int) -> str:
    """A byte count as people read it in a log line: ``812 bytes``, ``41 KiB``, ``16 MiB``, ``1.5 GiB``."""
    value = float(size)
    unit = 0
    while value >= 1024 and unit < len(_SIZE_UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{size} bytes"
    return f"{value:.1f} {_SIZE_UNITS[unit]}" if value < 10 else f"{value:.0f} {_SIZE_UNITS[unit]}"


@dataclass(frozen=True)
class Level:
    """One level of a listing: the objects directly in a folder (with sizes) and its subfolders.

    Keys are relative to the store root; a folder is named without its trailing slash.
    """

    objects: dict[str, int]
    folders: list[str]


@dataclass(frozen=True)
class ObjectInfo:
    """What was written: the key, its full URL and its size."""

    key: str
    url: str
    size_bytes: int


class Backend(Protocol):
    """The few primitives a store needs from a backend."""

    def create(self, key: str, data: bytes) -> None:
        """Create ``key`` with ``data``; raise OutputExistsError when it exists."""
        ...

    def create_stream(self, key: str, chunks: Iterable[bytes]) -> int:
        """Create ``key`` from a stream of chunks (bounded memory), atomically; returns its size."""
        ...

    def read(self, key: str) -> bytes:
        """Return the bytes of ``key``; raise FileNotFoundError when absent."""
        ...

    def open_read(self, key: str) -> IO[bytes]:
        """Open ``key`` for streaming reads."""
        ...

    def exists(self, key: str) -> bool:
        """Tell whether ``key`` exists."""
        ...

    def list(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (recursively), sorted."""
        ...

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """Every key under ``prefix`` (recursively, sorted) with its size in bytes, from the listing alone."""
        ...

    def list_level(self, prefix: str) -> Level:
        """The objects directly in folder ``prefix`` and its subfolders, one level only, each sorted."""
        ...

    def url(self, key: str) -> str:
        """The full URL of ``key``."""
        ...
