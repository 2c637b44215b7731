"""``datagen tune`` on a real fleet: start ``transformers serve`` servers as ``datagen run`` plans them, run
the ``datagen tune`` command against them as a user would, stop them.

    python benchmarks/tune_on_fleet.py --model-dir /tmp/dg/model --servers 1 --device cuda \
        --levels 16,32,64,128,256 --max-tokens 64 --out tune.json

The model folder must exist (``benchmarks/fleet_throughput.py --build-model`` builds a random one).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

try:  # run as a script (benchmarks/ on the path) or imported as a module
    from fleet_throughput import transformers_fleet
except ImportError:
    from benchmarks.fleet_throughput import transformers_fleet

from datagen.host.probe import probe_environment

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    """Start the fleet, run `datagen tune` on it, print its output and exit with its code."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--levels", default="16,32,64,128,256")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ready-timeout-s", type=float, default=600)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    levels = [int(level) for level in args.levels.split(",")]
    fleet, plan, state_dir = transformers_fleet(
        args.servers, args.model_dir, args.device, max(levels), probe_environment(), args.ready_timeout_s
    )
    started = time.monotonic()
    try:
        fleet.start()
        print(f"fleet ready in {time.monotonic() - started:.1f} s: {' '.join(fleet.urls)}", flush=True)
        command = [sys.executable, "-m", "flows.cli_entry", "tune", "--model", plan.served_model_name]
        command += ["--engine", "transformers", "--levels", args.levels, "--max-tokens", str(args.max_tokens)]
        command += ["--output", str(args.out)]
        for url in fleet.urls:
            command += ["--url", url]
        code = subprocess.call(command, cwd=REPO)
    finally:
        fleet.stop()
        shutil.rmtree(state_dir, ignore_errors=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
