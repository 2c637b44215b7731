"""On-policy conversations against independent requests: does chaining turns cost the fleet throughput?

Simulated servers (benchmarks/simulator.py, one process) and one :class:`~datagen.generation.dispatcher.Dispatcher`,
as a run uses them. Two workloads of the same number of requests, alternated ABBA:

* ``conversations``: ``conversations`` on-policy conversations of ``turns`` user turns each
  (:class:`~datagen.generation.conversation.ConversationChains`): each shard's stream holds its conversations'
  first turns and follows every answer with the conversation's next turn;
* ``independent``: the very requests the conversations sent (captured in a first, unmeasured pass: the simulator's
  answers depend only on the request, so every history is the same), each on its own, handed over in shards as
  the flow does. Same prompts, same answer lengths: only the chaining differs.

The figure is output tokens per second over the generation phase (first request to last answer, from the
servers' own counters); the claim to check is conversations >= 0.95 x independent.

    python benchmarks/bench_conversations.py                        # 600 conversations of 4 turns, one ABBA round
    python benchmarks/bench_conversations.py --conversations 1200 --rounds 2 --out conversations.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import deque
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from datagen.config import GenerationConfig  # noqa: E402
from datagen.generation.conversation import Conversation, ConversationChains  # noqa: E402
from datagen.generation.dispatch_state import GenerationResult  # noqa: E402
from datagen.generation.dispatcher import Dispatcher  # noqa: E402
from datagen.generation.openai_chat import GenerationRequest  # noqa: E402
from datagen.records import Message, PromptRecord, SamplingParams  # noqa: E402

try:  # run as `python benchmarks/bench_conversations.py` (benchmarks/ is on the path) or imported as a module
    from bench_hosts import MODEL, WORDS, Host, _Results, _wait_up, measure
except ImportError:
    from benchmarks.bench_hosts import MODEL, WORDS, Host, _Results, _wait_up, measure


def make_conversations(count: int, turns: int) -> list[PromptRecord]:
    """Conversations of ``turns`` user turns (the dataset's answers between them are placeholders)."""
    prompts = []
    for index in range(count):
        messages: list[Message] = []
        for turn in range(turns):
            words = " ".join(WORDS[(index * 7 + turn * 13 + k) % len(WORDS)] for k in range(40))
            messages.append(Message(role="user", content=f"conversation {index} turn {turn}: {words}"))
            if turn < turns - 1:
                messages.append(Message(role="assistant", content="placeholder"))
        prompts.append(PromptRecord(prompt_id=f"c{index:06d}", dataset="bench", messages=messages))
    return prompts


def _dispatcher(host: Host, slots: int) -> Dispatcher:
    return Dispatcher(
        host.urls,
        model=MODEL,
        engine="external",
        max_inflight_per_server=slots,
        generation=GenerationConfig(request_timeout_s=600),
    )


def run_independent(
    host: Host, requests: list[GenerationRequest], args: argparse.Namespace
) -> dict[str, Any]:
    """The conversations' requests, each on its own, in shards of ``shard_size`` requests."""
    results = _Results(len(requests))
    shards = deque(requests[i : i + args.shard_size] for i in range(0, len(requests), args.shard_size))
    with _dispatcher(host, args.slots) as dispatcher:
        _wait_up(dispatcher, len(host.urls))
        _feed(dispatcher, shards, results)
        results.done.wait()
    return {"failures": results.failures}


def run_conversations(
    host: Host,
    prompts: list[PromptRecord],
    args: argparse.Namespace,
    capture: list[GenerationRequest] | None = None,
) -> dict[str, Any]:
    """Each shard's conversations as one following stream (what a shard of an on_policy dataset does).

    ``capture`` receives every request sent, in the order they resolved.
    """
    sampling = SamplingParams(max_tokens=args.max_tokens)
    per_shard = max(1, args.shard_size // args.turns)
    shards = deque(
        ConversationChains(
            Conversation(prompt, 0, sampling, None, "bench") for prompt in prompts[i : i + per_shard]
        )
        for i in range(0, len(prompts), per_shard)
    )
    results = _Results(len(prompts) * args.turns)
    deliver = results.deliver
    if capture is not None:

        def deliver(request: GenerationRequest, result: GenerationResult) -> None:
            capture.append(request)
            results.deliver(request, result)

    with _dispatcher(host, args.slots) as dispatcher:
        _wait_up(dispatcher, len(host.urls))
        submitted = 0
        while shards:
            # Like the flow: a new shard while fewer than two admission limits of its requests are unresolved.
            if submitted - results.count >= 2 * dispatcher.admission_limit:
                results.done.wait(0.02)
                continue
            chains = shards.popleft()
            first, _ = chains.resume({})
            submitted += len(chains.keys())
            dispatcher.submit_stream(first, deliver, follow=chains.follower(deliver))
        results.done.wait()
    return {"failures": results.failures}


def _feed(dispatcher: Dispatcher, shards: deque[list[GenerationRequest]], results: _Results) -> None:
    submitted = 0
    while shards:
        if submitted - results.count >= 2 * dispatcher.admission_limit:
            results.done.wait(0.02)
            continue
        shard = shards.popleft()
        submitted += len(shard)
        dispatcher.submit_stream(shard, results.deliver)


def main() -> None:
    """Parse arguments, alternate the two workloads, print the ratio."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--slots", type=int, default=32, help="slots per server (= in flight per server)")
    parser.add_argument("--mean-tokens", type=float, default=100.0)
    parser.add_argument("--step-base-ms", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--conversations", type=int, default=600)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--shard-size", type=int, default=100, help="requests per shard")
    parser.add_argument("--rounds", type=int, default=1, help="ABBA rounds")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    load = os.getloadavg()
    host = Host("bench", args.servers, args)
    prompts = make_conversations(args.conversations, args.turns)
    captured: list[GenerationRequest] = []
    workloads = {
        "independent": lambda: run_independent(host, sorted(captured, key=lambda r: r.key), args),
        "conversations": lambda: run_conversations(host, prompts, args),
    }
    runs: list[dict[str, Any]] = []
    try:
        run_conversations(host, prompts, args, captured)
        for _ in range(args.rounds):
            for name in ["independent", "conversations", "conversations", "independent"]:
                result = measure([host], name, workloads[name])
                print(json.dumps(result), flush=True)
                runs.append(result)
    finally:
        host.stop()
    medians = {
        name: statistics.median(r["tok_per_s"] for r in runs if r["client"] == name) for name in workloads
    }
    ratio = medians["conversations"] / medians["independent"]
    print(
        f"load average at start: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; at end: {os.getloadavg()[0]:.1f}\n"
        f"{args.conversations} conversations x {args.turns} turns on {args.servers} servers x {args.slots} slots: "
        f"tok/s {medians}; conversations / independent: {ratio:.3f}"
    )
    if args.out:
        args.out.write_text(
            json.dumps({"tok_per_s": medians, "ratio": round(ratio, 3), "runs": runs}, indent=2)
        )


if __name__ == "__main__":
    main()
