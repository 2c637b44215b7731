"""A whole `datagen run` at the seed's scale, SIGKILLed at half, resumed with the command it prints.

What a new user does, at the seed's request count: the README's CLI (``python -m flows.cli_entry run
--config X --run-id R``: Prefect's temporary server, a local output folder) over the seed's six datasets
(193,010 distinct prompts in their real file layouts, written by ``make_prompt_files.write_seed_datasets``
with duplicates and bad rows a run must drop) against 8 simulated continuous-batching servers
(``simulator.py``, ``fleet.engine: external``). Once half the requests are answered, the whole process
group of the run gets SIGKILL; then the resume command runs to completion.

Printed: each phase's time (start to the first request, prompt preparation, generation,
merge-and-tokenize, report; for the resume, start to its first request), the peak RSS of each run's
process tree (every process descending from it, sampled from /proc), and the exactly-once count (every
request's (prompt_id, sample_index) across the completions and failures of both runs: unique, duplicated,
missing). Exit 1 when a request is missing or duplicated, when the resume's first request came more than
``--resume-budget-s`` after it started, or when a run fails.

    python benchmarks/bench_seed_scale.py --prompts 20000      # a quick run (fits a 2-core machine)
    python benchmarks/bench_seed_scale.py --full               # the seed: 193,010 prompts (16 cores)

Phases come from the run's log file (``$DATAGEN_STATE_DIR/logs``, timestamped lines): preparation from
the run's start to the last ``prepared dataset=``, generation from the first request to
``merge-and-tokenize`` starting, merge-and-tokenize to its ``tokenized rows=``, report to ``run complete``.
The first request is the earliest arrival any simulated server saw (``/bench/stats``, on the host's
monotonic clock, the same as this script's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

from make_prompt_files import SEED_PROMPTS, write_seed_datasets  # noqa: E402

SERVERS = 8
PORT_RANGE = range(34000, 34100)
SAMPLE_INTERVAL_S = 0.25
# A process of the run still alive this long after the run ended (or was killed) is reported as left over.
SURVIVOR_GRACE_S = 15.0
RUN_ID = "seed-scale"
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


def free_ports(count: int) -> list[int]:
    """``count`` consecutive free ports in :data:`PORT_RANGE` (the simulator takes a range)."""
    for low in range(PORT_RANGE.start, PORT_RANGE.stop - count + 1):
        try:
            for port in range(low, low + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return list(range(low, low + count))
    raise SystemExit(f"no {count} consecutive free ports in {PORT_RANGE.start}-{PORT_RANGE.stop - 1}")


def process_tree(root: int) -> dict[int, int]:
    """``root`` and every process descending from it now, each with its RSS in kB."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            statm = Path(f"/proc/{entry}/statm").read_text().split()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
        rss[int(entry)] = int(statm[1]) * PAGE_KB
    tree, stack = {}, [root]
    while stack:
        pid = stack.pop()
        if pid in rss:
            tree[pid] = rss[pid]
        stack.extend(children.get(pid, []))
    return tree


