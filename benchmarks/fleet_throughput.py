"""Fleet start-up and generation throughput: datagen's dispatcher vs a direct saturating client.

For each fleet size in ``--servers`` (e.g. ``1,2`` on a two-GPU host), this script runs datagen's own
path: probe the host, plan one server per GPU (or CPU servers), start the fleet with
:class:`datagen.host.fleet.Fleet` (time to all servers ready), and generate ``--prompts`` requests through
:class:`datagen.generation.dispatcher.Dispatcher`. Then, on the same servers, a baseline: the ideal
client of benchmarks/clients.py (asyncio + aiohttp, keeps ``--concurrency`` requests in flight on every
server, no retries, no records): the best a hand-written script can do. It reports aggregate output
tokens/s of both and their ratio.

    python benchmarks/fleet_throughput.py --model-dir /tmp/model --build-model qwen3-1.7b \
        --servers 1,2 --prompts 256 --max-tokens 128 --concurrency 64 --out results.json

``--build-model`` builds a random-weight model first: ``tiny`` (CPU smoke test) or ``qwen3-1.7b``
(hidden 2048, 28 layers, vocabulary 151,936, bf16; needs a GPU). Outputs are random text: this measures
the pipeline, not the model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from datagen.config import GenerationConfig, RunConfig
from datagen.generation.dispatcher import Dispatcher
from datagen.generation.openai_chat import GenerationRequest
from datagen.host.fleet import Fleet
from datagen.host.plan import ServerPlan, plan_servers
from datagen.host.probe import probe_environment
from datagen.records import CompletionRecord, Message, PromptRecord, SamplingParams

try:  # run as `python benchmarks/fleet_throughput.py` (benchmarks/ is on the path) or imported as a module
    from clients import run_ideal
except ImportError:
    from benchmarks.clients import run_ideal

QWEN3_1_7B_SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
QWEN3_VOCAB = 151_936
WORDS = [f"w{i}" for i in range(4000)]


def build_qwen3_shaped_model(directory: Path, seed: int = 0) -> Path:
    """A random Qwen3-1.7B-shaped model (bf16, on the GPU) with a word-level 151,936-token tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    from datagen.app.tinymodel import SPECIAL_TOKENS, chat_template

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for index in range(QWEN3_VOCAB - len(vocab) - 1):
        vocab[f"w{index}"] = len(vocab)
    vocab["<unk>"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>"
    )
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    fast.chat_template = chat_template()
    fast.save_pretrained(directory)
    config = Qwen3Config(
        vocab_size=QWEN3_VOCAB,
        max_position_embeddings=8192,
        eos_token_id=vocab["<|im_end|>"],
        pad_token_id=vocab["<|endoftext|>"],
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        **QWEN3_1_7B_SHAPE,
    )
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.do_sample = True
    model.save_pretrained(directory)
    return directory


def make_prompts(count: int, seed: int, word_count: tuple[int, int]) -> list[PromptRecord]:
    """Prompts of random words (each one token with the word-level tokenizer)."""
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*word_count)))
        prompts.append(
            PromptRecord(
                prompt_id=f"p{index:06d}", dataset="bench", messages=[Message(role="user", content=text)]
            )
        )
    return prompts


def run_dispatcher(
    urls: list[str], model: str, prompts: list[PromptRecord], args: argparse.Namespace
) -> dict[str, Any]:
    """Generate every prompt through datagen's dispatcher; return wall time and tokens."""
    sampling = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens)
    generation = GenerationConfig(request_timeout_s=600, max_attempts=5)
    with Dispatcher(
        urls,
        model=model,
        engine="transformers",
        max_inflight_per_server=args.concurrency,
        generation=generation,
    ) as dispatcher:
        # Servers join after their first health check: wait until all are up, outside the timing.
        deadline = time.monotonic() + 60
        while len(dispatcher.stats().servers_up) < len(urls) and time.monotonic() < deadline:
            time.sleep(0.1)
        started = time.monotonic()
        futures = [
            dispatcher.submit(GenerationRequest(prompt=prompt, sampling=sampling, dataset="bench"))
            for prompt in prompts
        ]
        results = [future.result() for future in futures]
        wall_s = time.monotonic() - started
        stats = dispatcher.stats()
    completions = [r for r in results if isinstance(r, CompletionRecord)]
    tokens = sum(r.usage.completion_tokens for r in completions)
    return {
        "wall_s": round(wall_s, 2),
        "completions": len(completions),
        "failures": len(results) - len(completions),
        "retries": stats.retries,
        "output_tokens": tokens,
        "output_tok_per_s": round(tokens / wall_s, 1),
    }


