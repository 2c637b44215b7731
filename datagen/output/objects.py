"""What every store backend shares: the record of a written object and the backend protocol."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO, Protocol


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

    def url(self, key: str) -> str:
        """The full URL of ``key``."""
        ...
