"""Write-once object storage over a local directory or an S3 (or S3-compatible) prefix.

Every write is an exclusive create enforced by the backend itself, never check-then-put:

* local: the bytes go to a hidden temporary file in the target folder, are fsynced, then hard-linked to
  the final name; ``link`` fails atomically when the name exists, so a reader never sees a partial file
  and a second writer never replaces the first one's object;
* S3: ``PutObject`` with ``If-None-Match: *``; S3 answers 412 when the key exists (raised as
  :class:`~datagen.errors.OutputExistsError`) and 409 when a concurrent create of the same key is in
  progress (raised as :class:`~datagen.errors.TransientStorageError`). A single ``PutObject`` is atomic:
  a failed upload leaves no object behind. botocore's standard retries absorb 5xx answers and
  connection resets (each retry is logged); when a put landed but its response was lost, the retry
  meets 412, and the store then compares the stored object with its bytes: the same bytes are our own
  write (success, an idempotent create), other bytes are someone else's (``OutputExistsError``).
  A download cut short mid-body resumes with a ranged GET from the last byte received.

Credentials: the standard AWS chain, or explicit :class:`S3Credentials` given to the store (the flows read
them from a Prefect AwsCredentials block); the store keeps them so that inputs read on its behalf
(:attr:`Store.credentials`) reach S3 as the same principal. Secrets never reach reprs, logs or error
messages.

Protected prefixes (the existing training data) are refused before any byte is sent.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import orjson
from pydantic import BaseModel

from datagen.errors import (
    ProtectedPrefixError,
    StorageError,
)
from datagen.output.local import LocalBackend
from datagen.output.objects import Backend, Level, ObjectInfo
from datagen.output.s3 import S3Backend
from datagen.output.s3_client import S3Credentials

logger = logging.getLogger(__name__)


def normalise_url(url: str) -> str:
    """A canonical form of a location for prefix comparisons (absolute local paths, no trailing slash)."""
    if "://" in url and not url.startswith("file://"):
        return url.rstrip("/")
    path = url.removeprefix("file://")
    return str(Path(path).expanduser().resolve()).rstrip("/")


def overlaps(first: str, second: str) -> bool:
    """Tell whether two locations overlap (one is, or lies under, the other)."""
    a, b = normalise_url(first), normalise_url(second)
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


class Store:
    """Write-once storage rooted at one URL, refusing writes under protected prefixes.

    Args:
        root: A local directory or ``s3://bucket/prefix``.
        protected_prefixes: Locations that must never be written.
        backend: A ready backend (tests); chosen from ``root`` when omitted.
        credentials: S3 credentials for an ``s3://`` root (None: the standard AWS chain); kept as
            :attr:`credentials` for reading the run's inputs as the same principal.
    """

    def __init__(
        self,
        root: str,
        protected_prefixes: Iterable[str] = (),
        backend: Backend | None = None,
        *,
        credentials: S3Credentials | None = None,
    ) -> None:
        self.root = root
        self.protected_prefixes = list(protected_prefixes)
        self.credentials = credentials
        if backend is not None:
            self.backend: Backend = backend
        elif root.startswith("s3://"):
            self.backend = S3Backend(root, credentials=credentials)
        else:
            self.backend = LocalBackend(root)

    def url(self, key: str) -> str:
        """The full URL of ``key``."""
        return self.backend.url(key)

    def _check_key(self, key: str) -> None:
        """Refuse keys that could land outside the root, then keys under a protected prefix."""
        parts = key.split("/")
        if not key or key.startswith("/") or any(part in {"", ".", ".."} for part in parts):
            raise StorageError(f"invalid object key {key!r}: use a relative path without '.', '..' or '//'")
        url = self.url(key)
        for prefix in self.protected_prefixes:
            if overlaps(url, prefix):
                raise ProtectedPrefixError(url, prefix)

    def write_bytes(self, key: str, data: bytes) -> ObjectInfo:
        """Create ``key`` with ``data``, exactly once.

        Raises:
            OutputExistsError: The object exists already.
            ProtectedPrefixError: ``key`` lies under a protected prefix.
            TransientStorageError: A retry may succeed.
        """
        self._check_key(key)
        self.backend.create(key, data)
        logger.debug("wrote key=%s bytes=%d", key, len(data))
        return ObjectInfo(key=key, url=self.url(key), size_bytes=len(data))

    def write_stream(self, key: str, chunks: Iterable[bytes]) -> ObjectInfo:
        """Create ``key`` from a stream of chunks, exactly once, holding only a bounded buffer in memory.

        The object appears whole or not at all (local: temp file + link; S3: one conditional put, or a
        multipart upload completed with ``If-None-Match: *``).

        Raises:
            OutputExistsError: The object exists already.
            ProtectedPrefixError: ``key`` lies under a protected prefix.
            TransientStorageError: A retry may succeed.
        """
        self._check_key(key)
        size = self.backend.create_stream(key, chunks)
        logger.debug("wrote key=%s bytes=%d (streamed)", key, size)
        return ObjectInfo(key=key, url=self.url(key), size_bytes=size)

    def write_text(self, key: str, text: str) -> ObjectInfo:
        """Create ``key`` with UTF-8 text."""
        return self.write_bytes(key, text.encode())

    def write_json(self, key: str, value: Any) -> ObjectInfo:
        """Create ``key`` with a JSON document (pydantic models are dumped in JSON mode)."""
        if isinstance(value, BaseModel):
            value = value.model_dump(mode="json")
        return self.write_text(key, json.dumps(value, indent=2, sort_keys=True) + "\n")

    def write_jsonl(self, key: str, records: Iterable[BaseModel | dict[str, Any]]) -> ObjectInfo:
        """Create ``key`` with one JSON line per record."""
        lines = []
        for record in records:
            if isinstance(record, BaseModel):
                lines.append(record.model_dump_json())
            else:
                lines.append(json.dumps(record, sort_keys=True))
        return self.write_text(key, "".join(line + "\n" for line in lines))

    def read_bytes(self, key: str) -> bytes:
        """The bytes of ``key``; FileNotFoundError when absent."""
        return self.backend.read(key)

    def read_text(self, key: str) -> str:
        """The text of ``key``."""
        return self.read_bytes(key).decode()

    def read_json(self, key: str) -> Any:
        """The parsed JSON of ``key``."""
        return _loads(self.read_bytes(key))

    def iter_jsonl(self, key: str) -> Iterator[dict[str, Any]]:
        """Stream the JSON lines of ``key`` one at a time (bounded memory)."""
        for line in self.iter_lines(key):
            yield _loads(line)

    def iter_lines(self, key: str) -> Iterator[bytes]:
        """Stream the non-empty lines of ``key`` (JSONL), stripped.

        For callers that parse the lines themselves, e.g. straight into a model with ``model_validate_json``.
        """
        with self.backend.open_read(key) as handle:
            for raw in handle:
                line = raw.strip()
                if line:
                    yield line

    def open_read(self, key: str) -> IO[bytes]:
        """Open ``key`` for streaming reads."""
        return self.backend.open_read(key)

    def exists(self, key: str) -> bool:
        """Tell whether ``key`` exists."""
        return self.backend.exists(key)

    def list(self, prefix: str) -> list[str]:
        """Every key under ``prefix``, sorted."""
        return self.backend.list(prefix)

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """Every key under ``prefix`` (sorted) with its size in bytes, read from the listing (no object is read)."""
        return self.backend.list_sizes(prefix)

    def list_level(self, prefix: str) -> Level:
        """The objects directly in folder ``prefix`` (with sizes) and its subfolders: one level, never deeper.

        What a reader of the layout lists, so that nothing stored below the folders it expects (another run's
        layout under a run's folder, say) is ever seen.
        """
        return self.backend.list_level(prefix)


def _loads(data: bytes) -> Any:
    # orjson parses several times faster than json (this reads every prompt and completion of a run); the
    # standard parser remains for what orjson refuses and json accepts (NaN, Infinity).
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)
