"""Write larger prompt files in every dataset layout, by varying the bundled sample rows.

Each output file keeps its layout's real file type and record shape (Parquet, JSON array, JSONL); every
row is a sample row whose free-text fields carry a variant number, so prompts stay distinct (no dedupe)
while every reader and normaliser path is exercised at scale.

    python benchmarks/make_prompt_files.py --rows-per-layout 300 --out /tmp/prompts

:func:`write_seed_datasets` writes the seed's six datasets instead (``--seed-prompts N``): N distinct
prompts in the seed's proportions, plus rows every run must drop (duplicates within a dataset, questions
that repeat an earlier dataset's, and the sample rows the normalisers reject).
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
from datagen.prompts.datasets.identity import prompt_id_for
from datagen.prompts.datasets.model import Rejection
from datagen.prompts.datasets.registry import normalise_row
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


# The seed's request count and its six datasets in config order (distinct prompts of each): the
# proportions of configs/qwen36-27b-8xgpu.yaml, Hermes and AgentInstruct whole.
SEED_PROMPTS = 193_010
SEED_DATASETS: dict[str, int] = {
    "infinity_instruct": 84_502,
    "webinstruct": 42_251,
    "codefeedback_filtered": 10_563,
    "metamath": 42_250,
    "hermes_fc": 11_578,
    "agentinstruct": 1_866,
}
# Rows per 1,000 distinct prompts that repeat another row: of the same dataset (Infinity-Instruct), or a
# WebInstruct question (MetaMath, CodeFeedback-Filtered; later in config order, so dropped there).
DUPLICATES_PER_1000 = 5


def _prompt_ids(layout: str, row: Any) -> list[str] | None:
    result = normalise_row(layout, row, 0)
    if isinstance(result, Rejection):
        return None
    return [prompt_id_for(prompt.messages, prompt.tools) for prompt in result]


def seed_counts(prompts: int) -> dict[str, int]:
    """Distinct prompts per seed dataset for a run of ``prompts`` in all (the seed's proportions)."""
    counts = {name: max(1, prompts * count // SEED_PROMPTS) for name, count in SEED_DATASETS.items()}
    counts["infinity_instruct"] += prompts - sum(counts.values())
    return counts


def _write_rows(layout: str, rows: list[Any], out: Path) -> Path:
    suffix = Path(sample_path(layout)).suffix
    target = out / f"{layout}{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), target)
    elif suffix == ".json":
        target.write_text(json.dumps(rows))
    else:
        target.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return target


def write_seed_datasets(prompts: int, out: Path) -> dict[str, Path]:
    """Write the seed's six datasets holding ``prompts`` distinct prompts in all, in their real layouts.

    Each dataset gets its share of distinct prompts (sample rows varied by a number; only sample rows
    whose variants normalise to one distinct prompt each are varied), the sample rows its normaliser
    rejects (once each), and duplicates a run must drop (see :data:`DUPLICATES_PER_1000`).

    Returns:
        The file of each layout, in config order.
    """
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    webinstruct_questions: list[str] = []
    for layout, count in seed_counts(prompts).items():
        sample = [row.data for row in iter_rows(sample_path(layout)) if row.error is None]
        good, rejected = [], []
        for row in sample:
            first, second = _prompt_ids(layout, vary(row, 0)), _prompt_ids(layout, vary(row, 1))
            if first is not None and second is not None and len(first) == 1 and first != second:
                good.append(row)
            elif _prompt_ids(layout, row) is None:
                rejected.append(row)
        rows = [vary(good[index % len(good)], index) for index in range(count)]
        duplicates = count * DUPLICATES_PER_1000 // 1000
        if layout == "webinstruct":
            webinstruct_questions = [row["question"] for row in rows[:duplicates]]
        elif layout == "metamath":
            rows += [{"query": q, "response": "x", "type": "GSM_AnsAug"} for q in webinstruct_questions]
        elif layout == "codefeedback_filtered":
            rows += [{"query": q, "answer": "x"} for q in webinstruct_questions]
        elif layout == "infinity_instruct":
            rows += rows[:duplicates]
        written[layout] = _write_rows(layout, rejected + rows, out)
    return written


def main() -> None:
    """Write every layout (or the seed's six datasets)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows-per-layout", type=int, default=300)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed-prompts", type=int, help=f"the seed's six datasets instead ({SEED_PROMPTS})")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.seed_prompts:
        for path in write_seed_datasets(args.seed_prompts, args.out).values():
            print(path)
        return
    for layout in DatasetFormat.__args__:  # type: ignore[attr-defined]
        print(write_layout(layout, args.rows_per_layout, args.out))


if __name__ == "__main__":
    main()
