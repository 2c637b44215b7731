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

Credentials: the standard AWS chain, or explicit :class:`S3Credentials` (per client, or a process
default set by the orchestration layer, e.g. from a Prefect AwsCredentials block). Secrets never reach
reprs, logs or error messages.

Protected prefixes (the existing training data) are refused before any byte is sent.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from datagen.errors import (
    OutputExistsError,
    ProtectedPrefixError,
    StorageError,
    TransientStorageError,
)

logger = logging.getLogger(__name__)

TEMP_PREFIX = ".tmp-"
# Attempts per S3 request in botocore's standard retry mode (exponential backoff with jitter, at most
# 20 s apart): it absorbs throttling, 5xx answers and connection resets before we ever see them.
S3_MAX_ATTEMPTS = 10
# Times a GET's body may be cut short mid-stream before the read gives up (each time the rest is asked
# for again with a ranged GET; botocore's own retries end once the response headers arrived).
S3_BODY_READ_ATTEMPTS = 3
# Read buffer of S3 object streams (JSON-lines iteration reads through it).
S3_READ_BUFFER_BYTES = 1024 * 1024
HTTP_NOT_FOUND = 404
HTTP_CONFLICT = 409
HTTP_PRECONDITION_FAILED = 412
HTTP_TOO_MANY_REQUESTS = 429
HTTP_SERVER_ERROR = 500
THROTTLE_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestLimitExceeded"}
)
# Key in botocore's per-request context where the failure of the previous attempt is kept for the log.
RETRY_CAUSE_CONTEXT_KEY = "datagen_retry_cause"


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


