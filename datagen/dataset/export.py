"""Export a dataset version in the layout the drafter trainers read as-is, beside its Parquet parts.

SpecForge 0.2.0 (``data.prompts_path``, read by ``specforge/data/prompt_builder.py::prepare_prompt_tasks``) and
vllm-project speculators 0.9.0 (``prepare-data --data``, whose ``_passthrough_pretokenized`` keeps pre-tokenized
rows as they are) both read one local JSONL file of ``{"input_ids": [...], "loss_mask": [...]}`` rows; neither
reads Parquet parts (SpecForge fails with ``UnicodeDecodeError``, speculators refuses a ``.parquet`` path and a
folder holding ``summary.json``). The ``jsonl`` export is that file, for every row of the version in its order:
the base version's parts (adopted corpus included) and the run's parts alike, read one part at a time and
written as one write-once object through :meth:`~datagen.output.store.Store.write_stream` (bounded memory).

Keys (relative to the store root) depend only on the dataset name and the version's list of parts, so they are
known before the version manifest is written (a merge lists its export in the manifest) and a second export of
the same parts finds the first (a no-op)::

    datasets/<name>/exports/<digest>/train.jsonl   the rows (the folder holds nothing else)
    datasets/<name>/exports/<digest>.json           ExportRecord, written after the rows

The Parquet parts stay what the version is; nothing existing is rewritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from datagen.dataset.parts import RowTally
from datagen.dataset.versions import (
    EXPORT_SCHEMA,
    JSONL_FORMAT,
    DatasetVersion,
    ExportRecord,
    TokenizedPartRef,
    read_base_version,
)
from datagen.errors import ConfigError, DatasetError, OutputExistsError
from datagen.output.layout import dataset_export
from datagen.output.store import Store
from datagen.progress import WorkProgress, report_work

logger = logging.getLogger(__name__)

EXPORT_DIGEST_CHARS = 16
# Rows decoded from Parquet at a time, and bytes of JSON lines gathered before they go to the store's stream.
EXPORT_BATCH_ROWS = 1_000
EXPORT_CHUNK_BYTES = 4 * 1024 * 1024
SPECFORGE_VERSION = "0.2.0"
SPECULATORS_VERSION = "0.9.0"


@dataclass
class _Tally(RowTally):
    """What the export counts: its rows and tokens as they are read, its bytes as they are streamed."""

    size: int = 0
    digest: Any = field(default_factory=hashlib.sha256)

    def chunk(self, lines: list[bytes]) -> bytes:
        """Join ``lines`` into the next chunk of the stream, counted into the size and the digest."""
        chunk = b"".join(lines)
        self.digest.update(chunk)
        self.size += len(chunk)
        return chunk


def export_keys(name: str, shards: list[TokenizedPartRef]) -> tuple[str, str]:
    """The keys of the rows and of the record of the ``jsonl`` export of these parts of dataset ``name``."""
    identity = json.dumps({"schema": EXPORT_SCHEMA, "format": JSONL_FORMAT, "parts": [s.url for s in shards]})
    return dataset_export(name, hashlib.sha256(identity.encode()).hexdigest()[:EXPORT_DIGEST_CHARS])


def find_export(store: Store, version: DatasetVersion) -> ExportRecord | None:
    """The ``jsonl`` export of a version: listed in its manifest, or written later beside it; None if neither."""
    if version.exports:
        return version.exports[0]
    _, record_key = export_keys(version.name, version.shards)
    if store.exists(record_key):
        return ExportRecord.model_validate(store.read_json(record_key))
    return None


def write_export(store: Store, name: str, shards: list[TokenizedPartRef]) -> ExportRecord:
    """Write (once) the ``jsonl`` export of the parts ``shards`` of dataset ``name``; a no-op when it exists.

    Every part is read whole (one part in memory at a time: parts are ``rows_per_part`` rows) and its rows
    are streamed into one write-once object, then the :class:`ExportRecord` is written.

    Raises:
        DatasetError: A part is unreadable, lacks ``input_ids``/``loss_mask``, has rows of unequal lengths, or
            holds another number of rows than the version says.
    """
    data_key, record_key = export_keys(name, shards)
    if store.exists(record_key):
        logger.info("export exists key=%s", data_key)
        return ExportRecord.model_validate(store.read_json(record_key))
    tally = _Tally()
    try:
        info = store.write_stream(data_key, _jsonl_chunks(store, shards, tally))
    except OutputExistsError:
        # An interrupted export wrote the rows but not the record: the rows are deterministic, so count
        # them again (without writing) and check the stored object is the same bytes.
        tally = _Tally()
        for _ in _jsonl_chunks(store, shards, tally):
            pass
        stored = _sha256(store, data_key)
        if stored != tally.digest.hexdigest():
            raise DatasetError(
                f"{store.url(data_key)} exists but holds other rows than the version's parts; remove it "
                "(it is an export, never a source) and export again."
            ) from None
        info = None
    record = ExportRecord(
        key=data_key,
        url=store.url(data_key),
        parts=[shard.url for shard in shards],
        rows=tally.rows,
        tokens=tally.tokens,
        loss_tokens=tally.loss_tokens,
        longest_row_tokens=tally.longest,
        size_bytes=info.size_bytes if info else tally.size,
        sha256=tally.digest.hexdigest(),
    )
    try:
        store.write_json(record_key, record)
    except OutputExistsError:
        return ExportRecord.model_validate(store.read_json(record_key))
    logger.info("exported key=%s rows=%d bytes=%d", data_key, record.rows, record.size_bytes)
    return record


def export_version(store: Store, reference: str) -> tuple[str, DatasetVersion, ExportRecord]:
    """Export a written dataset version (a key in ``store`` or a URL) into ``store``; a no-op when done.

    Returns:
        The version's URL, the version, and its export.
    """
    try:
        url, version = read_base_version(store, reference)
    except ConfigError as error:
        reason = (
            "does not exist"
            if "does not exist" in str(error)
            else "is not a datagen dataset version manifest"
        )
        raise DatasetError(
            f"{reference} {reason}; give the URL of a dataset version manifest, e.g. .../datasets/<name>/v0001.json."
        ) from None
    existing = find_export(store, version)
    if existing is not None:
        return url, version, existing
    return url, version, write_export(store, version.name, version.shards)


def version_store_root(version_url: str) -> str | None:
    """The root of the store holding a version manifest (``<root>/datasets/<name>/vNNNN.json``), or None."""
    match = re.search(r"^(?P<root>.*)/datasets/[^/]+/v\d+\.json$", version_url)
    return match["root"] if match and match["root"] else None


def _sha256(store: Store, key: str) -> str:
    digest = hashlib.sha256()
    with store.open_read(key) as handle:
        while chunk := handle.read(EXPORT_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _read_part(store: Store, shard: TokenizedPartRef) -> bytes:
    """The bytes of a part: by key in this store, else by URL (another store, an adopted corpus)."""
    if shard.key is not None and store.url(shard.key) == shard.url:
        return store.read_bytes(shard.key)
    parent, _, name = shard.url.rstrip("/").rpartition("/")
    try:
        return Store(parent or "/", credentials=store.credentials).read_bytes(name)
    except FileNotFoundError:
        raise DatasetError(
            f"Part {shard.url} of the version is missing; the version cannot be exported."
        ) from None


def _jsonl_chunks(store: Store, shards: list[TokenizedPartRef], tally: _Tally) -> Iterator[bytes]:
    """The version's rows as JSON lines, in chunks of about ``EXPORT_CHUNK_BYTES``, counted into ``tally``."""
    pending: list[bytes] = []
    pending_bytes = 0
    for index, shard in enumerate(shards):
        report_work(
            WorkProgress(
                what="export", done=index, total=len(shards), unit="parts", detail=f"{tally.rows} rows"
            )
        )
        rows = 0
        for line in _part_lines(shard.url, _read_part(store, shard), tally):
            pending.append(line)
            pending_bytes += len(line)
            rows += 1
            if pending_bytes >= EXPORT_CHUNK_BYTES:
                yield tally.chunk(pending)
                pending, pending_bytes = [], 0
        if rows != shard.rows:
            raise DatasetError(
                f"{shard.url} holds {rows} rows but the version lists {shard.rows}; the part changed since the "
                "version was written."
            )
    if pending:
        yield tally.chunk(pending)
    report_work(
        WorkProgress(
            what="export", done=len(shards), total=len(shards), unit="parts", detail=f"{tally.rows} rows"
        )
    )


