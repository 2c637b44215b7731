"""Write larger prompt files in every dataset layout, by varying the bundled sample rows.

Each output file keeps its layout's real file type and record shape (Parquet, JSON array, JSONL); every
row is a sample row whose free-text fields carry a variant number, so prompts stay distinct (no dedupe)
while every reader and normaliser path is exercised at scale.

    python benchmarks/make_prompt_files.py --rows-per-layout 300 --out /tmp/prompts
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from datagen.config import DatasetFormat
from datagen.prompts.datasets import iter_rows
from datagen.samples import sample_path

# Strings shorter than this (ids, roles, categories) are left alone.
MIN_TEXT_CHARS = 12


def vary(value: Any, variant: int) -> Any:
    """Tag every free-text string in ``value`` with the variant number."""
    if isinstance(value, str):
        stripped = value.strip()
        if stripped[:1] in "[{":
            # Embedded JSON (Toucan's messages): vary inside it, keep it valid JSON.
            try:
                return json.dumps(vary(json.loads(stripped), variant))
            except ValueError:
                return value
        if len(stripped) < MIN_TEXT_CHARS:
            return value
        return f"{value} (variant {variant})"
    if isinstance(value, list):
        return [vary(item, variant) for item in value]
    if isinstance(value, dict):
        return {key: vary(item, variant) for key, item in value.items()}
    return value


def write_layout(layout: str, rows_per_layout: int, out: Path) -> Path:
    """Write one layout's file of ``rows_per_layout`` rows; return its path."""
    source = sample_path(layout)
    rows = [row.data for row in iter_rows(source) if row.error is None and isinstance(row.data, dict)]
    produced = [vary(rows[index % len(rows)], index) for index in range(rows_per_layout)]
    suffix = Path(source).suffix
    target = out / f"{layout}{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(produced), target)
    elif suffix == ".json":
        target.write_text(json.dumps(produced))
    else:
        target.write_text("".join(json.dumps(row) + "\n" for row in produced))
    return target


def main() -> None:
    """Write every layout."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows-per-layout", type=int, default=300)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for layout in DatasetFormat.__args__:  # type: ignore[attr-defined]
        print(write_layout(layout, args.rows_per_layout, args.out))


if __name__ == "__main__":
    main()