class S3Credentials(BaseModel):
    """Explicit S3 credentials, for when the standard AWS chain is not what should be used.

    Either a key pair (with an optional session token) or a named profile. The secrets are ``SecretStr``:
    they never appear in a repr, a log line or an error message.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    access_key_id: str | None = Field(default=None, description="AWS access key id.")
    secret_access_key: SecretStr | None = Field(default=None, description="AWS secret access key.")
    session_token: SecretStr | None = Field(default=None, description="Token of temporary credentials.")
    profile_name: str | None = Field(default=None, description="A profile of ~/.aws/config to use instead.")
    region: str | None = Field(default=None, description="Region these credentials belong to, if any.")
    endpoint_url: str | None = Field(default=None, description="S3-compatible endpoint they are for.")

    @model_validator(mode="after")
    def _key_pair_complete(self) -> S3Credentials:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("give both access_key_id and secret_access_key, or neither")
        return self


_default_credentials: S3Credentials | None = None


def set_default_s3_credentials(credentials: S3Credentials | None) -> None:
    """Make every S3 client this process creates without explicit credentials use ``credentials``.

    The orchestration layer calls this once per process after resolving a credentials source that the
    core cannot read itself (a Prefect AwsCredentials block: see ``tasks/credentials.py``); None goes back
    to the standard AWS chain (environment, shared config/profile, instance or container role).
    """
    global _default_credentials
    _default_credentials = credentials


def default_s3_credentials() -> S3Credentials | None:
    """The credentials set by :func:`set_default_s3_credentials`, None for the standard AWS chain."""
    return _default_credentials


def _error_facts(error: Exception) -> tuple[str, int]:
    """The S3 error code and HTTP status of a botocore ClientError (empty and 0 when absent)."""
    response: dict[str, Any] = getattr(error, "response", {}) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def _is_transient_status(code: str, status: int) -> bool:
    return (
        status >= HTTP_SERVER_ERROR
        or status in {HTTP_CONFLICT, HTTP_TOO_MANY_REQUESTS}
        or code in THROTTLE_CODES
    )


def _storage_error(action: str, url: str, error: Exception) -> StorageError | TransientStorageError:
    """The datagen error for an S3 failure left after botocore's retries (codes and class names only).

    Transient (5xx, throttling, 409 conflict, connection trouble) gives a TransientStorageError, anything
    else a StorageError; neither quotes a request, so no credential can leak into the message.
    """
    code, status = _error_facts(error)
    if not code and not status:
        return TransientStorageError(
            f"S3 {action} of {url} failed after retries ({type(error).__name__}); retry later", url=url
        )
    if _is_transient_status(code, status) or code == "ConditionalRequestConflict":
        return TransientStorageError(
            f"S3 {action} of {url} failed ({code or status}) after retries; retry later", url=url
        )
    return StorageError(f"S3 {action} of {url} failed: {code or status} {error}", url=url)


class S3Backend:
    """An S3 prefix; exclusive create through conditional ``PutObject``.

    Reads and writes go through botocore's standard retry mode, which absorbs 5xx answers, throttling and
    connection resets; every retry is logged (``s3 retry operation=... attempt=...``). What is left after
    those retries surfaces as :class:`~datagen.errors.TransientStorageError`.
    """

    def __init__(
        self,
        root: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        client: Any | None = None,
        credentials: S3Credentials | None = None,
    ) -> None:
        without_scheme = root.removeprefix("s3://")
        bucket, _, prefix = without_scheme.partition("/")
        if not bucket:
            raise StorageError(f"S3 URL {root!r} names no bucket; use s3://bucket/prefix")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if client is None:
            client = make_s3_client(endpoint_url=endpoint_url, region=region, credentials=credentials)
        else:
            install_retry_logging(client)
        self.client = client

    def __repr__(self) -> str:
        return f"S3Backend(bucket={self.bucket!r}, prefix={self.prefix!r})"

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def url(self, key: str) -> str:
        """The ``s3://`` URL of ``key``."""
        return f"s3://{self.bucket}/{self._key(key)}"

    def create(self, key: str, data: bytes) -> None:
        """Create ``key`` with a conditional put; 412 means it exists, 409 a concurrent create.

        A 412 can also answer our own write: the put landed, its response was lost (a reset, a timeout),
        and botocore's retry of the same put found the object. So on 412 the object is compared with
        ``data``: the same bytes mean the create is done (idempotent create), other bytes raise
        :class:`~datagen.errors.OutputExistsError`.
        """
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
        except ClientError as error:
            code, status = _error_facts(error)
            if status == HTTP_PRECONDITION_FAILED or code == "PreconditionFailed":
                if self._holds(key, data):
                    logger.warning(
                        "s3 conditional put found the object already holding the same bytes: an earlier "
                        "attempt of this write landed; treating it as written key=%s bytes=%d retries=%s",
                        self._key(key),
                        len(data),
                        error.response.get("ResponseMetadata", {}).get("RetryAttempts"),
                    )
                    return
                raise OutputExistsError(self.url(key)) from None
            raise _storage_error("write", self.url(key), error) from error
        except BotoCoreError as error:
            raise _storage_error("write", self.url(key), error) from error

    def _holds(self, key: str, data: bytes) -> bool:
        """Tell whether the object ``key`` holds exactly ``data`` (size, then MD5 ETag, then the bytes)."""
        head = self._call("read", key, self.client.head_object, Bucket=self.bucket, Key=self._key(key))
        if int(head.get("ContentLength", -1)) != len(data):
            return False
        # A single-part upload without KMS encryption has its MD5 as ETag; anything else is compared byte
        # by byte (an ETag that is not our MD5 proves nothing on its own).
        if str(head.get("ETag", "")).strip('"') == hashlib.md5(data, usedforsecurity=False).hexdigest():
            return True
        return self.read(key) == data

    def _call(self, action: str, key: str, method: Any, **params: Any) -> Any:
        """Call a read-side S3 operation, mapping what is left after botocore's retries to our errors."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return method(**params)
        except ClientError as error:
            code, status = _error_facts(error)
            if code in {"NoSuchKey", "404", "NotFound"} or status == HTTP_NOT_FOUND:
                raise FileNotFoundError(self.url(key)) from None
            raise _storage_error(action, self.url(key), error) from error
        except BotoCoreError as error:
            raise _storage_error(action, self.url(key), error) from error

    def read(self, key: str) -> bytes:
        """The bytes of ``key`` (a body cut short is resumed where it stopped, see :meth:`open_read`)."""
        with self.open_read(key) as body:
            return body.read()

    def open_read(self, key: str) -> IO[bytes]:
        """A buffered stream of ``key``'s body.

        botocore retries a request only until its headers arrive. When the connection is lost while the
        body streams, the stream asks again for the rest (a ranged GET from the last byte received), up
        to ``S3_BODY_READ_ATTEMPTS`` times, then raises TransientStorageError.
        """
        full_key = self._key(key)
        response = self._call("read", key, self.client.get_object, Bucket=self.bucket, Key=full_key)

        def rest_from(offset: int) -> Any:
            ranged = self._call(
                "read",
                key,
                self.client.get_object,
                Bucket=self.bucket,
                Key=full_key,
                Range=f"bytes={offset}-",
            )
            return ranged["Body"]

        body = _ResumingBody(
            response["Body"], int(response.get("ContentLength", 0)), rest_from, self.url(key)
        )
        return io.BufferedReader(body, buffer_size=S3_READ_BUFFER_BYTES)

    def exists(self, key: str) -> bool:
        """Tell whether ``key`` exists (a HEAD request)."""
        try:
            self._call("head", key, self.client.head_object, Bucket=self.bucket, Key=self._key(key))
        except FileNotFoundError:
            return False
        return True

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` relative to the store root, sorted."""
        full = self._key(prefix).rstrip("/") + "/"
        paginator = self.client.get_paginator("list_objects_v2")

        def every_key() -> list[str]:
            # Pages are fetched lazily while iterating, so the whole iteration is the call to guard.
            pages = paginator.paginate(Bucket=self.bucket, Prefix=full)
            return [str(item["Key"]) for page in pages for item in page.get("Contents", [])]

        keys: list[str] = self._call("list", prefix, every_key)
        return sorted(key[len(self.prefix) + 1 :] if self.prefix else key for key in keys)