def _alive(pids: set[int]) -> dict[int, str]:
    """The processes of ``pids`` still running (not zombies), with their command lines."""
    alive = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            if stat[stat.rindex(")") + 2] != "Z":
                alive[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    return alive


class Simulators:
    """The simulated servers (one process); their counters over HTTP."""

    def __init__(self, ports: list[int], args: argparse.Namespace, log: Path) -> None:
        self.urls = [f"http://127.0.0.1:{port}" for port in ports]
        command = [
            sys.executable,
            str(REPO / "benchmarks" / "simulator.py"),
            "--ports",
            f"{ports[0]}-{ports[-1]}",
            "--slots",
            str(args.slots),
            "--step-base-ms",
            str(args.step_base_ms),
            "--mean-tokens",
            str(args.mean_tokens),
            "--sigma",
            "0.5",
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log.open("wb"), text=True)
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "ready":
            raise SystemExit(f"the simulator did not start; see {log}")

    def stats(self) -> list[dict[str, Any]]:
        result = []
        for url in self.urls:
            with urllib.request.urlopen(url + "/bench/stats", timeout=5) as response:
                result.append(json.loads(response.read()))
        return result

    def finished(self) -> int:
        return sum(item["finished"] for item in self.stats())

    def first_arrival(self) -> float | None:
        arrivals = [item["first_arrival"] for item in self.stats() if item["first_arrival"] is not None]
        return min(arrivals) if arrivals else None

    def reset(self) -> None:
        for url in self.urls:
            request = urllib.request.Request(url + "/bench/reset", method="POST", data=b"")
            urllib.request.urlopen(request, timeout=5).read()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@dataclass
class Attempt:
    """One `datagen run` process: when it started, its peak RSS, how it ended."""

    name: str
    started_wall: float = 0.0
    started_mono: float = 0.0
    first_request_s: float | None = None
    peak_rss_kb: int = 0
    peak_processes: int = 0
    exit_code: int | None = None
    killed_at_answered: int | None = None
    wall_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)


def run_attempt(
    name: str,
    command: list[str],
    env: dict[str, str],
    sims: Simulators,
    output: Path,
    *,
    kill_at: int | None,
    timeout_s: float,
) -> Attempt:
    """Start one run; sample its tree's RSS; SIGKILL its process group once ``kill_at`` requests are answered."""
    attempt = Attempt(name)
    sims.reset()
    attempt.started_wall, attempt.started_mono = time.time(), time.monotonic()
    with (output / f"{name}.out").open("wb") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO
        )
    seen: set[int] = set()
    while True:
        tree = process_tree(process.pid)
        if sum(tree.values()) > attempt.peak_rss_kb:
            attempt.peak_rss_kb, attempt.peak_processes = sum(tree.values()), len(tree)
        seen.update(tree)
        if attempt.first_request_s is None and (first := sims.first_arrival()) is not None:
            attempt.first_request_s = first - attempt.started_mono
            print(f"  {name}: first request after {attempt.first_request_s:.1f} s", flush=True)
        if process.poll() is not None:
            attempt.exit_code = process.returncode
            break
        if kill_at is not None and (answered := sims.finished()) >= kill_at:
            attempt.killed_at_answered = answered
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            attempt.exit_code = process.returncode
            break
        if time.monotonic() - attempt.started_mono > timeout_s:
            os.killpg(process.pid, signal.SIGKILL)
            raise SystemExit(f"{name} did not finish within {timeout_s} s; see {output / (name + '.out')}")
        time.sleep(SAMPLE_INTERVAL_S)
    attempt.wall_s = time.monotonic() - attempt.started_mono
    # Whatever the run started outside its process group (e.g. the temporary API server in its own
    # session) must not outlive a kill: note it, then stop it so the next attempt starts clean.
    deadline = time.monotonic() + SURVIVOR_GRACE_S
    while (survivors := _alive(seen - {process.pid})) and time.monotonic() < deadline:
        time.sleep(0.5)
    if survivors:
        print(
            f"  {name}: processes alive {SURVIVOR_GRACE_S:.0f} s after the run ended: {survivors}", flush=True
        )
        for pid in survivors:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return attempt


def _log_lines(log: Path) -> list[tuple[float, str]]:
    lines = []
    for line in log.read_text(errors="replace").splitlines():
        match = LOG_TIME.match(line)
        if match:
            stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            lines.append((stamp, line))
    return lines


def _first(lines: list[tuple[float, str]], needle: str) -> float | None:
    return next((stamp for stamp, line in lines if needle in line), None)


def _last(lines: list[tuple[float, str]], needle: str) -> float | None:
    return next((stamp for stamp, line in reversed(lines) if needle in line), None)


