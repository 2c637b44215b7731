"""The share of a generation window spent generating: datagen's window policy vs the naive one.

A window bounds the time from the halt of training to its restart. Inside it the run pays for halting
training, starting the fleet (model load and CUDA-graph capture), the drain of the last requests, stopping the
fleet and restarting training. Two policies, on the same simulated fleet (benchmarks/simulator.py, started
fresh for each run) and through datagen's own :class:`~datagen.generation.dispatcher.Dispatcher`:

* **window**: :class:`datagen.generation.window.WindowPolicy` and ``WindowWatch``: admission stops a measured
  99th-percentile answer before generation must end, so the requests in flight finish; what is still in flight
  at the end is cut.
* **naive**: admit until generation must end, then cut everything in flight (lost work, sent again later).

Both end generation at the same time (the window's end minus stopping the fleet and restarting training), so
training restarts inside the window for both; what differs is how much of the window the GPUs spent on answers
that were kept. The figure: **generating share** = slot-seconds of stored answers (each answer's latency)
over (the fleet's slots x the window). Cut requests and idle slots count as not generating.

The box modelled: a 27B model on SGLang, answers of a thinking model (lognormal, mean about 2,700 tokens, cut
at max_tokens 4,096), about 27 output tokens/s per request; halting training 2 min, the fleet's start 8 min
(5 min load + 3 min graph capture), its stop 30 s, training's restart 1 min. Time is scaled so a 6-hour window
takes about ``--real-s`` seconds; one simulated token is ``TOKENS_PER_STEP`` real tokens, so a step is long
enough for a two-core machine to keep up.

    python benchmarks/bench_window.py                   # 6-hour window, both policies, ABBA
    python benchmarks/bench_window.py --real-s 60 --rounds 1 --out results.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from datagen.config import GenerationConfig
from datagen.generation.dispatcher import Dispatcher
from datagen.generation.openai_chat import GenerationRequest
from datagen.generation.window import WindowPolicy, WindowWatch
from datagen.records import CompletionRecord, Message, PromptRecord, SamplingParams

REPO = Path(__file__).resolve().parents[1]
SIMULATOR = REPO / "benchmarks" / "simulator.py"
BASE_PORT = 31900
SERVERS = 2
SLOTS = 32
# One simulated token stands for this many real ones: a real step (one token per request) would be shorter
# than a two-core machine can schedule once time is scaled down.
TOKENS_PER_STEP = 32
MEAN_ANSWER_TOKENS = 2700
MAX_TOKENS = 4096
ANSWER_SIGMA = 0.5
PER_REQUEST_TOKENS_PER_S = 27.0
# The box's overheads, in simulated seconds (see the module docstring).
TRAINING_HALT_S = 120.0
FLEET_START_S = 8 * 60.0
FLEET_STOP_S = 30.0
TRAINING_RESTART_S = 60.0
READY_TIMEOUT_S = 30.0
# Real seconds: how often the harness looks at the dispatcher, and how long after the end of generation it
# waits for the watch's cut to resolve what was in flight.
POLL_S = 0.02
CUT_GRACE_S = 1.0


@dataclass(frozen=True)
class Outcome:
    """One run of one policy, in simulated seconds."""

    policy: str
    window_s: float
    generating_share: float
    completions: int
    cut: int
    output_tokens: int
    admission_stopped_before_end_s: float | None
    training_restarted_before_end_s: float


def _wait_healthy(urls: list[str]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    for url in urls:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"simulated server {url} never became healthy")
            time.sleep(0.1)


def _simulator(scale: float) -> subprocess.Popen[bytes]:
    step_ms = 1000.0 * TOKENS_PER_STEP / PER_REQUEST_TOKENS_PER_S
    return subprocess.Popen(
        [
            sys.executable,
            str(SIMULATOR),
            "--ports",
            f"{BASE_PORT}-{BASE_PORT + SERVERS - 1}",
            "--slots",
            str(SLOTS),
            "--step-base-ms",
            f"{step_ms}",
            "--mean-tokens",
            f"{MEAN_ANSWER_TOKENS / TOKENS_PER_STEP}",
            "--sigma",
            f"{ANSWER_SIGMA}",
            "--time-scale",
            f"{scale}",
        ]
    )


def run_policy(policy_name: str, window_s: float, scale: float) -> Outcome:
    """One window of ``window_s`` simulated seconds under ``policy_name`` on a fresh simulated fleet."""
    urls = [f"http://127.0.0.1:{BASE_PORT + index}" for index in range(SERVERS)]
    server = _simulator(scale)
    try:
        _wait_healthy(urls)
        halted = time.monotonic()
        window_end = halted + window_s * scale
        generation_end = window_end - (FLEET_STOP_S + TRAINING_RESTART_S) * scale
        longest_answer_s = MAX_TOKENS / PER_REQUEST_TOKENS_PER_S * scale
        policy = WindowPolicy(
            generation_end=generation_end,
            initial_answer_s=longest_answer_s if policy_name == "window" else 0.0,
        )
        # Halting training and starting the fleet, as the box pays them (the servers wait meanwhile).
        time.sleep((TRAINING_HALT_S + FLEET_START_S) * scale)
        # More prompts than the window can take: the window, not the prompts, ends the run.
        capacity = SERVERS * SLOTS * window_s / (MEAN_ANSWER_TOKENS / PER_REQUEST_TOKENS_PER_S)
        sampling = SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS // TOKENS_PER_STEP)
        requests = [
            GenerationRequest(
                prompt=PromptRecord(
                    prompt_id=f"p{index:07d}",
                    dataset="bench",
                    messages=[Message(role="user", content=f"question {index}")],
                ),
                sampling=sampling,
                dataset="bench",
            )
            for index in range(int(capacity * 2))
        ]
        kept_slot_s = 0.0
        completions = tokens = unfinished = 0
        lock = threading.Lock()
        settled = threading.Event()
        remaining = [len(requests)]

        def deliver(_request: GenerationRequest, result: Any) -> None:
            nonlocal kept_slot_s, completions, tokens, unfinished
            with lock:
                if isinstance(result, CompletionRecord):
                    completions += 1
                    tokens += result.usage.completion_tokens * TOKENS_PER_STEP
                    kept_slot_s += result.latency_s
                    if policy_name == "window":
                        policy.observe_answer(result.latency_s)
                else:
                    unfinished += 1
                remaining[0] -= 1
                if not remaining[0]:
                    settled.set()

        generation = GenerationConfig(request_timeout_s=window_s * scale, max_attempts=1)
        dispatcher = Dispatcher(
            urls, model="sim", engine="external", max_inflight_per_server=SLOTS, generation=generation
        ).start()
        in_flight_cut: list[int] = []

        def cut() -> None:
            in_flight_cut.append(sum(dispatcher.stats().in_flight.values()))
            dispatcher.close()

        watch = WindowWatch(
            policy,
            stop_admission=dispatcher.stop_admission,
            cut=cut,
            in_flight=lambda: sum(dispatcher.stats().in_flight.values()),
        )
        with watch:
            dispatcher.submit_stream(requests, deliver)
            while not settled.is_set() and time.monotonic() < generation_end + CUT_GRACE_S:
                drained = not sum(dispatcher.stats().in_flight.values())
                if watch.admission_stopped_at is not None and drained:
                    break  # every admitted request answered before the end: the fleet stops now
                time.sleep(POLL_S)
        dispatcher.close()
        # Stopping the fleet and restarting training.
        time.sleep((FLEET_STOP_S + TRAINING_RESTART_S) * scale)
        restarted = time.monotonic()
    finally:
        server.terminate()
        server.wait(10)
    stopped_at = watch.admission_stopped_at
    return Outcome(
        policy=policy_name,
        window_s=window_s,
        generating_share=kept_slot_s / (SERVERS * SLOTS * window_s * scale),
        completions=completions,
        cut=in_flight_cut[0] if in_flight_cut else 0,
        output_tokens=tokens,
        admission_stopped_before_end_s=None if stopped_at is None else (window_end - stopped_at) / scale,
        training_restarted_before_end_s=(window_end - restarted) / scale,
    )


def main() -> None:
    """Run both policies (ABBA when ``--rounds`` is 2), print them side by side and their ratio."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--window-hours", type=float, default=6.0)
    parser.add_argument("--real-s", type=float, default=180.0, help="Real seconds one window takes.")
    parser.add_argument(
        "--rounds", type=int, default=2, help="1: window, naive; 2: window, naive, naive, window."
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    window_s = args.window_hours * 3600
    scale = args.real_s / window_s
    order = ["window", "naive", "naive", "window"][: 2 * args.rounds]
    outcomes = [run_policy(name, window_s, scale) for name in order]
    by_policy: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        by_policy.setdefault(outcome.policy, []).append(outcome)
        print(json.dumps(asdict(outcome)))
    share = {name: sum(o.generating_share for o in runs) / len(runs) for name, runs in by_policy.items()}
    summary = {
        "window_hours": args.window_hours,
        "real_s_per_window": args.real_s,
        "generating_share_window": round(share["window"], 4),
        "generating_share_naive": round(share["naive"], 4),
        "ratio_window_over_naive": round(share["window"] / share["naive"], 4),
        "cut_requests_window": [o.cut for o in by_policy["window"]],
        "cut_requests_naive": [o.cut for o in by_policy["naive"]],
        "target_generating_share": 0.95,
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps({"runs": [asdict(o) for o in outcomes], "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
