"""The one place input URLs are opened for reading: dataset files, corpus id files, version manifests.

Inputs are read with fsspec, so every protocol it knows works (local paths, ``s3://``, ``gs://``,
``https://`` ...). ``s3://`` URLs get the same endpoint, region, credentials and retry mode as the run's
write-once store (:func:`datagen.output.s3_client.s3_storage_options`). Outputs never go through here: the
:class:`datagen.output.store.Store` writes them, because write-once needs conditional PUTs
(``If-None-Match: *``) that fsspec does not offer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem
    from fsspec.core import OpenFile


def storage_options_for(url: str) -> dict[str, Any]:
    """Fsspec options for ``url``: for s3:// URLs the store's endpoint, region and credentials (secret: never log)."""
    if not url.startswith("s3://"):
        return {}
    from datagen.output.s3_client import s3_storage_options

    return s3_storage_options()


def open_input(url: str, mode: str = "rb", **options: Any) -> OpenFile:
    """Open ``url`` for reading (use as a context manager).

    Args:
        url: A local path or any fsspec URL.
        mode: ``"rb"`` or ``"rt"``.
        **options: More :func:`fsspec.open` options, e.g. ``compression="infer"``, ``encoding="utf-8"``.
    """
    import fsspec

    return fsspec.open(url, mode, **options, **storage_options_for(url))


def input_filesystem(url: str) -> tuple[AbstractFileSystem, str]:
    """The filesystem holding ``url`` and the path in it, for listing and globbing inputs."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **storage_options_for(url))
    return fs, str(path)
