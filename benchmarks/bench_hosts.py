"""Fleet efficiency over several simulated hosts: the multi-host run's one dispatcher against the ideal client.

Each "host" is its own simulator process (benchmarks/simulator.py) serving ``--servers-per-host`` servers,
as a GPU box serves one SGLang server per GPU. On the same prompts and servers (counters reset before every
run), the runs alternate ABBA (datagen, ideal, ideal, datagen per round), so a machine that gets busier or
quieter favours neither. Clients:

* ``datagen``: what a multi-host run's parent does: one :class:`~datagen.generation.dispatcher.Dispatcher`,
  hosts joined through :class:`~datagen.generation.multihost.HostWatch` from their published fleets, one request
  stream per shard (``submit_stream``), fed as the backlog runs low, like the flow's shard tasks;
* ``ideal``: benchmarks/clients.py's ideal client over every host's servers (every request known upfront,
  ``slots`` in flight on every server, least-loaded by construction, no records);
* ``leases`` (``--leases``): the alternative design: each host runs its own dispatcher over its own servers
  and pulls whole shards from a shared queue (a write-once lease in the store, here a lock-free deque)
  whenever its backlog runs low.

Every figure is taken at the servers: the generation phase runs from the first request reaching any server
to the last answer leaving one; output tok/s = tokens in that phase / its length; utilisation = slot-seconds
decoding / (all slots x the phase).

    python benchmarks/bench_hosts.py                      # 2 and 4 hosts, one ABBA round (about 2 minutes)
    python benchmarks/bench_hosts.py --hosts 4 --rounds 2 --leases --out hosts.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from datagen.config import GenerationConfig  # noqa: E402
from datagen.generation.dispatch_state import GenerationResult  # noqa: E402
from datagen.generation.dispatcher import Dispatcher  # noqa: E402
from datagen.generation.multihost import HostWatch  # noqa: E402
from datagen.generation.openai_chat import GenerationRequest  # noqa: E402
from datagen.output.multihost import HostFleet  # noqa: E402
from datagen.records import CompletionRecord, Message, PromptRecord, SamplingParams  # noqa: E402

try:  # run as `python benchmarks/bench_hosts.py` (benchmarks/ is on the path) or imported as a module
    from clients import run_ideal
except ImportError:
    from benchmarks.clients import run_ideal

WORDS = [f"tok{i}" for i in range(5000)]
MODEL = "sim"
READY_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Host:
    """One simulated box: a simulator process serving a few servers."""

    def __init__(self, name: str, servers: int, args: argparse.Namespace) -> None:
        self.name = name
        self.ports = [_free_port() for _ in range(servers)]
        self.urls = [f"http://127.0.0.1:{port}" for port in self.ports]
        self.process = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "benchmarks" / "simulator.py"),
                "--ports",
                ",".join(map(str, self.ports)),
                "--slots",
                str(args.slots),
                "--mean-tokens",
                str(args.mean_tokens),
                "--step-base-ms",
                str(args.step_base_ms),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert self.process.stdout is not None
        if b"ready" not in self.process.stdout.readline():
            raise RuntimeError(f"simulator of {name} did not start")

    def fleet(self, slots: int) -> HostFleet:
        """What the host part would publish."""
        return HostFleet(
            host=self.name,
            flow_run_id="bench",
            hostname="bench",
            pid=self.process.pid,
            urls=self.urls,
            max_inflight_per_server=slots,
            served_model_name=MODEL,
        )

    def call(self, path: str, method: str = "GET") -> list[dict[str, Any]]:
        """``path`` on every server of the host."""
        answers = []
        for url in self.urls:
            request = urllib.request.Request(
                url + path, method=method, data=b"" if method == "POST" else None
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                answers.append(json.loads(response.read()))
        return answers

    def stop(self) -> None:
        """Stop the simulator."""
        self.process.terminate()
        self.process.wait(10)


def make_prompts(count: int, seed: int) -> list[PromptRecord]:
    """Prompts of random words, the same for every client."""
    rng = random.Random(seed)
    return [
        PromptRecord(
            prompt_id=f"p{index:06d}",
            dataset="bench",
            messages=[
                Message(role="user", content=" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200))))
            ],
        )
        for index in range(count)
    ]


def _requests(prompts: list[PromptRecord], max_tokens: int) -> list[GenerationRequest]:
    sampling = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens)
    return [GenerationRequest(prompt=prompt, sampling=sampling, dataset="bench") for prompt in prompts]


class _Results:
    """Counts delivered results (on the dispatcher's loop thread); set when all arrived."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.count = 0
        self.failures = 0
        self.done = threading.Event()
        self.lock = threading.Lock()

    def deliver(self, _request: GenerationRequest, result: GenerationResult) -> None:
        with self.lock:
            self.count += 1
            self.failures += not isinstance(result, CompletionRecord)
            if self.count >= self.expected:
                self.done.set()


def _feed(dispatcher: Dispatcher, shards: deque[list[GenerationRequest]], results: _Results) -> None:
    """Hand shards over as streams while fewer than two admission limits of requests are unresolved.

    (The flow counts shards not registered yet as backlog for the same reason: a stream reaches the
    dispatcher's loop a moment after it is handed over, and a feeder reading only the loop's backlog would
    hoard every shard for one host.)
    """
    submitted = 0
    while True:
        if submitted - results.count >= 2 * dispatcher.admission_limit:
            time.sleep(0.02)
            continue
        try:
            shard = shards.popleft()
        except IndexError:
            return
        submitted += len(shard)
        dispatcher.submit_stream(shard, results.deliver)


def _wait_up(dispatcher: Dispatcher, servers: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while sum(s.up for s in dispatcher.stats().servers) < servers:
        if time.monotonic() > deadline:
            raise RuntimeError("servers did not come up")
        time.sleep(0.05)


def run_datagen(
    hosts: list[Host], requests: list[GenerationRequest], args: argparse.Namespace
) -> dict[str, Any]:
    """One dispatcher over every host's servers, hosts joined as a multi-host run joins them."""
    shards = deque(requests[i : i + args.shard_size] for i in range(0, len(requests), args.shard_size))
    results = _Results(len(requests))
    generation = GenerationConfig(request_timeout_s=600)
    first = hosts[0].fleet(args.slots)
    with Dispatcher(
        first.urls, model=MODEL, engine="external", max_inflight_per_server=args.slots, generation=generation
    ) as dispatcher:
        watch = HostWatch(dispatcher, lost_after_s=60.0)
        for host in hosts:
            watch.join(host.fleet(args.slots))
        _wait_up(dispatcher, sum(len(host.urls) for host in hosts))
        _feed(dispatcher, shards, results)
        results.done.wait()
    return {"failures": results.failures}


def run_leases(
    hosts: list[Host], requests: list[GenerationRequest], args: argparse.Namespace
) -> dict[str, Any]:
    """The alternative: every host its own dispatcher, pulling whole shards from one shared queue."""
    shards = deque(requests[i : i + args.shard_size] for i in range(0, len(requests), args.shard_size))
    generation = GenerationConfig(request_timeout_s=600)
    failures = 0
    dispatchers = [
        Dispatcher(
            host.urls,
            model=MODEL,
            engine="external",
            max_inflight_per_server=args.slots,
            generation=generation,
        )
        for host in hosts
    ]
    for dispatcher in dispatchers:
        dispatcher.start()
    try:
        for dispatcher, host in zip(dispatchers, hosts, strict=True):
            _wait_up(dispatcher, len(host.urls))
        per_host = [_Results(10**12) for _ in hosts]

        def pull(dispatcher: Dispatcher, results: _Results) -> None:
            _feed(dispatcher, shards, results)

        threads = [
            threading.Thread(target=pull, args=(d, r)) for d, r in zip(dispatchers, per_host, strict=True)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        while sum(r.count for r in per_host) < len(requests):
            time.sleep(0.02)
        failures = sum(r.failures for r in per_host)
    finally:
        for dispatcher in dispatchers:
            dispatcher.close()
    return {"failures": failures}


def run_ideal_client(
    hosts: list[Host], prompts: list[PromptRecord], args: argparse.Namespace
) -> dict[str, Any]:
    """benchmarks/clients.py's ideal client over every host's servers."""
    bodies = [
        orjson.dumps(
            {
                "model": MODEL,
                "messages": [m.to_chat_dict() for m in prompt.messages],
                "max_tokens": args.max_tokens,
                "temperature": 0.8,
                "top_p": 0.95,
                "stream": False,
            }
        )
        for prompt in prompts
    ]
    urls = [url for host in hosts for url in host.urls]
    result = asyncio.run(run_ideal(urls, bodies, args.slots))
    return {"failures": result["failures"]}


def measure(hosts: list[Host], client: str, run: Any) -> dict[str, Any]:
    """Reset the servers, run one client, read the servers' counters."""
    for host in hosts:
        host.call("/bench/reset", "POST")
    outcome = run()
    servers = [stats for host in hosts for stats in host.call("/bench/stats")]
    start = min(s["first_arrival"] for s in servers if s["first_arrival"] is not None)
    end = max(s["last_finish"] for s in servers if s["last_finish"] is not None)
    phase_s = max(end - start, 1e-9)
    tokens = sum(s["output_tokens"] for s in servers)
    busy = sum(s["slot_seconds_busy"] for s in servers)
    slots = sum(s["slots"] for s in servers)
    return {
        "client": client,
        "generation_s": round(phase_s, 2),
        "requests": sum(s["finished"] for s in servers),
        "failures": outcome["failures"],
        "tok_per_s": round(tokens / phase_s, 1),
        "utilisation": round(busy / (slots * phase_s), 3),
    }


def bench(host_count: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every client, ABBA, over ``host_count`` simulated hosts."""
    hosts = [Host(f"host-{index}", args.servers_per_host, args) for index in range(host_count)]
    try:
        prompts = make_prompts(args.prompts, seed=host_count)
        requests = _requests(prompts, args.max_tokens)
        clients = {
            "datagen": lambda: run_datagen(hosts, requests, args),
            "ideal": lambda: run_ideal_client(hosts, prompts, args),
        }
        if args.leases:
            clients["leases"] = lambda: run_leases(hosts, requests, args)
        order = list(clients)
        runs: list[dict[str, Any]] = []
        for _ in range(args.rounds):
            for client in [*order, *reversed(order)]:
                result = measure(hosts, client, clients[client])
                print(json.dumps({"hosts": host_count, **result}), flush=True)
                runs.append(result)
    finally:
        for host in hosts:
            host.stop()
    medians = {
        client: round(statistics.median(r["tok_per_s"] for r in runs if r["client"] == client), 1)
        for client in clients
    }
    ideal = medians["ideal"]
    return {
        "hosts": host_count,
        "servers": host_count * args.servers_per_host,
        "slots": host_count * args.servers_per_host * args.slots,
        "tok_per_s": medians,
        "vs_ideal": {client: round(value / ideal, 3) for client, value in medians.items()},
        "utilisation": {
            client: statistics.median(r["utilisation"] for r in runs if r["client"] == client)
            for client in clients
        },
        "runs": runs,
    }


def main() -> None:
    """Parse arguments, run each host count, print the ratios."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", default="2,4", help="host counts to measure, e.g. 2,4")
    parser.add_argument("--servers-per-host", type=int, default=2)
    parser.add_argument("--slots", type=int, default=32, help="slots per server (= in flight per server)")
    parser.add_argument("--mean-tokens", type=float, default=100.0)
    parser.add_argument("--step-base-ms", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--shard-size", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=1, help="ABBA rounds per host count")
    parser.add_argument("--leases", action="store_true", help="also measure the shard-lease alternative")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    load = os.getloadavg()
    results = [bench(int(count), args) for count in args.hosts.split(",")]
    print(
        f"load average at start: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; at end: {os.getloadavg()[0]:.1f}"
    )
    for result in results:
        ratios = ", ".join(f"{client} {ratio:.2f}x" for client, ratio in result["vs_ideal"].items())
        print(
            f"{result['hosts']} hosts x {args.servers_per_host} servers x {args.slots} slots: "
            f"tok/s {result['tok_per_s']}; vs ideal: {ratios}; utilisation {result['utilisation']}"
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
