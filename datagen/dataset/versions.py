"""Dataset versions: the write-once manifests of a training set (parts, adopted sources, exports) and their claim.

A version lists every Parquet part of the training set, its base versions' included by reference (never
copied or rewritten). Numbers are claimed write-once: a writer that finds its number taken steps to the next
(:func:`claim_version`). The merge (:mod:`datagen.dataset.merge`), ``datagen corpus adopt``
(:mod:`datagen.dataset.corpus`) and the trainer export (:mod:`datagen.dataset.export`) all build on these.
"""

from __future__ import annotations

import datetime as dt
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from datagen.errors import ConfigError, DatagenError, OutputExistsError
from datagen.output.layout import dataset_version
from datagen.output.store import Store
from datagen.records import utc_now

DATASET_VERSION_SCHEMA = 1
EXPORT_SCHEMA = 1
JSONL_FORMAT: Final = "jsonl"
# How many times to step to the next version number when another writer took ours.
MAX_VERSION_CLAIMS = 1000


class TokenizedPartRef(BaseModel):
    """One Parquet part of a run (or of a base dataset version)."""

    model_config = ConfigDict(extra="forbid")

    key: str | None = Field(default=None, description="Object key relative to the store root, for new parts.")
    url: str = Field(description="Full location of the part.")
    rows: int
    source: str = Field(
        description="Run id that produced it, 'base:<version url>' for inherited shards, 'adopted:<corpus url>' "
        "for parts of an adopted corpus."
    )
    size_bytes: int | None = Field(default=None, description="Object size, recorded for adopted parts.")
    sha256: str | None = Field(default=None, description="Object checksum, recorded for adopted parts.")
    tokens: int | None = Field(default=None, description="Tokens in the part, when counted.")
    loss_tokens: int | None = Field(default=None, description="Trained-on tokens in the part, when counted.")


class CompletionSourceRef(BaseModel):
    """A completions file of an adopted corpus: referenced (never copied), validated and counted."""

    model_config = ConfigDict(extra="forbid")

    url: str
    rows: int
    size_bytes: int
    sha256: str
    usage_tokens: int = Field(description="Prompt + completion tokens the records' usage reports.")
    tokenized_rows: int | None = Field(
        default=None,
        description="Rows of this file in the version's Parquet parts, when adoption tokenized it (None: not "
        "tokenized, so not in the training parts).",
    )


class ExportRecord(BaseModel):
    """One written export of a dataset version: where it is, what it holds, and its checksum."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = EXPORT_SCHEMA
    format: Literal["jsonl"] = JSONL_FORMAT
    key: str = Field(description="Object key of the rows, relative to the store root.")
    url: str = Field(description="Full location of the rows: what a trainer is pointed at.")
    parts: list[str] = Field(description="URLs of the Parquet parts exported, in row order.")
    rows: int
    tokens: int
    loss_tokens: int
    longest_row_tokens: int = Field(
        description="Tokens of the longest row: the trainers' max_length/seq-length."
    )
    size_bytes: int
    sha256: str
    created_at: dt.datetime = Field(default_factory=utc_now)


class DatasetVersion(BaseModel):
    """A dataset version manifest: every Parquet shard of the training set, old and new.

    Shards of the base version are listed by reference: they are never copied or rewritten.
    """

    model_config = ConfigDict(extra="forbid")

    schema_version: int = DATASET_VERSION_SCHEMA
    name: str
    version: int
    created_at: dt.datetime = Field(default_factory=utc_now)
    run_id: str
    base_version: str | None = None
    rows: int
    shards: list[TokenizedPartRef]
    merge_round: int = Field(
        default=0,
        ge=0,
        description="The run's merge round that published it (a run's later rounds extend it).",
    )
    adopted_from: str | None = Field(
        default=None, description="Corpus URL this version adopted in place (`datagen corpus adopt`)."
    )
    completion_sources: list[CompletionSourceRef] = Field(
        default_factory=list, description="Completions files of an adopted corpus (referenced, not parts)."
    )
    categories: dict[str, int] = Field(
        default_factory=dict, description="Rows per category of an adopted corpus, by its category rule."
    )
    exports: list[ExportRecord] = Field(
        default_factory=list,
        description="Trainer exports written with the version (`tokenize.formats`); a later `datagen export` "
        "writes its record beside the version instead (see datagen/dataset/export.py).",
    )

    def parquet_urls(self) -> list[str]:
        """Every Parquet part of the training set, base versions' included, in order: what a reader loads."""
        return [shard.url for shard in self.shards]


def read_base_version(store: Store, reference: str) -> tuple[str, DatasetVersion]:
    """Read the base dataset version: a key in this store, or a full URL (local path or s3://)."""
    try:
        if "://" in reference or reference.startswith("/"):
            parent, _, name = reference.rstrip("/").rpartition("/")
            data = Store(parent or "/", credentials=store.credentials).read_json(name)
            url = reference
        else:
            data = store.read_json(reference)
            url = store.url(reference)
    except FileNotFoundError:
        raise ConfigError(
            f"tokenize.base_version {reference} does not exist; give the URL (or store key) of an existing "
            "dataset version manifest such as datasets/<name>/v0001.json.",
            base_version=reference,
        ) from None
    try:
        return url, DatasetVersion.model_validate(data)
    except ValidationError as error:
        raise ConfigError(
            f"tokenize.base_version {reference} is not a datagen dataset version manifest: {error}",
            base_version=reference,
        ) from None


def claim_version(
    store: Store, numbers: list[int], error: type[DatagenError], draft: DatasetVersion
) -> tuple[str, DatasetVersion]:
    """Write ``draft`` as the next free version of its dataset (write-once: a number taken meanwhile is skipped).

    Args:
        store: Where versions live.
        numbers: The version numbers seen; the first try is one past the highest.
        error: Raised when :data:`MAX_VERSION_CLAIMS` numbers were all taken.
        draft: The version document; its ``version`` is replaced by the number claimed.

    Returns:
        The version's key and document.

    """
    name = draft.name
    number = max(numbers, default=0) + 1
    for _ in range(MAX_VERSION_CLAIMS):
        version = draft.model_copy(update={"version": number})
        key = dataset_version(name, number)
        try:
            store.write_json(key, version)
        except OutputExistsError:
            number += 1
            continue
        return key, version
    raise error(f"Could not claim a version number for dataset {name} after {MAX_VERSION_CLAIMS} tries.")