class _ResumingBody(io.RawIOBase):
    """An S3 response body that resumes with a ranged GET when the connection drops mid-stream."""

    def __init__(self, body: Any, size_bytes: int, rest_from: Callable[[int], Any], url: str) -> None:
        super().__init__()
        self._body = body
        self._size_bytes = size_bytes
        self._rest_from = rest_from
        self._url = url
        self._offset = 0
        self._failures = 0

    def readable(self) -> bool:
        """Always true: this is a read stream."""
        return True

    def readinto(self, buffer: Any) -> int:
        """Fill ``buffer`` from the body, resuming from the current offset after a lost connection."""
        from botocore.exceptions import BotoCoreError

        while True:
            try:
                data = self._body.read(len(buffer))
                break
            except (BotoCoreError, OSError) as error:
                self._failures += 1
                cause = type(error).__name__
                if self._failures >= S3_BODY_READ_ATTEMPTS:
                    raise TransientStorageError(
                        f"S3 read of {self._url} was cut short {self._failures} times ({cause}); retry later",
                        url=self._url,
                    ) from error
                logger.warning(
                    "s3 retry operation=GetObjectBody url=%s attempt=%d offset=%d cause=%s",
                    self._url,
                    self._failures + 1,
                    self._offset,
                    cause,
                )
                with contextlib.suppress(Exception):
                    self._body.close()
                if self._offset >= self._size_bytes:
                    return 0
                self._body = self._rest_from(self._offset)
        size = len(data)
        buffer[:size] = data
        self._offset += size
        return size

    def close(self) -> None:
        """Close the underlying HTTP body."""
        if not self.closed:
            with contextlib.suppress(Exception):
                self._body.close()
        super().close()


def _describe_failure(response: Any, caught_exception: BaseException | None) -> str | None:
    """What went wrong in one attempt, without anything secret (class name, status, S3 error code)."""
    if caught_exception is not None:
        return type(caught_exception).__name__
    if response is None:
        return None
    http_response, parsed = response
    status = int(getattr(http_response, "status_code", 0) or 0)
    code = str((parsed or {}).get("Error", {}).get("Code", ""))
    if _is_transient_status(code, status):
        return f"{status} {code}".strip()
    return None


def _record_failure(
    response: Any = None,
    caught_exception: BaseException | None = None,
    request_dict: dict[str, Any] | None = None,
    **_: Any,
) -> None:
    """``needs-retry`` hook: remember why an attempt failed, for the retry's log line."""
    cause = _describe_failure(response, caught_exception)
    if cause and request_dict is not None:
        request_dict.setdefault("context", {})[RETRY_CAUSE_CONTEXT_KEY] = cause


def _log_retry(request: Any = None, operation_name: str = "", **_: Any) -> None:
    """``request-created`` hook: log every attempt after the first, with the cause of the one before."""
    context = getattr(request, "context", None) or {}
    attempt = int(context.get("retries", {}).get("attempt", 1))
    if attempt > 1:
        logger.warning(
            "s3 retry operation=%s attempt=%d max_attempts=%d cause=%s",
            operation_name,
            attempt,
            S3_MAX_ATTEMPTS,
            context.get(RETRY_CAUSE_CONTEXT_KEY, "unknown"),
        )


def install_retry_logging(client: Any) -> None:
    """Log each botocore retry of ``client`` (idempotent: installing twice logs once)."""
    events = client.meta.events
    events.register("needs-retry.s3", _record_failure, unique_id="datagen-record-failure")
    events.register("request-created.s3", _log_retry, unique_id="datagen-log-retry")