def phases(log: Path, attempt: Attempt) -> dict[str, float]:
    """Seconds of each phase of one attempt, from its log (a phase it did not reach is left out)."""
    lines = _log_lines(log)
    found: dict[str, float] = {}
    flow_start = _first(lines, "Beginning flow run")
    if flow_start is not None:
        found["start_to_flow"] = flow_start - attempt.started_wall
    if attempt.first_request_s is not None:
        found["start_to_first_request"] = attempt.first_request_s
    opened, prepared = _first(lines, " run run_id="), _last(lines, "prepared dataset=")
    if opened is not None and prepared is not None:
        found["prompt_preparation"] = prepared - opened
    generated = _first(lines, "dispatcher closed")
    if attempt.first_request_s is not None and generated is not None:
        found["generation"] = generated - (attempt.started_wall + attempt.first_request_s)
    elif attempt.first_request_s is not None and attempt.killed_at_answered is not None:
        found["generation_until_kill"] = attempt.wall_s - attempt.first_request_s
    merge_start, tokenized = _first(lines, "merging run_id="), _first(lines, "tokenized rows=")
    if merge_start is not None and tokenized is not None:
        found["merge_and_tokenize"] = tokenized - merge_start
    complete = _first(lines, "run complete")
    if tokenized is not None and complete is not None:
        found["report"] = complete - tokenized
    return found


def exactly_once(run_root: Path) -> dict[str, int]:
    """Requests of the run's prompts, and how often each has a completion or failure record."""
    samples = 1
    expected: set[tuple[str, int]] = set()
    for shard in sorted((run_root / "prompts").glob("*/shard-*.jsonl")):
        for line in shard.read_text().splitlines():
            if line.strip():
                expected.update((json.loads(line)["prompt_id"], index) for index in range(samples))
    counts: Counter[tuple[str, int]] = Counter()
    for folder in ("completions", "failures"):
        for part in sorted((run_root / folder).glob("*/*.jsonl")):
            for line in part.read_text().splitlines():
                if line.strip():
                    record = json.loads(line)
                    counts[(record["prompt_id"], record.get("sample_index", 0))] += 1
    return {
        "requests": len(expected),
        "answered_unique": len(counts),
        "duplicated": sum(1 for count in counts.values() if count > 1),
        "missing": len(expected - set(counts)),
        "unexpected": len(set(counts) - expected),
    }


