"""Tokenized Parquet parts: their schema, and a writer that cuts rows into write-once parts of fixed size.

A part holds ``rows_per_part`` rows (the last one fewer) in row groups of ``row_group_rows`` rows, so a
training reader can stream one row group (a few MB) at a time. Each part's key-value metadata records the
run and the source of its last row (``<shard key>#<line>``), which a resumed merge checks.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from datagen.dataset.tokenize_workers import ShardRows
from datagen.output.layout import RunLayout
from datagen.output.store import Store

logger = logging.getLogger(__name__)

# Parquet key-value metadata of every part: where its last row came from, checked on resume.
PART_LAST_SOURCE_KEY = b"datagen.last_source"
PART_RUN_KEY = b"datagen.run_id"
PART_COMPRESSION = "zstd"
# Dictionary-encode the repetitive string columns only: token ids (a 150k vocabulary) and masks gain nothing
# from a dictionary but cost a third of the write time building one.
DICTIONARY_COLUMNS = ["prompt_id", "dataset", "finish_reason", "tokenized_from"]


@dataclass
class RowTally:
    """Counts of tokenized rows, kept by whoever writes or reads parts (the merge, the export)."""

    rows: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    longest: int = 0

    def count(self, lengths: Sequence[int], loss_tokens: int) -> None:
        """Count rows of these lengths (in tokens) that hold ``loss_tokens`` tokens the loss counts."""
        self.rows += len(lengths)
        self.tokens += sum(lengths)
        self.loss_tokens += loss_tokens
        self.longest = max(self.longest, max(lengths, default=0))


def part_schema(run_id: str, last_source: str) -> Any:
    """The Arrow schema of a tokenized part, with its metadata."""
    import pyarrow as pa

    return pa.schema(
        [
            pa.field("input_ids", pa.list_(pa.int32())),
            pa.field("loss_mask", pa.list_(pa.int8())),
            pa.field("prompt_id", pa.string()),
            pa.field("sample_index", pa.int32()),
            pa.field("dataset", pa.string()),
            pa.field("num_tokens", pa.int32()),
            pa.field("num_loss_tokens", pa.int32()),
            pa.field("finish_reason", pa.string()),
            pa.field("tokenized_from", pa.string()),
        ],
        metadata={PART_LAST_SOURCE_KEY: last_source.encode(), PART_RUN_KEY: run_id.encode()},
    )


def shard_table(rows: ShardRows) -> Any:
    """The rows of one shard as an Arrow table (columns in :func:`part_schema` order, no metadata)."""
    import pyarrow as pa

    offsets = pa.array(_cumulative(rows.lengths), type=pa.int32())
    values = pa.Array.from_buffers(pa.int32(), len(rows.input_ids), [None, pa.py_buffer(rows.input_ids)])
    mask = pa.Array.from_buffers(pa.int8(), len(rows.loss_mask), [None, pa.py_buffer(rows.loss_mask)])
    return pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(offsets, values),
            "loss_mask": pa.ListArray.from_arrays(offsets, mask),
            "prompt_id": pa.array(rows.prompt_ids, type=pa.string()),
            "sample_index": pa.array(rows.sample_indices, type=pa.int32()),
            "dataset": pa.array(rows.datasets, type=pa.string()),
            "num_tokens": pa.Array.from_buffers(pa.int32(), rows.rows, [None, pa.py_buffer(rows.lengths)]),
            "num_loss_tokens": pa.Array.from_buffers(
                pa.int32(), rows.rows, [None, pa.py_buffer(rows.loss_tokens)]
            ),
            "finish_reason": pa.array(rows.finish_reasons, type=pa.string()),
            "tokenized_from": pa.array(rows.tokenized_from, type=pa.string()),
        }
    )


def _cumulative(lengths: Any) -> list[int]:
    total = 0
    offsets = [0]
    for length in lengths:
        total += length
        offsets.append(total)
    return offsets


class PartWriter:
    """Collects rows and writes a part each time ``rows_per_part`` rows are in (the rest on :meth:`close`).

    Holds at most one part's rows. Parts are numbered from ``first_index``.

    Args:
        store: Where parts go.
        layout: The run's keys.
        rows_per_part: Rows per part.
        row_group_rows: Rows per Parquet row group.
        first_index: Index of the first part this writer writes.
        on_part: Called with ``(key, url, rows)`` after each part is written.
        merge_round: The run's merge round the parts belong to (their keys: ``layout.tokenized_part``).

    """

    def __init__(
        self,
        store: Store,
        layout: RunLayout,
        *,
        rows_per_part: int,
        row_group_rows: int,
        first_index: int,
        on_part: Callable[[str, str, int], None],
        merge_round: int = 0,
    ) -> None:
        self.store = store
        self.layout = layout
        self.merge_round = merge_round
        self.rows_per_part = rows_per_part
        self.row_group_rows = row_group_rows
        self.index = first_index
        self.on_part = on_part
        self._tables: list[Any] = []
        self._rows = 0
        self._last_source = ""

    def add(self, table: Any, sources: list[str]) -> None:
        """Add rows (an Arrow table from :func:`shard_table`) and the source of each row."""
        start = 0
        while start < table.num_rows:
            take = min(self.rows_per_part - self._rows, table.num_rows - start)
            self._tables.append(table.slice(start, take))
            self._rows += take
            self._last_source = sources[start + take - 1]
            start += take
            if self._rows == self.rows_per_part:
                self._flush()

    def close(self) -> None:
        """Write the last, short part (if any rows are left)."""
        if self._rows:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = part_schema(self.layout.run_id, self._last_source)
        table = pa.concat_tables(self._tables).replace_schema_metadata(schema.metadata)
        sink = io.BytesIO()
        with pq.ParquetWriter(
            sink, schema, compression=PART_COMPRESSION, use_dictionary=DICTIONARY_COLUMNS
        ) as writer:
            writer.write_table(table, row_group_size=self.row_group_rows)
        key = self.layout.tokenized_part(self.index, self.merge_round)
        info = self.store.write_bytes(key, sink.getvalue())
        logger.info("wrote tokenized part key=%s rows=%d bytes=%d", key, self._rows, info.size_bytes)
        self.on_part(key, info.url, self._rows)
        self.index += 1
        self._tables = []
        self._rows = 0
