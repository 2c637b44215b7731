"""Local backend of the write-once store: a temporary file, fsynced, then hard-linked to its final name.

``link`` fails atomically when the name exists, so a reader never sees a partial file and a second writer
never replaces the first one's object.
"""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from datagen.errors import (
    OutputExistsError,
)
from datagen.output.objects import Level

TEMP_PREFIX = ".tmp-"


class LocalBackend:
    """A local directory; exclusive create through temp file + hard link."""

    def __init__(self, root: str) -> None:
        self.root = Path(root.removeprefix("file://")).expanduser().resolve()

    def _path(self, key: str) -> Path:
        return self.root / key

    def url(self, key: str) -> str:
        """The absolute path of ``key``."""
        return str(self._path(key))

    def create(self, key: str, data: bytes) -> None:
        """Create ``key`` atomically and exclusively (:meth:`create_stream` with one chunk)."""
        self.create_stream(key, [data])

    def create_stream(self, key: str, chunks: Iterable[bytes]) -> int:
        """Create ``key`` atomically and exclusively from a stream of chunks; returns its size.

        The chunks go to the temporary file as they come (bounded memory), then the file is linked as
        :meth:`create` does, so an interrupted stream leaves no object behind.
        """
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = target.parent / f"{TEMP_PREFIX}{target.name}.{uuid.uuid4().hex}"
        size = 0
        try:
            with open(temp, "xb") as handle:
                for chunk in chunks:
                    handle.write(chunk)
                    size += len(chunk)
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(temp, target)
            except FileExistsError:
                raise OutputExistsError(str(target)) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()
        # Make the new directory entry durable too, so a crash cannot forget a completed write.
        directory = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        return size

    def read(self, key: str) -> bytes:
        """The bytes of ``key``."""
        return self._path(key).read_bytes()

    def open_read(self, key: str) -> IO[bytes]:
        """A binary file handle on ``key``."""
        return open(self._path(key), "rb")

    def exists(self, key: str) -> bool:
        """Tell whether ``key`` exists."""
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix``, skipping in-progress temporary files."""
        return list(self.list_sizes(prefix))

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """Keys under ``prefix`` (sorted) with their sizes, skipping in-progress temporary files."""
        base = self._path(prefix)
        if not base.is_dir():
            return {}
        sizes: dict[str, int] = {}
        for path in base.rglob("*"):
            if path.name.startswith(TEMP_PREFIX):
                continue
            with contextlib.suppress(FileNotFoundError):  # a temporary file linked and removed meanwhile
                status = path.stat()
                if stat.S_ISREG(status.st_mode):
                    sizes[str(path.relative_to(self.root))] = status.st_size
        return dict(sorted(sizes.items()))

    def list_level(self, prefix: str) -> Level:
        """The files directly in folder ``prefix`` (sizes) and its subfolders; temporary files skipped."""
        base = self._path(prefix)
        objects: dict[str, int] = {}
        folders: list[str] = []
        if not base.is_dir():
            return Level(objects, folders)
        for path in base.iterdir():
            if path.name.startswith(TEMP_PREFIX):
                continue
            with contextlib.suppress(FileNotFoundError):
                status = path.lstat()
                key = str(path.relative_to(self.root))
                if stat.S_ISREG(status.st_mode):
                    objects[key] = status.st_size
                elif stat.S_ISDIR(status.st_mode):
                    folders.append(key)
        return Level(dict(sorted(objects.items())), sorted(folders))
