"""Write-once object storage over a local directory or an S3 (or S3-compatible) prefix.

Every write is an exclusive create enforced by the backend itself, never check-then-put:

* local: the bytes go to a hidden temporary file in the target folder, are fsynced, then hard-linked to
  the final name; ``link`` fails atomically when the name exists, so a reader never sees a partial file
  and a second writer never replaces the first one's object;
* S3: ``PutObject`` with ``If-None-Match: *``; S3 answers 412 when the key exists (raised as
  :class:`~datagen.errors.OutputExistsError`) and 409 when a concurrent create of the same key is in
  progress (raised as :class:`~datagen.errors.TransientStorageError`). A single ``PutObject`` is atomic:
  a failed upload leaves no object behind.

Protected prefixes (the existing training data) are refused before any byte is sent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from pydantic import BaseModel

from datagen.errors import (
    OutputExistsError,
    ProtectedPrefixError,
    StorageError,
    TransientStorageError,
)

logger = logging.getLogger(__name__)

TEMP_PREFIX = ".tmp-"
# boto3's own retry loop absorbs throttling, 5xx and connection resets before we ever see them.
S3_MAX_ATTEMPTS = 10


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

    def url(self, key: str) -> str:
        """The full URL of ``key``."""
        ...


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
        """Create ``key`` atomically and exclusively."""
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = target.parent / f"{TEMP_PREFIX}{target.name}.{uuid.uuid4().hex}"
        try:
            with open(temp, "xb") as handle:
                handle.write(data)
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
        base = self._path(prefix)
        if not base.is_dir():
            return []
        keys = [
            str(path.relative_to(self.root))
            for path in base.rglob("*")
            if path.is_file() and not path.name.startswith(TEMP_PREFIX)
        ]
        return sorted(keys)


class S3Backend:
    """An S3 prefix; exclusive create through conditional ``PutObject``."""

    def __init__(
        self,
        root: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        client: Any | None = None,
    ) -> None:
        without_scheme = root.removeprefix("s3://")
        bucket, _, prefix = without_scheme.partition("/")
        if not bucket:
            raise StorageError(f"S3 URL {root!r} names no bucket; use s3://bucket/prefix")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.client = client if client is not None else make_s3_client(endpoint_url=endpoint_url, region=region)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def url(self, key: str) -> str:
        """The ``s3://`` URL of ``key``."""
        return f"s3://{self.bucket}/{self._key(key)}"

    def create(self, key: str, data: bytes) -> None:
        """Create ``key`` with a conditional put; 412 means it exists, 409 a concurrent create."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
        except ClientError as error:
            code = str(error.response.get("Error", {}).get("Code", ""))
            status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if status == 412 or code == "PreconditionFailed":
                raise OutputExistsError(self.url(key)) from None
            if status == 409 or code == "ConditionalRequestConflict" or status >= 500:
                raise TransientStorageError(f"S3 write of {self.url(key)} failed ({code}); retry", url=key) from error
            raise StorageError(f"S3 write of {self.url(key)} failed: {code} {error}", url=key) from error
        except BotoCoreError as error:
            raise TransientStorageError(f"S3 write of {self.url(key)} failed: {error}; retry") from error

    def read(self, key: str) -> bytes:
        """The bytes of ``key``."""
        with self.open_read(key) as body:
            return body.read()

    def open_read(self, key: str) -> IO[bytes]:
        """A streaming body of ``key``."""
        from botocore.exceptions import ClientError

        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as error:
            code = str(error.response.get("Error", {}).get("Code", ""))
            if code in {"NoSuchKey", "404"}:
                raise FileNotFoundError(self.url(key)) from None
            raise
        body: IO[bytes] = response["Body"]
        return body

    def exists(self, key: str) -> bool:
        """Tell whether ``key`` exists (a HEAD request)."""
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as error:
            if str(error.response.get("Error", {}).get("Code", "")) in {"404", "NoSuchKey", "NotFound"}:
                return False
            raise
        return True

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` relative to the store root, sorted."""
        full = self._key(prefix).rstrip("/") + "/"
        keys: list[str] = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
            for item in page.get("Contents", []):
                key = str(item["Key"])
                keys.append(key[len(self.prefix) + 1 :] if self.prefix else key)
        return sorted(keys)


def make_s3_client(endpoint_url: str | None = None, region: str | None = None) -> Any:
    """A boto3 S3 client using the standard credential chain and an adaptive retry policy.

    Args:
        endpoint_url: An S3-compatible endpoint; ``DATAGEN_S3_ENDPOINT_URL`` or AWS when unset.
        region: The region; ``DATAGEN_S3_REGION`` or the chain's default when unset.
    """
    import boto3
    from botocore.config import Config

    from datagen.settings import get_settings

    settings = get_settings()
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url or settings.s3_endpoint_url,
        region_name=region or settings.s3_region,
        config=Config(retries={"mode": "standard", "max_attempts": S3_MAX_ATTEMPTS}),
    )


class Store:
    """Write-once storage rooted at one URL, refusing writes under protected prefixes.

    Args:
        root: A local directory or ``s3://bucket/prefix``.
        protected_prefixes: Locations that must never be written.
        backend: A ready backend (tests); chosen from ``root`` when omitted.
    """

    def __init__(self, root: str, protected_prefixes: Iterable[str] = (), backend: Backend | None = None) -> None:
        self.root = root
        self.protected_prefixes = list(protected_prefixes)
        if backend is not None:
            self.backend: Backend = backend
        elif root.startswith("s3://"):
            self.backend = S3Backend(root)
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
        return json.loads(self.read_bytes(key))

    def iter_jsonl(self, key: str) -> Iterator[dict[str, Any]]:
        """Stream the JSON lines of ``key`` one at a time (bounded memory)."""
        with self.backend.open_read(key) as handle:
            for raw in handle:
                line = raw.strip()
                if line:
                    yield json.loads(line)

    def open_read(self, key: str) -> IO[bytes]:
        """Open ``key`` for streaming reads."""
        return self.backend.open_read(key)

    def exists(self, key: str) -> bool:
        """Tell whether ``key`` exists."""
        return self.backend.exists(key)

    def list(self, prefix: str) -> list[str]:
        """Every key under ``prefix``, sorted."""
        return self.backend.list(prefix)
