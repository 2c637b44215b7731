"""The cost preview against the measurement: two runs of one config; the second run's estimate vs its cost.

Two real `datagen run` processes (the CLI's own Prefect API server) of the same config, one after the other,
with one box history (a fresh ``DATAGEN_STATE_DIR``). The first run's preview has no history (defaults, the
planner's rate); the second's is priced from what the first measured. Prints each run's accounting
(``report.json``): the estimated and the measured time training was paused, and their ratio.

Servers, ``--server``:

- ``instant``: an OpenAI-compatible test server answering at once (tests/support/fault_server.py);
- ``simulated``: continuous-batching servers with realistic answer lengths (benchmarks/simulator.py: slots,
  a decode step per token, lognormal answer lengths cut by ``max_tokens``), so a run takes about a minute.
- ``demo``: `datagen demo` twice (its config, its stand-in trainer halted and restarted, two `transformers
  serve` CPU servers started and stopped); ``MODEL_DIR`` and ``PROMPTS`` are not used, the runs land under
  the checkout's ``runs/`` as the demo's do.

    python benchmarks/bench_preview.py WORK_DIR MODEL_DIR PROMPTS     # MODEL_DIR: `datagen tiny-model` output
    python benchmarks/bench_preview.py WORK_DIR MODEL_DIR 600 --server simulated
    python benchmarks/bench_preview.py WORK_DIR - 0 --server demo
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.fault_server import FaultServer  # noqa: E402
from tests.support.run_configs import external_run_config, write_prompts  # noqa: E402

SHARD_SIZE = 64
IN_FLIGHT = 8
SIMULATOR = REPO / "benchmarks" / "simulator.py"
# The simulated fleet: two servers of 16 slots, a 10 ms decode step (100 tokens/s per request, 3,200 tokens/s
# in all), answers of 300 tokens on average with a long tail (lognormal, sigma 1) cut at 2,048.
SIM_BASE_PORT = 31700
SIM_SERVERS = 2
SIM_SLOTS = 16
SIM_STEP_MS = 10.0
SIM_MEAN_TOKENS = 300
SIM_MAX_TOKENS = 2048
SIM_MODEL = "sim"
READY_TIMEOUT_S = 30.0


@contextlib.contextmanager
def simulated_fleet() -> Iterator[list[str]]:
    """The simulated servers, started and stopped; yields their URLs."""
    ports = f"{SIM_BASE_PORT}-{SIM_BASE_PORT + SIM_SERVERS - 1}"
    process = subprocess.Popen(
        [
            sys.executable,
            str(SIMULATOR),
            "--ports",
            ports,
            "--slots",
            str(SIM_SLOTS),
            "--step-base-ms",
            str(SIM_STEP_MS),
            "--mean-tokens",
            str(SIM_MEAN_TOKENS),
            "--model",
            SIM_MODEL,
        ]
    )
    urls = [f"http://127.0.0.1:{SIM_BASE_PORT + index}" for index in range(SIM_SERVERS)]
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for url in urls:
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=1):
                        break
                except OSError:
                    if time.monotonic() > deadline or process.poll() is not None:
                        raise RuntimeError(f"simulated server {url} never became healthy") from None
                    time.sleep(0.1)
        yield urls
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(10)


@contextlib.contextmanager
def instant_server() -> Iterator[list[str]]:
    """The test server answering at once; yields its URL."""
    with FaultServer() as server:
        yield [server.url]


def write_config(work: Path, model_dir: Path, prompts: int, urls: list[str], simulated: bool) -> Path:
    """The run's config: one dataset, the servers as an external fleet, no training job."""
    path = external_run_config(
        work / "run.yaml",
        server_url=urls[0],
        model_dir=model_dir,
        prompts=write_prompts(work / "prompts.jsonl", prompts, "Rerun question"),
        dataset="rerun",
        shard_size=SHARD_SIZE,
        in_flight=SIM_SLOTS if simulated else IN_FLIGHT,
        output=str(work / "out"),
        protected=str(work / "train"),
        generation={"checkpoint_interval_s": 0.2, "backoff_initial_s": 0.05},
    )
    if simulated:
        data = yaml.safe_load(path.read_text())
        data["fleet"]["external_urls"] = urls
        data["model"]["served_name"] = SIM_MODEL
        data["sampling"]["max_tokens"] = SIM_MAX_TOKENS
        path.write_text(yaml.safe_dump(data))
    return path


def main() -> None:
    """Run the config twice and print each run's estimated and measured paused time."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("work", type=Path)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("prompts", type=int)
    parser.add_argument("--server", choices=["instant", "simulated", "demo"], default="instant")
    args = parser.parse_args()
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DATAGEN_STATE_DIR": str(work / "state"), "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    if args.server == "demo":
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for run_id in (f"preview-{stamp}-1", f"preview-{stamp}-2"):
            command = [sys.executable, "-m", "flows.cli_entry", "demo", "--run-id", run_id]
            run_and_print(command, env, REPO / "runs" / run_id, args.server)
        return
    simulated = args.server == "simulated"
    with simulated_fleet() if simulated else instant_server() as urls:
        config = write_config(work, args.model_dir, args.prompts, urls, simulated)
        for run_id in ("rerun-1", "rerun-2"):
            command = [
                sys.executable,
                "-m",
                "flows.cli_entry",
                "run",
                "--config",
                str(config),
                "--run-id",
                run_id,
            ]
            run_and_print(command, env, work / "out" / "runs" / run_id, args.server)


def run_and_print(command: list[str], env: dict[str, str], run_root: Path, server: str) -> None:
    """Run one `datagen` command to its end and print its run's estimated and measured paused time."""
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO, check=False)
    if result.returncode:
        raise SystemExit(result.stdout[-2000:] + result.stderr[-2000:])
    report = json.loads((run_root / "report.json").read_text())
    accounting = report["accounting"]
    estimated, measured = accounting["estimated_training_paused_s"], accounting["training_paused_s"]
    print(
        json.dumps(
            {
                "server": server,
                "run": run_root.name,
                "completions": report["totals"]["completions"],
                "output_tokens": report["totals"]["completion_tokens"],
                "generation_wall_s": round(report["generation_wall_s"], 2),
                "estimated_paused_s": round(estimated, 2),
                "measured_paused_s": round(measured, 2),
                "estimate_over_measured": round(estimated / measured, 3),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
