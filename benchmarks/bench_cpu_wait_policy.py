"""CPU servers with OpenMP's default wait policy against ``OMP_WAIT_POLICY=PASSIVE`` (what datagen sets).

One ``transformers serve --continuous-batching`` process on the tiny model (built here, as the tests build it),
with ``--threads`` intra-op threads (default: every core, what the plan gives one CPU server), answers the same
chat requests (``--requests`` at ``--concurrency`` at once, ``--max-tokens`` each) under each policy. Runs
alternate (default, passive, passive, default, ...) so load on a shared machine hits both alike; each run is a
fresh server. Reported per policy, as medians: the server's CPU seconds to start, its CPU seconds and the
wall time for the requests, the tokens generated, and CPU per 1,000 tokens; then the ratios passive/default.

    python benchmarks/bench_cpu_wait_policy.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from datagen.app.tinymodel import build_tiny_model  # noqa: E402
from tests.support.prefect_stack import free_port  # noqa: E402

POLICIES = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
READY_TIMEOUT_S = 300.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _one_run(model: Path, policy: str, args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    threads = str(args.threads)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "1",
        **POLICIES[policy],
    }
    if policy == "default":
        env.pop("OMP_WAIT_POLICY", None)  # OpenMP's own default, whatever this shell has set
    argv = [
        sys.executable, "-m", "transformers.cli.transformers", "serve", "--continuous-batching",
        "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), str(model), "--cb-num-blocks", "256",
    ]  # fmt: skip
    server = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start (exit {server.returncode})")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == httpx.codes.OK:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        start_cpu = _cpu_s(server.pid)

        def ask(index: int) -> int:
            body = {
                "model": str(model),
                "messages": [{"role": "user", "content": f"Question {index}: why?"}],
                "max_tokens": args.max_tokens,
                "temperature": 0.8,
            }
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=300)
            answer.raise_for_status()
            return int(answer.json()["usage"]["completion_tokens"])

        started = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            tokens = sum(pool.map(ask, range(args.requests)))
        wall_s = time.monotonic() - started
        cpu_s = _cpu_s(server.pid) - start_cpu
    finally:
        server.terminate()
        server.wait(30)
    return {"start_cpu_s": start_cpu, "cpu_s": cpu_s, "wall_s": wall_s, "tokens": tokens}


def main() -> None:
    """Run the alternating comparison and print the medians and ratios."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per policy")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="intra-op threads per server"
    )
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in POLICIES}
    with tempfile.TemporaryDirectory(prefix="bench-wait-policy-") as folder:
        model = build_tiny_model(Path(folder) / "tiny-model")
        names = list(POLICIES)
        order = [
            name for repeat in range(args.repeats) for name in (names if repeat % 2 == 0 else names[::-1])
        ]
        for name in order:
            run = _one_run(model, name, args)
            results[name].append(run)
            load = os.getloadavg()[0]
            print(
                f"{name:8s} start {run['start_cpu_s']:5.1f} CPU-s  requests {run['cpu_s']:5.1f} CPU-s "
                f"{run['wall_s']:5.1f} s  {run['tokens']:5.0f} tokens  load {load:.1f}",
                flush=True,
            )
    medians = {
        name: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        for name, runs in results.items()
    }
    print(
        f"\n{args.threads} thread(s), {args.requests} requests x {args.max_tokens} tokens at {args.concurrency}"
    )
    for name, median in medians.items():
        per_k = 1000 * median["cpu_s"] / max(median["tokens"], 1)
        print(
            f"{name:8s} median: start {median['start_cpu_s']:.1f} CPU-s, requests {median['cpu_s']:.1f} CPU-s "
            f"in {median['wall_s']:.1f} s, {per_k:.2f} CPU-s per 1,000 tokens"
        )
    default, passive = medians["default"], medians["passive"]
    print(
        f"passive/default: request CPU {passive['cpu_s'] / default['cpu_s']:.2f}, wall "
        f"{passive['wall_s'] / default['wall_s']:.2f}, start CPU {passive['start_cpu_s'] / default['start_cpu_s']:.2f}"
    )


if __name__ == "__main__":
    main()
