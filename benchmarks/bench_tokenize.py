"""Merge-and-tokenize throughput: datagen against ``datasets.map(num_proc=N)`` and a ``multiprocessing.Pool``.

Same data (seeded synthetic completions, :mod:`benchmarks.tokenize_data`), same tokenizer (the real Qwen3
vocabulary), same chat template (the vendored Qwen3.6 one by default), same filters and loss-mask rule. Each
contender runs in a fresh process from JSONL shards to Parquet on disk; the parent samples the summed RSS of
its process tree. Afterwards every output is read back and compared: rows, token and loss-token totals and a
digest of every row's ids and mask, in order, must be identical, or the benchmark fails.

Runs are interleaved (datagen, datasets, pool, pool, datasets, datagen, ...) so load on a shared machine
hits every contender alike; medians are reported, with the 1-minute load average at the start and end of every
run (wall times mean little when other work shares the cores; CPU seconds are steadier). Every process
tokenizes on one thread (``TOKENIZERS_PARALLELISM=false``), so each contender uses exactly its N processes.

    python benchmarks/bench_tokenize.py --sizes 20000 80000 --procs 2 --repeats 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RUN_ID = "bench"
RSS_SAMPLE_S = 0.05
BATCH_LINES = 256
CONTENDERS = ("datagen", "datasets", "pool")
DIGEST_COLUMNS = ("input_ids", "loss_mask")
PARQUET_READ_BATCH_ROWS = 1_000


def _shard_files(root: Path) -> list[Path]:
    return sorted((root / "runs" / RUN_ID / "completions").rglob("shard-*.jsonl"))


def run_datagen(root: Path, tokenizer: Path, procs: int, out: Path) -> None:
    from datagen.config import RunConfig
    from datagen.dataset.merge import merge_and_tokenize
    from datagen.output.layout import RunLayout
    from datagen.output.store import Store

    config = RunConfig.model_validate(
        {
            "run_id": RUN_ID,
            "model": {"path": str(tokenizer)},
            "datasets": [{"name": "mixed", "format": "openai_messages", "path": "unused"}],
            "output": str(root),
            "tokenize": {"workers": procs},
        }
    )
    summary = merge_and_tokenize(Store(str(root)), RunLayout(RUN_ID), config)
    out.write_text(json.dumps([str(root / part.key) for part in summary.parts if part.key]))


def run_datasets(root: Path, tokenizer: Path, procs: int, out: Path) -> None:
    import datasets

    from benchmarks.tokenize_baseline import tokenize_lines

    cache = out.parent / "hf-cache"
    lines = datasets.load_dataset(
        "text", data_files=[str(path) for path in _shard_files(root)], split="train", cache_dir=str(cache)
    )
    rows = lines.map(
        lambda batch: tokenize_lines(str(tokenizer), batch["text"]),
        batched=True,
        batch_size=BATCH_LINES,
        num_proc=procs,
        remove_columns=["text"],
    )
    target = out.parent / "datasets.parquet"
    rows.to_parquet(str(target))
    out.write_text(json.dumps([str(target)]))


def _pool_batch(args: tuple[str, list[str]]) -> dict[str, list[Any]]:
    from benchmarks.tokenize_baseline import tokenize_lines

    return tokenize_lines(*args)


def _line_batches(root: Path, tokenizer: Path) -> Any:
    batch: list[str] = []
    for path in _shard_files(root):
        with path.open() as handle:
            for line in handle:
                batch.append(line)
                if len(batch) == BATCH_LINES:
                    yield (str(tokenizer), batch)
                    batch = []
    if batch:
        yield (str(tokenizer), batch)


def run_pool(root: Path, tokenizer: Path, procs: int, out: Path) -> None:
    import multiprocessing

    import pyarrow as pa
    import pyarrow.parquet as pq

    target = out.parent / "pool.parquet"
    schema = pa.schema(
        [
            pa.field("input_ids", pa.list_(pa.int32())),
            pa.field("loss_mask", pa.list_(pa.int8())),
            pa.field("prompt_id", pa.string()),
            pa.field("sample_index", pa.int32()),
            pa.field("dataset", pa.string()),
            pa.field("num_tokens", pa.int32()),
            pa.field("num_loss_tokens", pa.int32()),
            pa.field("finish_reason", pa.string()),
        ]
    )
    with (
        multiprocessing.get_context("spawn").Pool(procs) as pool,
        pq.ParquetWriter(str(target), schema, compression="zstd") as writer,
    ):
        for columns in pool.imap(_pool_batch, _line_batches(root, tokenizer), chunksize=1):
            if columns["input_ids"]:
                writer.write_table(pa.Table.from_pydict(columns, schema=schema))
    out.write_text(json.dumps([str(target)]))


RUNNERS = {"datagen": run_datagen, "datasets": run_datasets, "pool": run_pool}


def digest(files: list[str]) -> dict[str, Any]:
    """Rows, token totals and a digest of every row's ids and mask, in order."""
    import pyarrow.parquet as pq

    hasher = hashlib.sha256()
    rows = tokens = loss_tokens = 0
    for path in files:
        parquet = pq.ParquetFile(path)
        for batch in parquet.iter_batches(batch_size=PARQUET_READ_BATCH_ROWS, columns=list(DIGEST_COLUMNS)):
            ids = batch.column("input_ids")
            mask = batch.column("loss_mask")
            rows += batch.num_rows
            # Row lengths and flattened values: independent of how the rows are split into files and batches.
            hasher.update(ids.value_lengths().cast("int64").to_numpy().tobytes())
            hasher.update(ids.flatten().cast("int32").to_numpy().tobytes())
            mask_values = mask.flatten().cast("int8").to_numpy()
            hasher.update(mask_values.tobytes())
            tokens += len(mask_values)
            loss_tokens += int(mask_values.sum())
    return {"rows": rows, "tokens": tokens, "loss_tokens": loss_tokens, "sha256": hasher.hexdigest()}


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        parent = psutil.Process(pid)
        processes = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def measure(name: str, root: Path, tokenizer: Path, procs: int) -> dict[str, Any]:
    """Run one contender in a fresh process; its wall time, peak tree RSS and output digest."""
    work = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    data = work / "data"
    shutil.copytree(root, data)  # datagen writes its parts into the run; every contender starts clean
    out = work / "outputs.json"
    command = [sys.executable, __file__, "--run-one", name, str(data), str(tokenizer), str(procs), str(out)]
    env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(work / "hf-home"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    peak = 0
    load_before = os.getloadavg()[0]
    process = subprocess.Popen(command, env=env)
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _tree_rss(process.pid))
            time.sleep(RSS_SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    start = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    sampler.start()
    code = process.wait()
    wall_s = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # Every process of the tree was reaped by its parent, so its CPU time is in ours: load-independent work.
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    stop.set()
    sampler.join()
    if code != 0:
        raise SystemExit(f"{name} failed with exit code {code}")
    result = {
        "name": name,
        "load": (load_before, os.getloadavg()[0]),
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "peak_rss_mib": peak / 2**20,
        **digest(json.loads(out.read_text())),
    }
    shutil.rmtree(work)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[20_000, 80_000])
    parser.add_argument("--procs", type=int, default=2, help="Processes for every contender.")
    parser.add_argument("--repeats", type=int, default=2, help="Runs per contender and size (interleaved).")
    parser.add_argument("--template", default="qwen3.6", choices=["qwen3", "qwen3.6"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vocabulary",
        default="small",
        choices=["small", "wide"],
        help="Prose vocabulary (benchmarks/tokenize_data.py): small (~250 words) or wide (30,000 pseudo-words, "
        "Zipf-distributed, 0.5%% of words non-ASCII).",
    )
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    parser.add_argument("--run-one", nargs=5, metavar=("NAME", "ROOT", "TOKENIZER", "PROCS", "OUT"))
    args = parser.parse_args()
    if args.run_one:
        name, root, tokenizer, procs, out = args.run_one
        RUNNERS[name](Path(root), Path(tokenizer), int(procs), Path(out))
        return

    from benchmarks.tokenize_data import write_run
    from tests.support.qwen import build_qwen_tokenizer_dir

    base = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    tokenizer = build_qwen_tokenizer_dir(base / "tokenizer", args.template)
    print(
        f"machine: {os.cpu_count()} cores, load {os.getloadavg()}; procs={args.procs}; template={args.template}; "
        f"vocabulary={args.vocabulary}"
    )
    report: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for size in args.sizes:
        root = base / f"data-{size}"
        write_run(root, RUN_ID, size, args.seed, args.vocabulary)
        order = list(args.contenders)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in order}
        for repeat in range(args.repeats):
            for name in order if repeat % 2 == 0 else reversed(order):
                result = measure(name, root, tokenizer, args.procs)
                runs[name].append(result)
                print(
                    f"  {size:>6} {name:<8} {result['wall_s']:7.1f} s  cpu {result['cpu_s']:7.1f} s  "
                    f"{result['peak_rss_mib']:7.0f} MiB  load {result['load'][0]:.2f}->{result['load'][1]:.2f}  "
                    f"rows={result['rows']} tokens={result['tokens']} loss={result['loss_tokens']}",
                    flush=True,
                )
        report[size] = runs
        shutil.rmtree(root)
    _print_report(report, args.procs)
    shutil.rmtree(base)


