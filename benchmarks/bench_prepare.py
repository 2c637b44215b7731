"""Prompt preparation of the seed's six datasets: one after another vs scanned in parallel worker processes.

Writes the seed's datasets (``make_prompt_files.write_seed_datasets``: real layouts, duplicates within and
across datasets, rows the normalisers reject), prepares them as the flow does (config order, each
deduplicated against the ones before it) once in one process and once with
:func:`datagen.prompts.prepare.start_dataset_scans`, prints both times, and checks that both wrote the
same files byte for byte (exit 1 if not).

    python benchmarks/bench_prepare.py --prompts 20000
    python benchmarks/bench_prepare.py --full                  # 193,010 prompts

``--mode sequential --out DIR`` prepares one way only into DIR, with only the calls older versions also
have: run it with another checkout on PYTHONPATH to compare its shards with this one's (``diff -r``).
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
if not os.environ.get("PYTHONPATH"):  # PYTHONPATH picks another checkout's datagen (see --mode)
    sys.path.insert(0, str(REPO))

from make_prompt_files import SEED_PROMPTS, write_seed_datasets  # noqa: E402

from datagen.config import RunConfig, parse_run_config  # noqa: E402
from datagen.output.layout import RunLayout  # noqa: E402
from datagen.output.store import Store  # noqa: E402
from datagen.prompts.prepare import load_prompt_ids, prepare_prompts  # noqa: E402
from datagen.records import PreparedDataset  # noqa: E402

NAMES = {
    "infinity_instruct": "infinity-instruct",
    "webinstruct": "webinstruct",
    "codefeedback_filtered": "codefeedback",
    "metamath": "metamath",
    "hermes_fc": "hermes-fc",
    "agentinstruct": "agentinstruct",
}


def seed_config(files: dict[str, Path]) -> RunConfig:
    """The six datasets in config order, every valid prompt taken (as the seed-scale run does)."""
    datasets = [
        {"name": NAMES[layout], "format": layout, "path": str(path)} for layout, path in files.items()
    ]
    return parse_run_config(
        {"run_id": "bench", "model": {"path": "unused"}, "datasets": datasets, "output": "unused"}
    )


def prepare_all(store: Store, config: RunConfig, scans: Any = None) -> list[PreparedDataset]:
    """What the flow does: config order, each dataset deduplicated against the ones before it."""
    layout = RunLayout(config.run_id or "bench")
    prepared: list[PreparedDataset] = []
    taken: set[str] = set()
    for dataset in config.datasets:
        extra = {"scans": scans} if scans is not None else {}
        item = prepare_prompts(
            store, layout, config, dataset.name, exclude_prompt_ids=taken, earlier=prepared, **extra
        )
        prepared.append(item)
        taken |= load_prompt_ids(store, item)
    return prepared


def timed(label: str, out: Path, config: RunConfig, parallel: bool, workers: int | None) -> float:
    store = Store(str(out))
    started = time.monotonic()
    if parallel:
        from datagen.prompts.prepare import start_dataset_scans

        # Workers however small the files (this measures them; a run below MIN_WORKER_BYTES starts none).
        with start_dataset_scans(
            store,
            RunLayout(config.run_id or "bench"),
            config,
            out.parent / "scans",
            max_workers=workers,
            min_worker_bytes=0,
        ) as scans:
            prepared = prepare_all(store, config, scans)
    else:
        prepared = prepare_all(store, config)
    seconds = time.monotonic() - started
    prompts = sum(item.prompts for item in prepared)
    dropped = sum(sum(item.rejections.values()) for item in prepared)
    print(f"  {label}: {seconds:.1f} s, {prompts:,} prompts, {dropped:,} rows dropped", flush=True)
    return seconds


def same_tree(left: Path, right: Path) -> bool:
    """Whether two folders hold the same files with the same bytes."""
    compare = filecmp.dircmp(left, right)
    if compare.left_only or compare.right_only or compare.funny_files:
        return False
    _, mismatch, errors = filecmp.cmpfiles(left, right, compare.common_files, shallow=False)
    if mismatch or errors:
        return False
    return all(same_tree(left / name, right / name) for name in compare.common_dirs)


def main() -> int:
    """Write the datasets, prepare them both ways, compare."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--prompts", type=int, default=20_000)
    size.add_argument("--full", action="store_true", help=f"the seed's {SEED_PROMPTS:,} prompts")
    parser.add_argument("--workers", type=int, help="cap on scan workers (default: one per core)")
    parser.add_argument("--data", type=Path, help="dataset folder (written when missing)")
    parser.add_argument("--mode", choices=["both", "sequential", "parallel"], default="both")
    parser.add_argument("--out", type=Path, help="output folder for one --mode")
    args = parser.parse_args()
    prompts = SEED_PROMPTS if args.full else args.prompts
    work = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    try:
        data = args.data or work / "data"
        if not data.exists() or not any(data.iterdir()):
            write_seed_datasets(prompts, data)
        files = {layout: next(data.glob(f"{layout}.*")) for layout in NAMES}
        config = seed_config(files)
        print(f"prompt preparation of the seed's six datasets, {prompts:,} prompts", flush=True)
        if args.mode != "both":
            out = args.out or work / args.mode
            timed(args.mode, out, config, args.mode == "parallel", args.workers)
            return 0
        sequential = timed("one after another", work / "sequential", config, False, None)
        parallel = timed("in parallel", work / "parallel", config, True, args.workers)
        identical = same_tree(work / "sequential", work / "parallel")
        print(f"  speed-up {sequential / parallel:.2f}x; outputs byte-identical: {identical}")
        return 0 if identical else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
