"""S3 backend of the write-once store: ``PutObject`` with ``If-None-Match: *``, resumable reads.

S3 answers 412 when the key exists (:class:`~datagen.errors.OutputExistsError`) and 409 when a concurrent
create of the same key is in progress (:class:`~datagen.errors.TransientStorageError`). When a put landed
but its response was lost, the retry meets 412 and the stored object is compared with our bytes: the same
bytes are our own write (an idempotent create), other bytes are someone else's.
A download cut short mid-body resumes with a ranged GET from the last byte received.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
from collections.abc import Callable, Iterable
from typing import IO, Any

from datagen.errors import (
    OutputExistsError,
    StorageError,
    TransientStorageError,
)
from datagen.output.objects import Level
from datagen.output.s3_client import (
    HTTP_NOT_FOUND,
    HTTP_PRECONDITION_FAILED,
    S3_BODY_READ_ATTEMPTS,
    S3_READ_BUFFER_BYTES,
    S3Credentials,
    error_facts,
    install_retry_logging,
    is_transient_status,
    make_s3_client,
)

logger = logging.getLogger(__name__)

# Part size of streamed (multipart) uploads: the memory a streamed write holds, and 10,000 parts (S3's limit)
# of it reach 640 GiB. S3 requires at least 5 MiB for every part but the last.
S3_PART_BYTES = 64 * 1024 * 1024


def _storage_error(action: str, url: str, error: Exception) -> StorageError | TransientStorageError:
    """The datagen error for an S3 failure left after botocore's retries (codes and class names only).

    Transient (5xx, throttling, 409 conflict, connection trouble) gives a TransientStorageError, anything
    else a StorageError; neither quotes a request, so no credential can leak into the message.
    """
    code, status = error_facts(error)
    if not code and not status:
        return TransientStorageError(
            f"S3 {action} of {url} failed after retries ({type(error).__name__}); retry later", url=url
        )
    if is_transient_status(code, status) or code == "ConditionalRequestConflict":
        return TransientStorageError(
            f"S3 {action} of {url} failed ({code or status}) after retries; retry later", url=url
        )
    return StorageError(f"S3 {action} of {url} failed: {code or status} {error}", url=url, code=code)


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
            code, status = error_facts(error)
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

    def create_stream(self, key: str, chunks: Iterable[bytes], part_bytes: int = S3_PART_BYTES) -> int:
        """Create ``key`` from a stream of chunks holding at most about ``part_bytes`` in memory.

        A stream shorter than one part is one conditional put (:meth:`create`). A longer one is a multipart
        upload completed with ``If-None-Match: *``: the object appears whole at completion or not at all, and
        the upload is aborted on any failure. A 412 at completion whose object carries our multipart ETag
        (the MD5 of the parts' MD5s) is our own completion whose answer was lost.
        """
        from botocore.exceptions import BotoCoreError, ClientError

        buffer = bytearray()
        stream = iter(chunks)
        for chunk in stream:
            buffer += chunk
            if len(buffer) >= part_bytes:
                break
        else:
            self.create(key, bytes(buffer))
            return len(buffer)
        full_key = self._key(key)
        upload = self._object_call("write", key, self.client.create_multipart_upload)
        upload_id = upload["UploadId"]
        parts: list[dict[str, Any]] = []
        digests: list[bytes] = []
        size = 0
        try:

            def send(data: bytes) -> None:
                number = len(parts) + 1
                answer = self._object_call(
                    "write", key, self.client.upload_part, UploadId=upload_id, PartNumber=number, Body=data
                )
                parts.append({"PartNumber": number, "ETag": answer["ETag"]})
                digests.append(hashlib.md5(data, usedforsecurity=False).digest())

            for chunk in stream:
                buffer += chunk
                while len(buffer) >= 2 * part_bytes:
                    send(bytes(buffer[:part_bytes]))
                    size += part_bytes
                    del buffer[:part_bytes]
            # The rest: one part, or two when it is over one part (every part but the last >= part_bytes).
            if len(buffer) > part_bytes:
                send(bytes(buffer[:part_bytes]))
                size += part_bytes
                del buffer[:part_bytes]
            send(bytes(buffer))
            size += len(buffer)
            etag = hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest() + f"-{len(parts)}"
            try:
                self.client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=full_key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                    IfNoneMatch="*",
                )
            except ClientError as error:
                code, status = error_facts(error)
                if status == HTTP_PRECONDITION_FAILED or code == "PreconditionFailed":
                    head = self._object_call("head", key, self.client.head_object)
                    if str(head.get("ETag", "")).strip('"') == etag:
                        return size
                    raise OutputExistsError(self.url(key)) from None
                raise _storage_error("write", self.url(key), error) from error
            except BotoCoreError as error:
                raise _storage_error("write", self.url(key), error) from error
        except BaseException:
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=full_key, UploadId=upload_id)
            raise
        return size

    def _holds(self, key: str, data: bytes) -> bool:
        """Tell whether the object ``key`` holds exactly ``data`` (size, then MD5 ETag, then the bytes)."""
        head = self._object_call("read", key, self.client.head_object)
        if int(head.get("ContentLength", -1)) != len(data):
            return False
        # A single-part upload without KMS encryption has its MD5 as ETag; anything else is compared byte
        # by byte (an ETag that is not our MD5 proves nothing on its own).
        if str(head.get("ETag", "")).strip('"') == hashlib.md5(data, usedforsecurity=False).hexdigest():
            return True
        return self.read(key) == data

    def _object_call(self, action: str, key: str, method: Any, **params: Any) -> Any:
        """:meth:`_call` on the object ``key`` of this store's bucket (its Bucket and full Key filled in)."""
        return self._call(action, key, method, Bucket=self.bucket, Key=self._key(key), **params)

    def _call(self, action: str, key: str, method: Any, **params: Any) -> Any:
        """Call a read-side S3 operation, mapping what is left after botocore's retries to our errors."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return method(**params)
        except ClientError as error:
            code, status = error_facts(error)
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
        response = self._object_call("read", key, self.client.get_object)

        def rest_from(offset: int) -> Any:
            return self._object_call("read", key, self.client.get_object, Range=f"bytes={offset}-")["Body"]

        body = _ResumingBody(
            response["Body"], int(response.get("ContentLength", 0)), rest_from, self.url(key)
        )
        return io.BufferedReader(body, buffer_size=S3_READ_BUFFER_BYTES)

    def exists(self, key: str) -> bool:
        """Tell whether ``key`` exists (a HEAD request)."""
        try:
            self._object_call("head", key, self.client.head_object)
        except FileNotFoundError:
            return False
        return True

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` relative to the store root, sorted."""
        return list(self.list_sizes(prefix))

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """Keys under ``prefix`` relative to the store root (sorted) with their sizes (the listing's ``Size``)."""
        full = self._key(prefix).rstrip("/") + "/"
        paginator = self.client.get_paginator("list_objects_v2")

        def every_key() -> list[tuple[str, int]]:
            # Pages are fetched lazily while iterating, so the whole iteration is the call to guard.
            pages = paginator.paginate(Bucket=self.bucket, Prefix=full)
            return [
                (str(item["Key"]), int(item["Size"])) for page in pages for item in page.get("Contents", [])
            ]

        items: list[tuple[str, int]] = self._call("list", prefix, every_key)
        start = len(self.prefix) + 1 if self.prefix else 0
        return dict(sorted((key[start:], size) for key, size in items))

    def list_level(self, prefix: str) -> Level:
        """The objects directly under ``prefix`` (sizes) and its subfolders: one level (``Delimiter='/'``)."""
        full = self._key(prefix).rstrip("/") + "/"
        paginator = self.client.get_paginator("list_objects_v2")

        def one_level() -> tuple[list[tuple[str, int]], list[str]]:
            objects: list[tuple[str, int]] = []
            folders: list[str] = []
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full, Delimiter="/"):
                objects += [(str(item["Key"]), int(item["Size"])) for item in page.get("Contents", [])]
                folders += [str(item["Prefix"]) for item in page.get("CommonPrefixes", [])]
            return objects, folders

        objects, folders = self._call("list", prefix, one_level)
        start = len(self.prefix) + 1 if self.prefix else 0
        return Level(
            dict(sorted((key[start:], size) for key, size in objects if not key.endswith("/"))),
            sorted(folder[start:].rstrip("/") for folder in folders),
        )


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