def _print_report(report: dict[int, dict[str, list[dict[str, Any]]]], procs: int) -> None:
    failures: list[str] = []
    loads = [
        load for runs in report.values() for results in runs.values() for r in results for load in r["load"]
    ]
    print(
        f"\nmedians (procs={procs}; 1-minute load average at the start and end of the runs: "
        f"{min(loads):.2f} to {max(loads):.2f}; the machine has {os.cpu_count()} cores)"
    )
    print(
        f"{'completions':>11} {'contender':<9} {'wall s':>7} {'cpu s':>7} {'rows/s':>8} {'tokens/s':>10} "
        f"{'peak RSS':>9}"
    )
    for size, runs in report.items():
        first = next(iter(runs.values()))[0]
        for name, results in runs.items():
            wall = statistics.median(result["wall_s"] for result in results)
            cpu = statistics.median(result["cpu_s"] for result in results)
            rss = statistics.median(result["peak_rss_mib"] for result in results)
            print(
                f"{size:>11} {name:<9} {wall:7.1f} {cpu:7.1f} {first['rows'] / wall:8.0f} "
                f"{first['tokens'] / wall:10.0f} {rss:7.0f} MiB"
            )
            for result in results:
                same = {key: result[key] for key in ("rows", "tokens", "loss_tokens", "sha256")}
                expected = {key: first[key] for key in same}
                if same != expected:
                    failures.append(f"{size} {name}: output differs: {same} != {expected}")
        if "datagen" in runs:
            datagen_wall = statistics.median(result["wall_s"] for result in runs["datagen"])
            datagen_cpu = statistics.median(result["cpu_s"] for result in runs["datagen"])
            for name in runs:
                if name != "datagen":
                    other = statistics.median(result["wall_s"] for result in runs[name])
                    other_cpu = statistics.median(result["cpu_s"] for result in runs[name])
                    print(
                        f"{size:>11} datagen speedup over {name}: {other / datagen_wall:.2f}x wall, "
                        f"{other_cpu / datagen_cpu:.2f}x less CPU"
                    )
    if "datagen" in next(iter(report.values())) and len(report) > 1:
        peaks = [
            statistics.median(result["peak_rss_mib"] for result in runs["datagen"])
            for runs in report.values()
        ]
        print(f"datagen peak RSS, largest / smallest size: {max(peaks) / min(peaks):.3f}")
    if failures:
        raise SystemExit("outputs disagree:\n" + "\n".join(failures))
    print("outputs agree: same rows, tokens, loss tokens and per-row ids and masks for every contender")


if __name__ == "__main__":
    main()