@dataclass(frozen=True)
class _S3Target:
    """Where and as whom to reach S3, resolved once for boto3 and s3fs alike (holds secrets: never log)."""

    endpoint_url: str | None
    region: str | None
    profile_name: str | None
    key_pair: tuple[str, str] | None
    session_token: str | None


def _resolve_s3_target(
    endpoint_url: str | None, region: str | None, credentials: S3Credentials | None
) -> _S3Target:
    """Apply the precedence rules: explicit argument, then ``DATAGEN_S3_*``, then the credentials' own values."""
    from datagen.settings import get_settings

    settings = get_settings()
    chosen = credentials if credentials is not None else _default_credentials
    key_pair = None
    token = None
    if chosen is not None and chosen.access_key_id and chosen.secret_access_key:
        key_pair = (chosen.access_key_id, chosen.secret_access_key.get_secret_value())
        token = chosen.session_token.get_secret_value() if chosen.session_token else None
    return _S3Target(
        endpoint_url=endpoint_url or settings.s3_endpoint_url or (chosen.endpoint_url if chosen else None),
        region=region or settings.s3_region or (chosen.region if chosen else None),
        profile_name=chosen.profile_name if chosen else None,
        key_pair=key_pair,
        session_token=token,
    )


def make_s3_client(
    endpoint_url: str | None = None,
    region: str | None = None,
    credentials: S3Credentials | None = None,
) -> Any:
    """A boto3 S3 client with botocore's standard retry mode and logged retries.

    Credentials come from, in order: ``credentials``; the process default set by
    :func:`set_default_s3_credentials` (e.g. from a Prefect AwsCredentials block); the standard AWS chain
    (``AWS_*`` environment variables, ``AWS_PROFILE`` and the shared config files, an instance or
    container role).

    Args:
        endpoint_url: An S3-compatible endpoint; else ``DATAGEN_S3_ENDPOINT_URL``, else the credentials'
            endpoint, else AWS.
        region: The region; else ``DATAGEN_S3_REGION``, else the credentials' region, else the chain's.
        credentials: Explicit credentials for this client.
    """
    import boto3
    from botocore.config import Config

    target = _resolve_s3_target(endpoint_url, region, credentials)
    session_kwargs: dict[str, Any] = {}
    if target.profile_name:
        session_kwargs["profile_name"] = target.profile_name
    if target.key_pair:
        session_kwargs["aws_access_key_id"], session_kwargs["aws_secret_access_key"] = target.key_pair
        if target.session_token:
            session_kwargs["aws_session_token"] = target.session_token
    session = boto3.session.Session(**session_kwargs)
    client = session.client(
        "s3",
        endpoint_url=target.endpoint_url,
        region_name=target.region,
        config=Config(retries={"mode": "standard", "max_attempts": S3_MAX_ATTEMPTS}),
    )
    install_retry_logging(client)
    return client


def s3_storage_options(credentials: S3Credentials | None = None) -> dict[str, Any]:
    """Options for fsspec/s3fs matching :func:`make_s3_client`: endpoint, region, credentials, retries.

    Pass them to ``fsspec.open``/``fsspec.filesystem("s3", ...)`` so reads through s3fs use the same
    endpoint and credentials as the store, and botocore's standard retry mode. The result holds secrets:
    hand it to fsspec, never log it.
    """
    target = _resolve_s3_target(None, None, credentials)
    client_kwargs: dict[str, Any] = {}
    if target.endpoint_url:
        client_kwargs["endpoint_url"] = target.endpoint_url
    if target.region:
        client_kwargs["region_name"] = target.region
    options: dict[str, Any] = {
        "client_kwargs": client_kwargs,
        "config_kwargs": {"retries": {"mode": "standard", "max_attempts": S3_MAX_ATTEMPTS}},
    }
    if target.profile_name:
        options["profile"] = target.profile_name
    if target.key_pair:
        options["key"], options["secret"] = target.key_pair
        if target.session_token:
            options["token"] = target.session_token
    return options


class Store:
    """Write-once storage rooted at one URL, refusing writes under protected prefixes.

    Args:
        root: A local directory or ``s3://bucket/prefix``.
        protected_prefixes: Locations that must never be written.
        backend: A ready backend (tests); chosen from ``root`` when omitted.
    """

    def __init__(
        self, root: str, protected_prefixes: Iterable[str] = (), backend: Backend | None = None
    ) -> None:
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