def write_config(
    work: Path, files: dict[str, Path], urls: list[str], model: Path, args: argparse.Namespace
) -> Path:
    names = {
        "infinity_instruct": ("infinity-instruct", "chat"),
        "webinstruct": ("webinstruct", "science"),
        "codefeedback_filtered": ("codefeedback", "code"),
        "metamath": ("metamath", "math"),
        "hermes_fc": ("hermes-fc", "tools"),
        "agentinstruct": ("agentinstruct", "agent"),
    }
    config = {
        "run_id": RUN_ID,
        "model": {"path": str(model), "served_name": "sim"},  # what the simulated servers list
        "fleet": {
            "engine": "external",
            "external_urls": urls,
            "max_inflight_per_server": args.inflight,
        },
        "sampling": {"temperature": 0.7, "max_tokens": args.max_tokens},
        "datasets": [
            {"name": names[layout][0], "format": layout, "path": str(path), "category": names[layout][1]}
            for layout, path in files.items()
        ],
        "output": str(work / "output"),
    }
    path = work / "seed-scale.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--prompts", type=int, default=20_000, help="distinct prompts in all (default 20,000)")
    size.add_argument("--full", action="store_true", help=f"the seed's {SEED_PROMPTS:,} prompts")
    parser.add_argument("--work", type=Path, help="working folder (default: a new temporary one, removed)")
    parser.add_argument("--no-kill", action="store_true", help="one run to completion, no SIGKILL/resume")
    parser.add_argument("--kill-at", type=float, default=0.5, help="share of requests answered at the kill")
    parser.add_argument("--resume-budget-s", type=float, default=30.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--mean-tokens", type=float, default=8.0)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--step-base-ms", type=float, default=5.0)
    parser.add_argument("--inflight", type=int, default=256, help="fleet.max_inflight_per_server")
    parser.add_argument("--timeout-s", type=float, default=7200.0, help="per run")
    args = parser.parse_args()
    prompts = SEED_PROMPTS if args.full else args.prompts
    keep = args.work is not None
    work = args.work or Path(tempfile.mkdtemp(prefix="seed-scale-"))
    if work.exists() and keep:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    print(f"seed-scale benchmark: {prompts:,} prompts, {SERVERS} simulated servers, work={work}", flush=True)

    started = time.monotonic()
    files = write_seed_datasets(prompts, work / "datasets")
    print(f"  wrote the six datasets in {time.monotonic() - started:.1f} s", flush=True)
    from datagen.app.tinymodel import build_tiny_model

    model = build_tiny_model(work / "model")
    sims = Simulators(free_ports(SERVERS), args, work / "simulator.log")
    try:
        config = write_config(work, files, sims.urls, model, args)
        state = work / "state"
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("PREFECT_API_URL", "DATAGEN_"))
        }
        env |= {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])),
            "PYTHONUNBUFFERED": "1",
            "DATAGEN_STATE_DIR": str(state),
            "PREFECT_HOME": str(work / "prefect-home"),
        }
        command = [
            sys.executable,
            "-m",
            "flows.cli_entry",
            "run",
            "--config",
            str(config),
            "--run-id",
            RUN_ID,
        ]
        total = prompts  # one sample per prompt
        attempts: list[Attempt] = []
        first = run_attempt(
            "run",
            command,
            env,
            sims,
            work,
            kill_at=None if args.no_kill else int(total * args.kill_at),
            timeout_s=args.timeout_s,
        )
        attempts.append(first)
        if not args.no_kill:
            print(f"  run: SIGKILL of its process group at {first.killed_at_answered} answered", flush=True)
            attempts.append(
                run_attempt("resume", command, env, sims, work, kill_at=None, timeout_s=args.timeout_s)
            )
    finally:
        sims.stop()
    logs = sorted((state / "logs").glob(f"{RUN_ID}-*.log"))
    for attempt, log in zip(attempts, logs, strict=False):
        attempt.phases = phases(log, attempt)
    counts = exactly_once(work / "output" / "runs" / RUN_ID)

    print(f"\nseed-scale run: {prompts:,} prompts, {SERVERS} simulated servers, {os.cpu_count()} cores")
    for attempt in attempts:
        phase_text = ", ".join(f"{key} {value:.1f} s" for key, value in attempt.phases.items())
        print(
            f"  {attempt.name}: exit {attempt.exit_code}, wall {attempt.wall_s:.1f} s, peak RSS "
            f"{attempt.peak_rss_kb / 1024:.0f} MiB over {attempt.peak_processes} processes; {phase_text}"
        )
    print(f"  exactly-once: {json.dumps(counts)}")
    failures = []
    if counts["missing"] or counts["duplicated"] or counts["unexpected"] or counts["requests"] != total:
        failures.append(f"exactly-once failed: {counts} (expected {total} requests)")
    final = attempts[-1]
    if final.exit_code != 0:
        failures.append(f"the {final.name} exited {final.exit_code}; see {work / (final.name + '.out')}")
    if not args.no_kill:
        resume_first = final.first_request_s
        if resume_first is None or resume_first > args.resume_budget_s:
            failures.append(
                f"the resume's first request came after {resume_first} s (> {args.resume_budget_s} s)"
            )
    result = {
        "prompts": prompts,
        "cores": os.cpu_count(),
        "attempts": [attempt.__dict__ for attempt in attempts],
        "exactly_once": counts,
        "failures": failures,
    }
    (work / "result.json").write_text(json.dumps(result, indent=2))
    for failure in failures:
        print(f"FAIL: {failure}")
    if not keep and not failures:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