def _part_lines(url: str, data: bytes, tally: _Tally) -> Iterator[bytes]:
    """One JSON line per row of a Parquet part: exactly its ``input_ids`` and ``loss_mask``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
        missing = {"input_ids", "loss_mask"} - set(parquet.schema_arrow.names)
        if missing:
            raise DatasetError(
                f"{url} lacks the column(s) {sorted(missing)}; it is not a tokenized training part."
            )
        for batch in parquet.iter_batches(batch_size=EXPORT_BATCH_ROWS, columns=["input_ids", "loss_mask"]):
            ids_column, mask_column = batch.column("input_ids"), batch.column("loss_mask")
            if ids_column.null_count or mask_column.null_count:
                raise DatasetError(f"{url}: a row has no input_ids or loss_mask.")
            id_offsets = ids_column.offsets.to_numpy()
            mask_offsets = mask_column.offsets.to_numpy()
            if (id_offsets - id_offsets[0] != mask_offsets - mask_offsets[0]).any():
                raise DatasetError(f"{url}: a row's input_ids and loss_mask differ in length.")
            ids = ids_column.values.to_numpy(zero_copy_only=False)
            mask = mask_column.values.to_numpy(zero_copy_only=False)
            lengths = (id_offsets[1:] - id_offsets[:-1]).tolist()
            tally.count(lengths, int(mask[mask_offsets[0] : mask_offsets[-1]].sum()))
            for row in range(batch.num_rows):
                start, end = int(id_offsets[row]), int(id_offsets[row + 1])
                mask_start = int(mask_offsets[row])
                length = end - start
                yield (
                    orjson.dumps(
                        {"input_ids": ids[start:end], "loss_mask": mask[mask_start : mask_start + length]},
                        option=orjson.OPT_SERIALIZE_NUMPY,
                    )
                    + b"\n"
                )
    except (pa.ArrowException, OSError) as error:
        raise DatasetError(f"{url} is not a readable Parquet file: {error}") from None


def training_commands(record: ExportRecord, tokenizer: str | None = None) -> list[str]:
    """The commands that train each drafter trainer on an export, as a user types them.

    ``max_length``/``--seq-length`` is the longest row, so neither trainer cuts a row (SpecForge's default
    2048 and speculators' 8192 would cut longer rows silently).

    Args:
        record: The export.
        tokenizer: The target model (or its tokenizer folder) for speculators' ``--model``.
    """
    data = record.url
    lines: list[str] = []
    if "://" in record.url:
        data = "./train.jsonl"
        lines.append(f"aws s3 cp {record.url} {data}   # both trainers read a local file")
    length = record.longest_row_tokens
    model = tokenizer or "<target model or its tokenizer folder>"
    lines += [
        f"# SpecForge {SPECFORGE_VERSION} (a config without data.train_data_path / data.hidden_states_path):",
        f"specforge train --config <your-run.yaml> data.prompts_path={data} data.max_length={length}",
        f"# speculators {SPECULATORS_VERSION}: pre-tokenized rows pass through prepare-data unchanged",
        f"speculators prepare-data --model {model} --data {data} --seq-length {length} --output ./prepared",
        f"speculators train --verifier-name-or-path {model} --data-path ./prepared --total-seq-len {length} "
        "--speculator-type eagle3",
    ]
    return lines


def parquet_hint(version_url: str) -> list[str]:
    """How to export a version that has no trainer export yet, and how to read its Parquet parts directly."""
    return [
        f"datagen export {version_url}   # writes the JSONL both trainers read, then prints their commands",
        "# or read the Parquet parts: datasets.load_dataset('parquet', data_files=DatasetVersion.parquet_urls())",
    ]


def summary_training_lines(summary: dict[str, Any], tokenizer: str | None) -> list[str]:
    """What the report shows under "Training on this version", from a tokenize summary (as a dict).

    The trainers' commands when the version was exported (``tokenize.formats`` with ``jsonl``), else how to
    export it; nothing before a merge.
    """
    exports = summary.get("exports") or []
    if exports:
        return training_commands(ExportRecord.model_validate(exports[0]), tokenizer)
    url = summary.get("dataset_version_url")
    return parquet_hint(url) if url else []
