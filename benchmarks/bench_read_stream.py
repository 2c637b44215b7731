"""Benchmark: streaming rows out of large JSONL and JSON-array files keeps memory flat.

Generates MetaMathQA-shaped files of each requested size, then reads every file in a fresh child
process (so peak RSS belongs to that read alone) through ``iter_rows`` + ``normalise_row`` and reports
rows/s and peak RSS. Memory must not grow with the row count: 1M rows should peak within a few MiB of
100k rows.

    .venv/bin/python benchmarks/bench_read_stream.py                 # 100k and 1M rows
    .venv/bin/python benchmarks/bench_read_stream.py --rows 20000 --no-normalise
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_ROWS = (100_000, 1_000_000)
KIB_PER_MIB = 1024


def make_row(i: int) -> dict[str, str]:
    question = (
        f"Natalia sold clips to {i % 97 + 2} of her friends in April, and then half as many in May. How many?"
    )
    return {
        "query": question,
        "response": f"She sold {i % 97 + 2} + {(i % 97 + 2) / 2} clips.\nThe answer is: {(i % 97 + 2) * 1.5}",
        "type": "GSM_AnsAug",
        "original_question": question,
    }


def write_files(directory: Path, rows: int) -> dict[str, Path]:
    jsonl = directory / f"rows-{rows}.jsonl"
    array = directory / f"rows-{rows}.json"
    with open(jsonl, "w") as lines, open(array, "w") as whole:
        whole.write("[\n")
        for i in range(rows):
            text = json.dumps(make_row(i))
            lines.write(text + "\n")
            whole.write(("," if i else "") + text + "\n")
        whole.write("]\n")
    return {"jsonl": jsonl, "json-array": array}


def read_in_child(path: Path, normalise: bool) -> dict[str, float]:
    """Read ``path`` in a fresh interpreter; return its row count, seconds and peak RSS."""
    code = (
        "import json, resource, sys, time\n"
        "from datagen.prompts.datasets import iter_rows, normalise_row\n"
        "start = time.perf_counter(); rows = 0; prompts = 0\n"
        "for row in iter_rows(sys.argv[1]):\n"
        "    rows += 1\n"
        "    if sys.argv[2] == '1':\n"
        "        result = normalise_row('metamath', row.data, row.index)\n"
        "        prompts += isinstance(result, list)\n"
        "elapsed = time.perf_counter() - start\n"
        "peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "result = {'rows': rows, 'prompts': prompts, 'seconds': elapsed, 'peak_kib': peak_kib}\n"
        "sys.stdout.write(json.dumps(result))\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", code, str(path), "1" if normalise else "0"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result: dict[str, float] = json.loads(output)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS))
    parser.add_argument("--no-normalise", action="store_true", help="Only read rows, do not normalise them.")
    args = parser.parse_args()
    sys.stdout.write(f"{'file type':<12}{'rows':>10}{'rows/s':>12}{'peak RSS MiB':>14}{'file MiB':>10}\n")
    with tempfile.TemporaryDirectory() as directory:
        for rows in args.rows:
            files = write_files(Path(directory), rows)
            for kind, path in files.items():
                result = read_in_child(path, normalise=not args.no_normalise)
                assert result["rows"] == rows, result
                size_mib = path.stat().st_size / (KIB_PER_MIB * KIB_PER_MIB)
                sys.stdout.write(
                    f"{kind:<12}{rows:>10}{rows / result['seconds']:>12,.0f}"
                    f"{result['peak_kib'] / KIB_PER_MIB:>14.1f}{size_mib:>10.1f}\n"
                )
                path.unlink()


if __name__ == "__main__":
    main()