def _baseline(
    urls: list[str], model: str, prompts: list[PromptRecord], args: argparse.Namespace
) -> dict[str, Any]:
    """The ideal client of benchmarks/clients.py: ``--concurrency`` requests in flight per server, no records."""
    bodies = [
        orjson.dumps(
            {
                "model": model,
                "messages": [m.to_chat_dict() for m in prompt.messages],
                "max_tokens": args.max_tokens,
                "temperature": 0.8,
                "top_p": 0.95,
                "stream": False,
            }
        )
        for prompt in prompts
    ]
    result = asyncio.run(run_ideal(urls, bodies, args.concurrency))
    wall_s = result["wall_s"]
    return {
        "wall_s": round(wall_s, 2),
        "failures": result["failures"],
        "output_tokens": result["output_tokens"],
        "output_tok_per_s": round(result["output_tokens"] / wall_s, 1),
    }


def transformers_fleet(
    servers: int, model_dir: Path, device: str, concurrency: int, env: Any, ready_timeout_s: float
) -> tuple[Fleet, ServerPlan, Path]:
    """Plan ``servers`` ``transformers serve`` servers (one per GPU) the way ``datagen run`` does; not started."""
    config = RunConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "fleet": {
                "engine": "transformers",
                "num_servers": servers,
                "cpu_servers": servers,
                "device": device,
                "max_inflight_per_server": concurrency,
                "base_port": 30400,
            },
            "datasets": [{"name": "bench", "format": "openai_messages", "path": "unused"}],
            "output": tempfile.mkdtemp(),
        }
    )
    state_dir = Path(tempfile.mkdtemp(prefix=f"fleet-{servers}-"))
    plan = plan_servers(env, config, state_dir)
    return Fleet(plan, state_dir, ready_timeout_s=ready_timeout_s), plan, state_dir


def run_size(servers: int, model_dir: Path, args: argparse.Namespace, env: Any) -> dict[str, Any]:
    """Start a fleet of ``servers``, measure both clients on it, stop it."""
    fleet, plan, state_dir = transformers_fleet(
        servers, model_dir, args.device, args.concurrency, env, args.ready_timeout_s
    )
    started = time.monotonic()
    try:
        fleet.start()
        ready_s = time.monotonic() - started
        prompts = make_prompts(args.prompts, seed=servers, word_count=(100, 400))
        # Warm every slot at full prompt length first (allocator growth, kernel selection), outside timing.
        warm = make_prompts(servers * args.concurrency, seed=99, word_count=(100, 400))
        run_dispatcher(
            fleet.urls, plan.served_model_name, warm, argparse.Namespace(**{**vars(args), "max_tokens": 8})
        )
        # ABBA order, so neither client gains from running later on a warmer server.
        runs: dict[str, list[dict[str, Any]]] = {"datagen": [], "baseline": []}
        for client in ("datagen", "baseline", "baseline", "datagen"):
            if client == "datagen":
                runs[client].append(run_dispatcher(fleet.urls, plan.served_model_name, prompts, args))
            else:
                runs[client].append(_baseline(fleet.urls, plan.served_model_name, prompts, args))
    finally:
        fleet.stop()
        shutil.rmtree(state_dir, ignore_errors=True)
    mean = {
        client: round(sum(run["output_tok_per_s"] for run in results) / len(results), 1)
        for client, results in runs.items()
    }
    return {
        "servers": servers,
        "mode": plan.mode,
        "gpu_ids": [server.gpu_ids for server in plan.servers],
        "time_to_ready_s": round(ready_s, 1),
        "datagen_runs": runs["datagen"],
        "baseline_runs": runs["baseline"],
        "datagen_output_tok_per_s": mean["datagen"],
        "baseline_output_tok_per_s": mean["baseline"],
        "ratio_datagen_over_baseline": round(mean["datagen"] / max(mean["baseline"], 1e-9), 3),
    }


def main() -> None:
    """Parse arguments, run every fleet size, print and write the results."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--build-model", choices=["tiny", "qwen3-1.7b"], default=None)
    parser.add_argument("--servers", default="1,2", help="Comma-separated fleet sizes to measure.")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64, help="In-flight requests per server.")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--ready-timeout-s", type=float, default=600)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    if args.build_model == "tiny":
        from datagen.app.tinymodel import build_tiny_model

        build_tiny_model(args.model_dir)
    elif args.build_model == "qwen3-1.7b":
        started = time.monotonic()
        build_qwen3_shaped_model(args.model_dir)
        print(f"built model in {time.monotonic() - started:.1f} s")
    env = probe_environment()
    results: dict[str, Any] = {
        "host": {
            "gpus": [gpu.name for gpu in env.gpus],
            "compute_capability": sorted(
                {gpu.compute_capability for gpu in env.gpus if gpu.compute_capability}
            ),
            "interconnect": env.interconnect.summary if env.interconnect else None,
            "driver": env.driver_version,
        },
        "settings": {
            "prompts": args.prompts,
            "prompt_words": [100, 400],
            "max_tokens": args.max_tokens,
            "concurrency_per_server": args.concurrency,
        },
        "sizes": [],
    }
    for size in [int(value) for value in args.servers.split(",")]:
        result = run_size(size, args.model_dir, args, env)
        print(json.dumps(result))
        results["sizes"].append(result)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
