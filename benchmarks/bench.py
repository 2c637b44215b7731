"""`make bench`: datagen's whole `datagen run` flow against an ideal and a SpecForge-style client.

For each scenario, on the same prompts and on freshly started simulated servers for every run
(benchmarks/simulator.py, one process hosting every port), the runs alternate datagen, ideal,
specforge, specforge, ideal, datagen (ABBA), so a machine that gets busier or quieter over time favours
no client. Every figure comes from the servers' side, identically for every client:

* generation phase: from the first request reaching any server to the last answer leaving one;
* output tok/s: tokens generated in that phase / its length (real seconds);
* slot utilisation: slot-seconds spent decoding / (the fleet's slots x the phase's length);
* requests/s: requests answered / the phase's length, and the client process's CPU% over the phase
  (for datagen: the flow process, where the dispatcher runs; Prefect's server is a separate process).

datagen runs as a user runs it: ``python -m flows.cli_entry run --config bench.yaml`` (the `datagen` console script) with
``fleet.engine: external`` pointed at the simulator's URLs; its exit code must be 0.

Scenarios (simulated time runs faster than a GPU so a run takes seconds; the ratios are what count):

* ``seed``: 8 servers x 72 slots, lognormal answers with mean 300 tokens, 4,000 prompts;
* ``high-rate``: 8 servers x 128 slots, mean 40 tokens, 8,000 prompts: over a thousand requests/s;
* ``saturate``: 8 servers x 128 slots, 4-token answers and 1 ms steps: the servers answer as fast as a
  client can ask, so the flow process's dispatch rate and CPU are the figure (>= 2,000 requests/s).

    python benchmarks/bench.py              # every scenario, ABBA (about 10 minutes)
    python benchmarks/bench.py --quick      # fewer prompts, one run per client
    python benchmarks/bench.py --scenarios seed --rounds 2 --out results.json
    python benchmarks/bench.py --scenarios saturate --shard-sizes 256,2048   # datagen@256, datagen@2048, ideal

``--shard-sizes`` runs datagen once per size (``datasets[].shard_size``; each a client of its own, named
``datagen@<size>``, in the same ABBA order): each shard is one Prefect task run, so where answers take
milliseconds the shard size sets how much of the flow process goes to Prefect's per-task work.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
BASE_PORT = 31700
PREFECT_PORT = 31690
PREFECT_READY_TIMEOUT_S = 180.0
CPU_SAMPLE_S = 0.25
WORDS = [f"tok{i}" for i in range(5000)]


@dataclass(frozen=True)
class Scenario:
    """One benchmark scenario: the fleet, the answer lengths, the prompts."""

    name: str
    servers: int
    slots: int
    mean_tokens: float
    sigma: float
    step_base_ms: float
    step_per_request_ms: float
    prompts: int
    max_tokens: int
    # Requests in flight per server beyond its slots, for datagen and the ideal client alike: one
    # round-trip's worth of queued work so a freed slot never waits for the network.
    margin: int
    clients: tuple[str, ...] = ("datagen", "ideal", "specforge")


SCENARIOS = {
    "seed": Scenario("seed", 8, 72, 300, 0.8, 5.0, 0.0, 4000, 2048, 8),
    "high-rate": Scenario("high-rate", 8, 128, 40, 0.6, 25.0, 0.0, 8000, 2048, 16),
    "saturate": Scenario("saturate", 8, 128, 4, 0.3, 1.0, 0.0, 20000, 64, 16, ("datagen", "ideal")),
}
QUICK_PROMPTS = {"seed": 1500, "high-rate": 3000, "saturate": 8000}


def write_prompts(path: Path, count: int, seed: int) -> None:
    """Distinct prompts of 20-200 words, in the openai_messages layout (one JSON object per line)."""
    import random

    rng = random.Random(seed)
    with path.open("w") as handle:
        for index in range(count):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200)))
            row = {"messages": [{"role": "user", "content": f"prompt {index}: {words}"}]}
            handle.write(json.dumps(row) + "\n")


def build_tokenizer(directory: Path) -> Path:
    """The tiny model's tokenizer and chat template: what merge-and-tokenize renders with."""
    if not (directory / "tokenizer_config.json").exists():
        from datagen.app.tinymodel import build_tiny_model

        build_tiny_model(directory)
    return directory


