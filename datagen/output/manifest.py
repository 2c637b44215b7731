"""The run manifest: the last object of a run, listing every other object with its size and checksum.

Its existence means the run is complete; readers check it first. It is written once, after the report.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from datagen.errors import OutputExistsError
from datagen.output.layout import RunLayout
from datagen.output.store import Store
from datagen.records import utc_now

HASH_CHUNK_BYTES = 1 << 20


class ManifestEntry(BaseModel):
    """One object of the run."""

    model_config = ConfigDict(extra="forbid")

    key: str
    size_bytes: int
    sha256: str


class RunManifest(BaseModel):
    """Every object of a complete run, plus its headline counts."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = 1
    run_id: str
    config_hash: str
    completed_at: dt.datetime = Field(default_factory=utc_now)
    counts: dict[str, Any] = Field(default_factory=dict)
    dataset_version: str | None = None
    objects: list[ManifestEntry]


def hash_object(store: Store, key: str) -> ManifestEntry:
    """Stream one object through sha256 (bounded memory)."""
    digest = hashlib.sha256()
    size = 0
    with store.open_read(key) as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return ManifestEntry(key=key, size_bytes=size, sha256=digest.hexdigest())


def read_manifest(store: Store, layout: RunLayout) -> RunManifest | None:
    """The run's manifest, or None while the run is incomplete."""
    if not store.exists(layout.manifest):
        return None
    return RunManifest.model_validate(store.read_json(layout.manifest))


def write_manifest(
    store: Store,
    layout: RunLayout,
    *,
    config_hash: str,
    counts: dict[str, Any],
    dataset_version: str | None,
) -> RunManifest:
    """List and hash every object of the run, then write ``manifest.json`` (once, last).

    Returns:
        The manifest; the stored one when it exists already (a rerun of a complete run).
    """
    existing = read_manifest(store, layout)
    if existing is not None:
        return existing
    keys = [key for key in store.list(layout.root) if key != layout.manifest]
    manifest = RunManifest(
        run_id=layout.run_id,
        config_hash=config_hash,
        counts=counts,
        dataset_version=dataset_version,
        objects=[hash_object(store, key) for key in keys],
    )
    try:
        store.write_json(layout.manifest, manifest)
    except OutputExistsError:
        # A concurrent process on the same run finished first; its manifest stands.
        stored = read_manifest(store, layout)
        assert stored is not None
        return stored
    return manifest
