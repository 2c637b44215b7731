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
    python benchmarks/bench_conversations.py --exact-tokens    # SGLang /generate: later turns rendered on the loop
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from datagen.config import GenerationConfig  # noqa: E402
from datagen.generation.conversation import Conversation, ConversationChains, Prepare  # noqa: E402
from datagen.generation.dispatch_state import GenerationResult  # noqa: E402
from datagen.generation.dispatcher import Dispatcher  # noqa: E402
from datagen.generation.openai_chat import GenerationRequest  # noqa: E402
from datagen.generation.sglang_generate import attach_prompt_tokens, prompt_encoder  # noqa: E402
from datagen.records import CompletionRecord, Message, PromptRecord, SamplingParams  # noqa: E402

try:  # run as `python benchmarks/bench_conversations.py` (benchmarks/ is on the path) or imported as a module
    from bench import build_tokenizer
    from bench_hosts import MODEL, WORDS, Host, _Results, _wait_up, measure
except ImportError:
    from benchmarks.bench import build_tokenizer
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


def _dispatcher(host: Host, args: argparse.Namespace) -> Dispatcher:
    return Dispatcher(
        host.urls,
        model=MODEL,
        engine="external",
        max_inflight_per_server=args.slots,
        generation=GenerationConfig(request_timeout_s=600),
        exact_tokens=args.prepare is not None,
    )


def run_independent(
    host: Host, requests: list[GenerationRequest], args: argparse.Namespace
) -> dict[str, Any]:
    """The conversations' requests, each on its own, in shards of ``shard_size`` requests."""
    results = _Results(len(requests))
    if args.prepare is not None:
        # Sent as the flow sends them: each shard's prompts rendered by its own thread, not carried over.
        requests = [request.model_copy(update={"prompt_tokens": None}) for request in requests]
    shards = deque(requests[i : i + args.shard_size] for i in range(0, len(requests), args.shard_size))
    with _dispatcher(host, args) as dispatcher:
        _wait_up(dispatcher, len(host.urls))
        _feed(dispatcher, shards, results, args.prepare)
        results.done.wait()
    return {"failures": results.failures}


def run_conversations(
    host: Host,
    prompts: list[PromptRecord],
    args: argparse.Namespace,
    capture: list[GenerationRequest] | None = None,
) -> dict[str, Any]:
    """Each shard's conversations as one following stream (what a shard of an on_policy dataset does).

    ``capture`` receives every request a server answered, in the order they resolved.
    """
    sampling = SamplingParams(max_tokens=args.max_tokens)
    per_shard = max(1, args.shard_size // args.turns)
    shards = deque(
        ConversationChains(
            (Conversation(prompt, 0, sampling, None, "bench") for prompt in prompts[i : i + per_shard]),
            args.prepare,
        )
        for i in range(0, len(prompts), per_shard)
    )
    results = _Results(len(prompts) * args.turns)
    deliver = results.deliver
    if capture is not None:

        def deliver(request: GenerationRequest, result: GenerationResult) -> None:
            # Only requests a server answered: the failure of a turn an ended conversation never sent comes
            # with the request of the turn before, which must not be sent twice by the independent workload.
            if isinstance(result, CompletionRecord):
                capture.append(request)
            results.deliver(request, result)

    with _dispatcher(host, args) as dispatcher:
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
            dispatcher.submit_stream(first, deliver, follow=chains.follower(deliver, _broken))
        results.done.wait()
    return {"failures": results.failures}


def _broken(error: BaseException) -> None:
    raise SystemExit(f"a conversation's next turn could not be built: {error!r}")


def _feed(
    dispatcher: Dispatcher,
    shards: deque[list[GenerationRequest]],
    results: _Results,
    prepare: Prepare | None,
) -> None:
    submitted = 0
    while shards:
        if submitted - results.count >= 2 * dispatcher.admission_limit:
            results.done.wait(0.02)
            continue
        shard = shards.popleft()
        submitted += len(shard)
        if prepare is not None:
            shard, unrenderable = prepare(shard)
            assert not unrenderable, unrenderable
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
    parser.add_argument(
        "--exact-tokens",
        action="store_true",
        help="SGLang /generate with rendered prompt ids (each later turn rendered on the dispatcher's loop)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.prepare = None
    if args.exact_tokens:
        tokenizer = build_tokenizer(Path(tempfile.mkdtemp(prefix="bench-conversations-")) / "tokenizer")
        args.prepare = functools.partial(attach_prompt_tokens, encoder=prompt_encoder(str(tokenizer)))
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
        f"{args.conversations} conversations x {args.turns} turns on {args.servers} servers x {args.slots} slots"
        f"{' (exact tokens)' if args.exact_tokens else ''}: "
        f"tok/s {medians}; conversations / independent: {ratio:.3f}"
    )
    if args.out:
        args.out.write_text(
            json.dumps({"tok_per_s": medians, "ratio": round(ratio, 3), "runs": runs}, indent=2)
        )


if __name__ == "__main__":
    main()
