"""A small OpenAI-compatible chat-completions server that injects faults on purpose.

It runs an asyncio TCP server in a background thread and speaks just enough HTTP/1.1 (keep-alive,
Content-Length bodies) to serve ``POST /v1/chat/completions`` and ``GET /health``. Faults are chosen
per request, either by directives in the last message's content or by configured random rates:

* ``[[500,empty,reset,400,slow]]`` in the content: the n-th attempt of that exact content gets the n-th
  fault (``ok`` means answer normally); attempts past the list are answered normally.
* ``#toolcall`` answers with a tool call whose arguments are valid JSON; ``#badtool`` with arguments
  that are not JSON; ``#sleep=0.3`` delays the answer by that many seconds.
* ``rates``: probability of each fault for requests without directives (seeded, so runs repeat).

Faults: ``500`` (internal error), ``empty`` (200 with an empty body), ``reset`` (TCP reset before any
response), ``400`` (a final bad-request error), ``429`` (too many requests), ``slow`` (answer after
``slow_s``); with ``pinned_to``, every request is answered 400 as a server serving another model. Every
request is recorded with the server's in-flight count at its arrival, so tests can
check the dispatcher's caps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

DIRECTIVE = re.compile(r"\[\[([a-z0-9,]+)\]\]")
SLEEP = re.compile(r"#sleep=([0-9.]+)")
FAULTS = ("500", "empty", "reset", "400", "429", "slow")


@dataclass
class SeenRequest:
    """One request as the server saw it."""

    path: str
    body: dict[str, Any] | None
    fault: str
    in_flight_at_arrival: int
    arrived_at: float


@dataclass
class FaultPlan:
    """Random fault rates (0..1 each) for requests without directives, and the slow delay."""

    rates: dict[str, float] = field(default_factory=dict)
    # When set, every chat request is answered 400 "Server is pinned to '<this>'" (a server of another run).
    pinned_to: str | None = None
    slow_s: float = 0.5
    base_delay_s: float = 0.0
    seed: int = 0


class FaultServer:
    """The fault-injecting server; use as a context manager or call start()/stop().

    Args:
        plan: Random fault rates; none when omitted.
        port: Port to bind (0 picks a free one; pass the old port to restart on the same URL).
    """

    def __init__(self, plan: FaultPlan | None = None, port: int = 0) -> None:
        self.plan = plan or FaultPlan()
        self.port = port
        self.healthy = True
        # GET /health requests answered so far (a fleet waiting for readiness polls it).
        self.health_checks = 0
        # When set, every answer ends as one that hit max_tokens (finish_reason "length").
        self.cut_off = False
        # Answers wait until this is set; a test clears it to hold a run mid-generation, then sets it.
        self.answering = threading.Event()
        self.answering.set()
        # When set, every path but /health and /metrics needs "Authorization: Bearer <key>" (SGLang's rule).
        self.api_key: str | None = None
        # When set, GET /v1/models lists these names (an engine's model list); unset, the path is 404.
        self.models: list[str] | None = None
        self.requests: list[SeenRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._attempts_by_content: Counter[str] = Counter()
        self._random = random.Random(self.plan.seed)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        """The base URL."""
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Bind and serve in a background thread.

        Raises:
            OSError: The port cannot be bound (another program holds it).

        """
        ready = threading.Event()
        bind_errors: list[OSError] = []
        self._loop = asyncio.new_event_loop()

        async def bind() -> None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self.port))
            self._server = await asyncio.start_server(self._handle, sock=sock)
            self.port = sock.getsockname()[1]

        def run() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(bind())
            except OSError as error:
                bind_errors.append(error)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name=f"fault-server-{self.port}", daemon=True)
        self._thread.start()
        ready.wait(10)
        if bind_errors:
            self._thread.join(10)
            self._loop.close()
            self._loop = None
            raise bind_errors[0]

    def stop(self) -> None:
        """Close the listener and abort every open connection (clients see resets)."""
        if self._loop is None:
            return
        loop = self._loop

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                _abort(writer)
            if self._server is not None:
                await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        loop.close()
        self._loop = None

    def chat_requests(self) -> list[SeenRequest]:
        """The chat-completion requests seen so far."""
        with self._lock:
            return [r for r in self.requests if r.path == "/v1/chat/completions"]

    def contents_seen(self) -> Counter[str]:
        """How many times each last-message content arrived."""
        counts: Counter[str] = Counter()
        for request in self.chat_requests():
            if request.body is not None:
                counts[str(request.body["messages"][-1]["content"])] += 1
        return counts

    # --- protocol ---------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {
                    k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
                }
                length = int(headers.get("content-length", "0"))
                raw = await reader.readexactly(length) if length else b""
                open_path = path.startswith(("/health", "/metrics"))
                if (
                    self.api_key
                    and not open_path
                    and headers.get("authorization") != f"Bearer {self.api_key}"
                ):
                    await send_json(writer, 401, {"error": "Unauthorized"})
                    continue
                keep_open = await self._respond(method, path, raw, writer)
                if not keep_open:
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            return
        finally:
            self._writers.discard(writer)
            if not writer.is_closing():
                writer.close()

    async def _respond(self, method: str, path: str, raw: bytes, writer: asyncio.StreamWriter) -> bool:
        if path == "/health":
            self.health_checks += 1
            status = 200 if self.healthy else 503
            await send_json(writer, status, {"status": "ok" if self.healthy else "starting"})
            return True
        if path == "/v1/models" and self.models is not None:
            with self._lock:
                self.requests.append(SeenRequest(path, None, "ok", self.in_flight, time.monotonic()))
            data = [{"id": model, "object": "model", "owned_by": "fault-server"} for model in self.models]
            await send_json(writer, 200, {"object": "list", "data": data})
            return True
        if method != "POST" or path != "/v1/chat/completions":
            await send_json(writer, 404, {"detail": "not found"})
            return True
        body = json.loads(raw) if raw else None
        fault = self._choose_fault(body)
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.requests.append(SeenRequest(path, body, fault, self.in_flight, time.monotonic()))
        try:
            return await self._answer(fault, body, writer)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _content(self, body: dict[str, Any] | None) -> str:
        """The text directives are read from: the last message's content."""
        return str(body["messages"][-1]["content"]) if body else ""

    def _choose_fault(self, body: dict[str, Any] | None) -> str:
        content = self._content(body)
        with self._lock:
            self._attempts_by_content[content] += 1
            attempt = self._attempts_by_content[content]
            match = DIRECTIVE.search(content)
            if match:
                plan = match.group(1).split(",")
                return plan[attempt - 1] if attempt <= len(plan) else "ok"
            roll = self._random.random()
        if self.plan.pinned_to is not None:
            return "pinned"
        for fault in FAULTS:
            rate = self.plan.rates.get(fault, 0.0)
            if roll < rate:
                return fault
            roll -= rate
        return "ok"

    async def _answer(self, fault: str, body: dict[str, Any] | None, writer: asyncio.StreamWriter) -> bool:
        content = self._content(body)
        delay = self.plan.base_delay_s
        sleep = SLEEP.search(content)
        if sleep:
            delay = float(sleep.group(1))
        if fault == "slow":
            delay = self.plan.slow_s
        if delay:
            await asyncio.sleep(delay)
        while not self.answering.is_set():  # a threading.Event: polled, so the server's loop stays free
            await asyncio.sleep(0.05)
        if fault == "reset":
            _abort(writer)
            return False
        if fault == "500":
            await send_json(writer, 500, {"detail": "injected internal error"})
            return True
        if fault == "429":
            await send_json(writer, 429, {"detail": "injected: too many requests"})
            return True
        if fault == "400":
            await send_json(writer, 400, {"detail": "injected: bad request"})
            return True
        if fault == "pinned":
            await send_json(writer, 400, {"detail": f"Server is pinned to '{self.plan.pinned_to}'"})
            return True
        if fault == "abort":
            # SGLang answers an aborted generation (server overloaded, request evicted) with HTTP 200.
            aborted = _completion(body or {}, content)
            aborted["choices"][0]["finish_reason"] = "abort"
            await send_json(writer, 200, aborted)
            return True
        if fault == "empty":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            return True
        await send_json(writer, 200, self._success(fault, body or {}, content))
        return True

    def _success(self, fault: str, body: dict[str, Any], content: str) -> dict[str, Any]:
        """The body of a 200 answer (``fault`` is ``ok`` or a directive the base server does not inject)."""
        answer = _completion(body, content)
        if self.cut_off:
            answer["choices"][0]["finish_reason"] = "length"
        return answer


def _completion(body: dict[str, Any], content: str) -> dict[str, Any]:
    max_tokens = int(body.get("max_tokens", 16))
    message: dict[str, Any] = {"role": "assistant", "content": f"echo: {content}"}
    finish = "stop"
    if "#toolcall" in content or "#badtool" in content:
        arguments = '{"city": "Paris"}' if "#toolcall" in content else '{"city": Paris'
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call-1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        }
        finish = "tool_calls"
    if "#think" in content:
        message["reasoning_content"] = "thinking about it"
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "model": body.get("model", "test"),
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": 7,
            "completion_tokens": min(max_tokens, 5),
            "total_tokens": 7 + min(max_tokens, 5),
        },
    }


async def send_json(writer: asyncio.StreamWriter, status: int, payload: dict[str, Any]) -> None:
    data = json.dumps(payload).encode()
    reason = {
        200: "OK",
        400: "Bad Request",
        401: "Unauthorized",
        404: "Not Found",
        405: "Method Not Allowed",
        429: "Too Many Requests",
        500: "Internal Server Error",
        503: "Service Unavailable",
    }[status]
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
    )
    writer.write(head.encode() + data)
    await writer.drain()


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a crashing or overloaded server does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
