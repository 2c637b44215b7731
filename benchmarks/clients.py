"""The two reference clients datagen is measured against, on the same servers and prompts.

* ``ideal``: asyncio + aiohttp, every request known (and encoded) upfront, ``slots + margin`` requests in
  flight on every server all the time (one worker coroutine per in-flight request, so the next request
  always goes to whichever server just freed a slot: least-loaded), no retries, no records, no storage.
  The best a hand-written client can do; the bar datagen's whole flow is held to.
* ``specforge``: what SpecForge's ``regenerate_train_data.py`` does: a ``ThreadPoolExecutor`` with one
  thread per server slot, requests assigned to servers round robin, one blocking request per thread
  through a per-server synchronous HTTP client.

Both read the prompts file the benchmark writes (one ``{"messages": [...]}`` per line) and send the same
body datagen sends. They print one JSON line: requests, failures, output tokens, wall seconds.

    python benchmarks/clients.py ideal --urls http://127.0.0.1:31000,http://127.0.0.1:31001 \
        --prompts prompts.jsonl --slots 72 --margin 8 --max-tokens 2048
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson

CHAT_PATH = "/v1/chat/completions"
TIMEOUT_S = 1800.0
KEEPALIVE_IDLE_S = 4.0


def load_bodies(path: Path, args: argparse.Namespace) -> list[bytes]:
    """Every request body, encoded once (the ideal client knows all its work upfront)."""
    bodies = []
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        row = orjson.loads(line)
        body: dict[str, Any] = {
            "model": args.model,
            "messages": row["messages"],
            "temperature": args.temperature,
            "top_p": args.top_p,
            "max_tokens": args.max_tokens,
            "stream": False,
        }
        bodies.append(orjson.dumps(body))
    return bodies


async def run_ideal(urls: list[str], bodies: list[bytes], in_flight_per_server: int) -> dict[str, Any]:
    """Keep ``in_flight_per_server`` requests on every server until the work runs out."""
    work = deque(bodies)
    tokens = 0
    failures = 0
    headers = {"Content-Type": "application/json"}

    async def worker(session: aiohttp.ClientSession, url: str) -> None:
        nonlocal tokens, failures
        while work:
            body = work.popleft()
            try:
                async with session.post(url + CHAT_PATH, data=body, headers=headers) as response:
                    raw = await response.read()
                    if response.status != 200:
                        failures += 1
                        continue
                tokens += int(orjson.loads(raw)["usage"]["completion_tokens"])
            except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
                failures += 1

    sessions = {
        url: aiohttp.ClientSession(
            # Closes idle connections before uvicorn's 5 s does, as datagen's dispatcher does.
            connector=aiohttp.TCPConnector(limit=in_flight_per_server, keepalive_timeout=KEEPALIVE_IDLE_S),
            timeout=aiohttp.ClientTimeout(total=TIMEOUT_S),
        )
        for url in urls
    }
    started = time.monotonic()
    try:
        await asyncio.gather(
            *(worker(sessions[url], url) for url in urls for _ in range(in_flight_per_server))
        )
    finally:
        for session in sessions.values():
            await session.close()
    return {
        "requests": len(bodies),
        "failures": failures,
        "output_tokens": tokens,
        "wall_s": time.monotonic() - started,
    }


def run_specforge(urls: list[str], bodies: list[bytes], slots: int) -> dict[str, Any]:
    """One thread per slot of the fleet, round robin over the servers, one blocking request per thread."""
    clients = {
        url: httpx.Client(
            base_url=url,
            timeout=TIMEOUT_S,
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100),
        )
        for url in urls
    }
    headers = {"Content-Type": "application/json"}

    def call(url: str, body: bytes) -> int:
        response = clients[url].post(CHAT_PATH, content=body, headers=headers)
        if response.status_code != 200:
            return -1
        return int(response.json()["usage"]["completion_tokens"])

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=slots * len(urls)) as pool:
        results = list(pool.map(call, itertools.cycle(urls), bodies))
    wall_s = time.monotonic() - started
    for client in clients.values():
        client.close()
    return {
        "requests": len(bodies),
        "failures": sum(1 for tokens in results if tokens < 0),
        "output_tokens": sum(tokens for tokens in results if tokens > 0),
        "wall_s": wall_s,
    }


def main() -> None:
    """Run one client over the prompts file and print its figures as one JSON line."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("client", choices=["ideal", "specforge"])
    parser.add_argument("--urls", required=True, help="Comma-separated server base URLs.")
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--slots", type=int, required=True, help="Running slots per server.")
    parser.add_argument("--margin", type=int, default=8, help="Ideal client: extra requests per server.")
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--model", default="sim")
    args = parser.parse_args()
    urls = [url.rstrip("/") for url in args.urls.split(",")]
    bodies = load_bodies(args.prompts, args)
    if args.client == "ideal":
        result = asyncio.run(run_ideal(urls, bodies, args.slots + args.margin))
    else:
        result = run_specforge(urls, bodies, args.slots)
    sys.stdout.write(orjson.dumps(result).decode() + "\n")


if __name__ == "__main__":
    main()