class Simulator:
    """One simulator process hosting every server of a scenario; fresh for every run."""

    def __init__(self, scenario: Scenario, log: Path) -> None:
        self.scenario = scenario
        self.ports = list(range(BASE_PORT, BASE_PORT + scenario.servers))
        self.urls = [f"http://127.0.0.1:{port}" for port in self.ports]
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Simulator:
        s = self.scenario
        command = [
            PYTHON,
            str(REPO / "benchmarks" / "simulator.py"),
            f"--ports={self.ports[0]}-{self.ports[-1]}",
            f"--slots={s.slots}",
            f"--mean-tokens={s.mean_tokens}",
            f"--sigma={s.sigma}",
            f"--step-base-ms={s.step_base_ms}",
            f"--step-per-request-ms={s.step_per_request_ms}",
        ]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if b"ready" not in line:
            raise RuntimeError(f"simulator did not start; see {self.log}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)

    def stats(self) -> list[dict[str, Any]]:
        """Every server's counters."""
        stats = []
        for url in self.urls:
            with urllib.request.urlopen(url + "/bench/stats", timeout=10) as response:
                stats.append(json.loads(response.read()))
        return stats


class PrefectServer:
    """One Prefect API server for every datagen run of the benchmark (an ephemeral one per run would add
    its start-up to every run and, on a loaded machine, time out)."""

    def __init__(self, home: Path, port: int = PREFECT_PORT) -> None:
        self.home = home
        self.port = port
        self.api_url = f"http://127.0.0.1:{port}/api"
        self.process: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        return {
            "PREFECT_HOME": str(self.home),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
        }

    def __enter__(self) -> PrefectServer:
        self.home.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env()}
        env.pop("PREFECT_API_URL")
        command = [
            PYTHON,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        with (self.home / "server.log").open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=log, env=env, start_new_session=True)
        deadline = time.monotonic() + PREFECT_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prefect server exited; see {self.home / 'server.log'}")
            try:
                with urllib.request.urlopen(self.api_url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"prefect server not ready in {PREFECT_READY_TIMEOUT_S:.0f}s")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)


