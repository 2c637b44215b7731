"""The one place input URLs are opened for reading: dataset files, corpus id files, version manifests.

Inputs are read with fsspec, so every protocol it knows works (local paths, ``s3://``, ``gs://``,
``https://`` ...). ``s3://`` URLs get the same endpoint, region and retry mode as the run's write-once
store (:func:`datagen.output.s3_client.s3_storage_options`) and the credentials the caller passes: the
store's (:attr:`datagen.output.store.Store.credentials`), None for the standard AWS chain. Outputs never go through here: the
:class:`datagen.output.store.Store` writes them, because write-once needs conditional PUTs
(``If-None-Match: *``) that fsspec does not offer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem
    from fsspec.core import OpenFile

    from datagen.output.s3_client import S3Credentials


def storage_options_for(url: str, credentials: S3Credentials | None = None) -> dict[str, Any]:
    """Fsspec options for ``url``: for s3:// URLs the store's endpoint and region, and ``credentials``.

    The result holds secrets: hand it to fsspec, never log it.
    """
    if not url.startswith("s3://"):
        return {}
    from datagen.output.s3_client import s3_storage_options

    return s3_storage_options(credentials)


def open_input(
    url: str, mode: str = "rb", *, credentials: S3Credentials | None = None, **options: Any
) -> OpenFile:
    """Open ``url`` for reading (use as a context manager).

    Args:
        url: A local path or any fsspec URL.
        mode: ``"rb"`` or ``"rt"``.
        credentials: S3 credentials for an ``s3://`` URL (None: the standard AWS chain).
        **options: More :func:`fsspec.open` options, e.g. ``compression="infer"``, ``encoding="utf-8"``.
    """
    import fsspec

    return fsspec.open(url, mode, **options, **storage_options_for(url, credentials))


def input_filesystem(url: str, credentials: S3Credentials | None = None) -> tuple[AbstractFileSystem, str]:
    """The filesystem holding ``url`` and the path in it, for listing and globbing inputs.

    Args:
        url: A local path or any fsspec URL.
        credentials: S3 credentials for an ``s3://`` URL (None: the standard AWS chain).
    """
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **storage_options_for(url, credentials))
    return fs, str(path)
