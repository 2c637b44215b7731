"""A continuous-batching server simulator: many simulated inference servers in one asyncio process.

Each simulated server behaves like an SGLang/vLLM engine as seen from a client:

* at most ``slots`` requests run; the rest wait in the server's queue and join at the next step;
* one decode step costs ``step_base_s + step_per_request_s * running`` (scaled by ``time_scale``) and
  produces one token for every running request;
* a request's answer length is drawn from a lognormal distribution seeded by the prompt (and sample
  seed), so every client sees the same lengths for the same prompts; ``max_tokens`` cuts it (``length``);
* HTTP/1.1 keep-alive with an idle timeout (uvicorn's default of 5 s), so clients must reuse connections
  the way they would against a real server.

Endpoints: ``POST /v1/chat/completions``, ``POST /generate`` (SGLang native), ``GET /health``,
``GET /server_info`` (``max_running_requests``), ``GET /metrics`` (Prometheus, SGLang names),
``GET /bench/stats`` (slot-seconds busy, tokens, first arrival and last finish on this process's
monotonic clock) and ``POST /bench/reset``.

The HTTP layer is a minimal hand-written protocol on purpose: eight servers and a few thousand requests
per second must fit next to the client under test on a two-core machine.

    python benchmarks/simulator.py --ports 31000-31007 --slots 72 --mean-tokens 300 --step-base-ms 8
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import heapq
import math
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import orjson

# uvicorn closes a keep-alive connection idle this long: real servers do, so the simulator does too.
KEEPALIVE_IDLE_S = 5.0
# Characters of text per simulated token (about what a BPE tokenizer gives on English and code).
CHARS_PER_TOKEN = 4
FILLER = ("lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor " * 4096)[: 1 << 18]
HEADER_END = b"\r\n\r\n"
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 503: "Service Unavailable"}


@dataclass(frozen=True)
class SimConfig:
    """How one simulated server behaves.

    Attributes:
        slots: Requests decoded at once (SGLang's max_running_requests).
        step_base_s: Fixed cost of one decode step, simulated seconds.
        step_per_request_s: Extra step cost per running request, simulated seconds.
        mean_tokens: Mean answer length of the lognormal length distribution.
        sigma: Lognormal shape; 1.0 gives a long tail (p99 about 10x the median).
        time_scale: Real seconds per simulated second.
        model: Served model name.

    """

    slots: int = 72
    step_base_s: float = 0.008
    step_per_request_s: float = 0.0
    mean_tokens: float = 300.0
    sigma: float = 1.0
    time_scale: float = 1.0
    model: str = "sim"


def answer_tokens(prompt_key: str, mean_tokens: float, sigma: float) -> int:
    """The answer length for a prompt: lognormal, seeded by the prompt text (same prompt, same length)."""
    digest = hashlib.blake2b(prompt_key.encode(), digest_size=16).digest()
    # Two uniforms from the digest -> one standard normal (Box-Muller).
    u1 = (int.from_bytes(digest[:8], "big") + 1) / (2**64 + 1)
    u2 = int.from_bytes(digest[8:], "big") / 2**64
    normal = math.sqrt(-2.0 * math.log(u1)) * math.cos(2 * math.pi * u2)
    mu = math.log(mean_tokens) - sigma * sigma / 2
    return max(1, round(math.exp(mu + sigma * normal)))


@dataclass(eq=False)
class _Request:
    tokens: int
    done: asyncio.Future[int]
    finish_step: int = 0


@dataclass
class SimServer:
    """One simulated continuous-batching server (its engine; the HTTP layer is :class:`_Connection`)."""

    port: int
    config: SimConfig
    waiting: deque[_Request] = field(default_factory=deque)
    finishing: list[tuple[int, int, _Request]] = field(default_factory=list)
    running: int = 0
    step: int = 0
    requests: int = 0
    finished: int = 0
    output_tokens: int = 0
    slot_seconds_busy: float = 0.0
    first_arrival: float | None = None
    last_finish: float | None = None
    max_waiting: int = 0
    connections: int = 0
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _sequence: int = 0

    def reset(self) -> None:
        """Zero the counters (between benchmark runs on the same process)."""
        self.requests = self.finished = self.output_tokens = self.max_waiting = self.connections = 0
        self.slot_seconds_busy = 0.0
        self.first_arrival = self.last_finish = None

    def submit(self, tokens: int) -> asyncio.Future[int]:
        """Queue one request of ``tokens`` output tokens; the future resolves when it is generated."""
        now = time.monotonic()
        if self.first_arrival is None:
            self.first_arrival = now
        self.requests += 1
        request = _Request(tokens=tokens, done=asyncio.get_running_loop().create_future())
        self.waiting.append(request)
        self.max_waiting = max(self.max_waiting, len(self.waiting))
        self._wake.set()
        return request.done

    async def run(self) -> None:
        """The engine loop: admit, decode one step, finish; sleeps when idle."""
        config = self.config
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            while self.waiting and self.running < config.slots:
                request = self.waiting.popleft()
                if request.done.cancelled():
                    continue
                self.running += 1
                # Joins at this step: generates one token per step from now on.
                request.finish_step = self.step + request.tokens
                self._sequence += 1
                heapq.heappush(self.finishing, (request.finish_step, self._sequence, request))
            step_s = (config.step_base_s + config.step_per_request_s * self.running) * config.time_scale
            started = time.monotonic()
            await asyncio.sleep(step_s)
            # A late wake-up still counts as the time the slots were held.
            self.slot_seconds_busy += self.running * (time.monotonic() - started)
            self.step += 1
            while self.finishing and self.finishing[0][0] <= self.step:
                _, _, request = heapq.heappop(self.finishing)
                self.running -= 1
                self.finished += 1
                self.output_tokens += request.tokens
                if not request.done.done():
                    request.done.set_result(request.tokens)
            if self.finished:
                self.last_finish = time.monotonic()

    def stats(self) -> dict[str, Any]:
        """Counters for the benchmark harness."""
        return {
            "port": self.port,
            "slots": self.config.slots,
            "requests": self.requests,
            "finished": self.finished,
            "running": self.running,
            "waiting": len(self.waiting),
            "max_waiting": self.max_waiting,
            "connections": self.connections,
            "output_tokens": self.output_tokens,
            "slot_seconds_busy": self.slot_seconds_busy,
            "first_arrival": self.first_arrival,
            "last_finish": self.last_finish,
            "time_scale": self.config.time_scale,
        }


class _Connection(asyncio.Protocol):
    """HTTP/1.1 with keep-alive and Content-Length bodies: just what clients of an engine send."""

    def __init__(self, server: SimServer) -> None:
        self.server = server
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.idle_timer: asyncio.TimerHandle | None = None
        self.handling: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.server.connections += 1
        # Like uvicorn, the keep-alive clock starts after a response, not at connect.

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.idle_timer is not None:
            self.idle_timer.cancel()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        # A request is arriving: the connection is not idle (a starved loop may read it late).
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        if not self.busy:
            self._next()

    def _arm_idle(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        loop = asyncio.get_running_loop()
        self.idle_timer = loop.call_later(KEEPALIVE_IDLE_S, self._close_if_idle)

    def _close_if_idle(self) -> None:
        if not self.busy and not self.buffer and self.transport is not None:
            self.transport.close()

    def _next(self) -> None:
        end = self.buffer.find(HEADER_END)
        if end < 0:
            return
        head = bytes(self.buffer[:end]).decode("latin-1")
        lines = head.split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if len(self.buffer) < end + 4 + length:
            return
        body = bytes(self.buffer[end + 4 : end + 4 + length])
        del self.buffer[: end + 4 + length]
        self.busy = True
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        self.handling = asyncio.ensure_future(self._handle(method, path.split("?", 1)[0], body))

    async def _handle(self, method: str, path: str, body: bytes) -> None:
        try:
            status, payload, content_type = await self._route(method, path, body)
        except (ValueError, KeyError, TypeError) as error:
            status, payload, content_type = 400, orjson.dumps({"error": str(error)}), "application/json"
        if self.transport is None:
            return
        self.transport.write(
            f"HTTP/1.1 {status} {REASONS.get(status, 'OK')}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: keep-alive\r\n\r\n".encode()
            + payload
        )
        self.busy = False
        self._arm_idle()
        if self.buffer:
            self._next()

    async def _route(self, method: str, path: str, body: bytes) -> tuple[int, bytes, str]:
        server, config = self.server, self.server.config
        json_type = "application/json"
        if path == "/v1/chat/completions" and method == "POST":
            data = orjson.loads(body)
            messages = data["messages"]
            key = f"{orjson.dumps(messages).decode()}/{data.get('seed')}"
            tokens, finish = _limit(answer_tokens(key, config.mean_tokens, config.sigma), data)
            await server.submit(tokens)
            prompt_tokens = sum(len(str(m.get("content") or "")) for m in messages) // CHARS_PER_TOKEN
            return 200, _chat_body(data, tokens, finish, prompt_tokens, config.model), json_type
        if path == "/generate" and method == "POST":
            data = orjson.loads(body)
            sampling = data.get("sampling_params") or {}
            text = data.get("text") or orjson.dumps(data.get("input_ids")).decode()
            key = f"{text}/{sampling.get('seed')}"
            tokens = answer_tokens(key, config.mean_tokens, config.sigma)
            limit = int(sampling.get("max_new_tokens") or 128)
            finish = "length" if tokens >= limit else "stop"
            tokens = min(tokens, limit)
            await server.submit(tokens)
            return 200, _generate_body(text, tokens, finish), json_type
        if path in ("/health", "/health_generate"):
            return 200, b"", "text/plain"
        if path in ("/server_info", "/get_server_info"):
            info = {
                "max_running_requests": config.slots,
                "served_model_name": config.model,
                "simulated": True,
            }
            return 200, orjson.dumps(info), json_type
        if path == "/v1/models":
            return (
                200,
                orjson.dumps({"object": "list", "data": [{"id": config.model, "object": "model"}]}),
                json_type,
            )
        if path == "/metrics":
            return 200, _metrics(server).encode(), "text/plain; version=0.0.4"
        if path == "/bench/stats":
            return 200, orjson.dumps(server.stats()), json_type
        if path == "/bench/reset" and method == "POST":
            server.reset()
            return 200, b"{}", json_type
        return 404, orjson.dumps({"error": f"no route {method} {path}"}), json_type


def _limit(tokens: int, data: dict[str, Any]) -> tuple[int, str]:
    limit = int(data.get("max_tokens") or data.get("max_completion_tokens") or 1 << 30)
    return (limit, "length") if tokens >= limit else (tokens, "stop")


def _text(tokens: int) -> str:
    chars = tokens * CHARS_PER_TOKEN
    return FILLER[:chars] if chars <= len(FILLER) else FILLER * (chars // len(FILLER) + 1)


def _chat_body(data: dict[str, Any], tokens: int, finish: str, prompt_tokens: int, model: str) -> bytes:
    return orjson.dumps(
        {
            "id": "chatcmpl-sim",
            "object": "chat.completion",
            "model": data.get("model") or model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": _text(tokens)},
                    "finish_reason": finish,
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": tokens,
                "total_tokens": prompt_tokens + tokens,
            },
        }
    )


def _generate_body(text: str, tokens: int, finish: str) -> bytes:
    return orjson.dumps(
        {
            "text": _text(tokens),
            "output_ids": list(range(tokens)),
            "meta_info": {
                "id": "sim",
                "finish_reason": {"type": finish},
                "prompt_tokens": len(text) // CHARS_PER_TOKEN,
                "completion_tokens": tokens,
                "cached_tokens": 0,
            },
        }
    )


def _metrics(server: SimServer) -> str:
    return (
        f"sglang:num_running_reqs {server.running}\n"
        f"sglang:num_queue_reqs {len(server.waiting)}\n"
        f"sglang:generation_tokens_total {server.output_tokens}\n"
        f"sglang:num_requests_total {server.finished}\n"
    )


async def serve(ports: list[int], config: SimConfig, host: str = "127.0.0.1") -> None:
    """Serve one simulated server per port until cancelled; prints ``ready`` once every port listens."""
    loop = asyncio.get_running_loop()
    servers = [SimServer(port, config) for port in ports]
    engines = [asyncio.create_task(server.run()) for server in servers]
    listeners = [
        await loop.create_server(
            lambda s=server: _Connection(s), host, server.port, reuse_address=True, backlog=4096
        )
        for server in servers
    ]
    print("ready", flush=True)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        for listener in listeners:
            listener.close()
        for engine in engines:
            engine.cancel()


def parse_ports(text: str) -> list[int]:
    """``31000-31007`` or ``31000,31001`` -> a list of ports."""
    ports: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        ports.extend(range(int(low), int(high or low) + 1))
    return ports


def main() -> None:
    """Parse arguments and serve until SIGTERM."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ports", required=True, help="e.g. 31000-31007")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--slots", type=int, default=72)
    parser.add_argument("--step-base-ms", type=float, default=8.0)
    parser.add_argument("--step-per-request-ms", type=float, default=0.0)
    parser.add_argument("--mean-tokens", type=float, default=300.0)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--model", default="sim")
    args = parser.parse_args()
    config = SimConfig(
        slots=args.slots,
        step_base_s=args.step_base_ms / 1000,
        step_per_request_s=args.step_per_request_ms / 1000,
        mean_tokens=args.mean_tokens,
        sigma=args.sigma,
        time_scale=args.time_scale,
        model=args.model,
    )
    asyncio.run(serve(parse_ports(args.ports), config, args.host))


if __name__ == "__main__":
    main()