class CpuSampler:
    """Samples a process's CPU time with timestamps, to integrate it over the generation phase later."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                times = self.process.cpu_times()
            except psutil.Error:
                return
            self.samples.append((time.monotonic(), times.user + times.system))
            self._stop.wait(CPU_SAMPLE_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def percent(self, start: float, end: float) -> float | None:
        inside = [sample for sample in self.samples if start <= sample[0] <= end]
        if len(inside) < 2:
            return None
        (t0, c0), (t1, c1) = inside[0], inside[-1]
        return 100.0 * (c1 - c0) / (t1 - t0) if t1 > t0 else None


def datagen_config(
    scenario: Scenario, urls: list[str], prompts: Path, tokenizer: Path, output: Path, shard_size: int | None
) -> str:
    dataset: dict[str, Any] = {"name": "bench", "format": "openai_messages", "path": str(prompts)}
    if shard_size is not None:
        dataset["shard_size"] = shard_size
    config = {
        "run_id": "bench",
        "model": {"path": str(tokenizer), "served_name": "sim"},
        "fleet": {
            "engine": "external",
            "external_urls": urls,
            "max_inflight_per_server": scenario.slots + scenario.margin,
        },
        "sampling": {"temperature": 0.7, "top_p": 0.95, "max_tokens": scenario.max_tokens},
        "datasets": [dataset],
        "output": str(output),
        "generation": {"request_timeout_s": 600},
    }
    path = output.parent / "bench.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return str(path)


def run_client(
    client: str,
    scenario: Scenario,
    prompts: Path,
    tokenizer: Path,
    work: Path,
    index: int,
    prefect_env: dict[str, str],
) -> dict[str, Any]:
    """One run on fresh servers: the client's exit code, and the figures the servers saw."""
    run_dir = work / f"{scenario.name}-{index:02d}-{client.replace('@', '-')}"
    run_dir.mkdir(parents=True)
    with Simulator(scenario, run_dir / "simulator.log") as simulator:
        if is_datagen(client):
            shard_size = int(client.partition("@")[2]) if "@" in client else None
            config = datagen_config(scenario, simulator.urls, prompts, tokenizer, run_dir / "out", shard_size)
            command = [PYTHON, "-m", "flows.cli_entry", "run", "--config", config]
            if os.environ.get("BENCH_PROFILE"):
                # py-spy (pip install py-spy) samples the flow process: folded stacks, one per line.
                profile = run_dir / "profile.txt"
                command = [
                    "py-spy",
                    "record",
                    "--format",
                    "raw",
                    "--rate",
                    "200",
                    "-o",
                    str(profile),
                    "--",
                    *command,
                ]
        else:
            command = [
                PYTHON,
                str(REPO / "benchmarks" / "clients.py"),
                client,
                "--urls",
                ",".join(simulator.urls),
                "--prompts",
                str(prompts),
                f"--slots={scenario.slots}",
                f"--margin={scenario.margin}",
                f"--max-tokens={scenario.max_tokens}",
            ]
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        env.update(prefect_env)
        env["DATAGEN_STATE_DIR"] = str(run_dir / "state")
        with (run_dir / "client.log").open("wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
            sampler = CpuSampler(process.pid)
            code = process.wait()
            sampler.stop()
        servers = simulator.stats()
    starts = [s["first_arrival"] for s in servers if s["first_arrival"] is not None]
    ends = [s["last_finish"] for s in servers if s["last_finish"] is not None]
    result: dict[str, Any] = {"client": client, "exit_code": code, "log": str(run_dir / "client.log")}
    if not starts or not ends:
        return {**result, "tok_per_s": 0.0, "utilisation": 0.0, "requests_per_s": 0.0, "cpu_percent": None}
    start, end = min(starts), max(ends)
    phase_s = max(end - start, 1e-9)
    tokens = sum(s["output_tokens"] for s in servers)
    requests = sum(s["finished"] for s in servers)
    busy = sum(s["slot_seconds_busy"] for s in servers)
    slots = sum(s["slots"] for s in servers)
    return {
        **result,
        "generation_s": round(phase_s, 2),
        "requests": requests,
        "output_tokens": tokens,
        "tok_per_s": round(tokens / phase_s, 1),
        "utilisation": round(busy / (slots * phase_s), 3),
        "requests_per_s": round(requests / phase_s, 1),
        "cpu_percent": sampler.percent(start, end),
        "max_server_queue": max(s["max_waiting"] for s in servers),
        "connections": sum(s["connections"] for s in servers),
    }


def is_datagen(client: str) -> bool:
    """``datagen``, or one of its ``--shard-sizes`` variants (``datagen@<size>``)."""
    return client == "datagen" or client.startswith("datagen@")


def order(clients: tuple[str, ...], rounds: int) -> list[str]:
    """ABBA generalised: the clients in order, then reversed, ``rounds`` times in all."""
    sequence: list[str] = []
    for round_index in range(rounds):
        sequence += list(clients) if round_index % 2 == 0 else list(reversed(clients))
    return sequence


def run_scenario(
    scenario: Scenario, rounds: int, tokenizer: Path, work: Path, prefect_env: dict[str, str]
) -> dict[str, Any]:
    prompts = work / f"{scenario.name}-prompts.jsonl"
    write_prompts(prompts, scenario.prompts, seed=len(scenario.name))
    runs = []
    for index, client in enumerate(order(scenario.clients, rounds)):
        result = run_client(client, scenario, prompts, tokenizer, work, index, prefect_env)
        cpu = result.get("cpu_percent")
        print(
            f"  {scenario.name:9s} {client:12s} exit={result['exit_code']} gen_s={result.get('generation_s', 0):6.1f} "
            f"tok/s={result['tok_per_s']:9.0f} util={result['utilisation']:.2f} req/s={result['requests_per_s']:7.0f} "
            f"cpu%={'-' if cpu is None else f'{cpu:.0f}'} connections={result.get('connections', 0)}",
            flush=True,
        )
        runs.append(result)
    medians = {
        client: {
            key: statistics.median(run[key] for run in runs if run["client"] == client)
            for key in ("tok_per_s", "utilisation", "requests_per_s")
        }
        for client in scenario.clients
    }
    ideal = medians["ideal"]["tok_per_s"] or 1e-9
    summary = {
        "scenario": asdict(scenario),
        "runs": runs,
        "medians": medians,
        "ratios_vs_ideal": {client: round(m["tok_per_s"] / ideal, 3) for client, m in medians.items()},
        "datagen_exit_codes": [run["exit_code"] for run in runs if is_datagen(run["client"])],
        "datagen_cpu_percent": [run["cpu_percent"] for run in runs if is_datagen(run["client"])],
    }
    return summary


def print_summary(summaries: list[dict[str, Any]]) -> None:
    print("\nscenario   client     tok/s(median)  util   req/s   ratio-vs-ideal")
    for summary in summaries:
        name = summary["scenario"]["name"]
        for client, medians in summary["medians"].items():
            print(
                f"{name:10s} {client:12s} {medians['tok_per_s']:13.0f}  {medians['utilisation']:.2f} "
                f"{medians['requests_per_s']:7.0f}   {summary['ratios_vs_ideal'][client]:.3f}"
            )
        cpus = [f"{cpu:.0f}%" for cpu in summary["datagen_cpu_percent"] if cpu is not None]
        print(
            f"{name:10s} datagen exit codes {summary['datagen_exit_codes']}, flow-process CPU {', '.join(cpus)} "
            "(100% = one core)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenarios", default="seed,high-rate,saturate")
    parser.add_argument("--rounds", type=int, default=2, help="Passes over the clients (2 = ABBA).")
    parser.add_argument("--quick", action="store_true", help="Fewer prompts, one round.")
    parser.add_argument(
        "--clients", default=None, help="Only these clients (comma-separated; ideal is always run)."
    )
    parser.add_argument(
        "--shard-sizes",
        default=None,
        help="Run datagen once per shard size (comma-separated), each a client named datagen@<size>.",
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="Keep logs and outputs here (default: a temporary folder, removed once the benchmark succeeded).",
    )
    parser.add_argument("--out", type=Path, default=None, help="Write every figure as JSON here.")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="datagen-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rounds = 1 if args.quick else args.rounds
    tokenizer = build_tokenizer(work / "tokenizer")
    summaries = []
    kept = "" if args.work else " (removed at the end unless something fails; --work DIR keeps it)"
    print(f"datagen bench: work dir {work}{kept}", flush=True)
    with PrefectServer(work / "prefect-home") as prefect_server:
        for name in args.scenarios.split(","):
            scenario = SCENARIOS[name]
            if args.quick:
                scenario = Scenario(**{**asdict(scenario), "prompts": QUICK_PROMPTS[name]})
            if args.clients:
                wanted = {*args.clients.split(","), "ideal"}
                clients = tuple(c for c in scenario.clients if c in wanted)
                scenario = Scenario(**{**asdict(scenario), "clients": clients})
            if args.shard_sizes:
                sizes = [f"datagen@{int(size)}" for size in args.shard_sizes.split(",")]
                clients = tuple(
                    c for name in scenario.clients for c in (sizes if name == "datagen" else [name])
                )
                scenario = Scenario(**{**asdict(scenario), "clients": clients})
            summaries.append(run_scenario(scenario, rounds, tokenizer, work, prefect_server.env()))
    print_summary(summaries)
    if args.out:
        args.out.write_text(json.dumps(summaries, indent=2))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)  # each run's outputs and logs are tens of MB


if __name__ == "__main__":
    main()
