"""The dispatcher's HTTP/1.1 pool against real servers: uvicorn (what SGLang and transformers serve run) and a
raw socket server that misbehaves on purpose."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import uvicorn

from datagen.generation.http import (
    ConnectFailedError,
    ConnectionBrokenError,
    ConnectTimeoutError,
    HttpPool,
    MalformedResponseError,
    ResponseTimeoutError,
    new_event_loop,
)

T = TypeVar("T")


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run on the loop the dispatcher runs on (uvloop where installed)."""
    loop = new_event_loop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        loop.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def asgi_app(scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Any) -> None:
    """Echo service: /echo returns the body and headers seen, /stream a chunked body, /sleep waits."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    path = scope["path"]
    if path.endswith("/stream"):
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        )
        for index in range(100):
            await send(
                {"type": "http.response.body", "body": b"x" * 10_000 + str(index).encode(), "more_body": True}
            )
        await send({"type": "http.response.body", "body": b"end"})
        return
    if path.endswith("/sleep"):
        await asyncio.sleep(1.0)
    headers = {name.decode(): value.decode() for name, value in scope["headers"]}
    payload = f"{scope['method']} {path} {headers.get('authorization', '-')} {len(body)}".encode()
    status = 404 if path.endswith("/missing") else 200
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]}
    )
    await send({"type": "http.response.body", "body": payload + b"|" + body})


@pytest.fixture(scope="module")
def uvicorn_url() -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(asgi_app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def pool_for(url: str, **overrides: Any) -> HttpPool:
    options: dict[str, Any] = {"limit": 8, "keepalive_idle_s": 4.0, "connect_timeout_s": 2.0}
    options.update(overrides)
    return HttpPool(url, **options)


def test_requests_reuse_one_keep_alive_connection_and_send_headers_and_body(uvicorn_url: str) -> None:
    async def main() -> list[bytes]:
        pool = pool_for(uvicorn_url + "/prefix/", headers={"Authorization": "Bearer k"})
        bodies = []
        for index in range(5):
            response = await pool.request("POST", "/echo", b'{"n": %d}' % index, timeout_s=5)
            assert response.status == 200
            bodies.append(response.body)
        assert pool.connections_opened == 1
        assert pool.idle_connections == 1
        missing = await pool.request("GET", "/missing", b"", timeout_s=5)
        assert missing.status == 404
        pool.close()
        return bodies

    bodies = run(main())
    assert bodies[3] == b'POST /prefix/echo Bearer k 8|{"n": 3}'


def test_a_chunked_body_arrives_whole(uvicorn_url: str) -> None:
    async def main() -> bytes:
        pool = pool_for(uvicorn_url)
        response = await pool.request("GET", "/stream", b"", timeout_s=5)
        again = await pool.request("POST", "/echo", b"{}", timeout_s=5)
        assert again.status == 200 and pool.connections_opened == 1
        return response.body

    body = run(main())
    assert len(body) == 100 * 10_000 + sum(len(str(index)) for index in range(100)) + 3
    assert body.endswith(b"99end")


def test_concurrent_requests_open_one_connection_each_up_to_the_limit(uvicorn_url: str) -> None:
    async def main() -> None:
        pool = pool_for(uvicorn_url, limit=4)
        results = await asyncio.gather(*(pool.request("POST", "/echo", b"{}", timeout_s=5) for _ in range(4)))
        assert [response.status for response in results] == [200] * 4
        assert pool.connections_opened == 4 and pool.idle_connections == 4
        # More than the limit at once is the caller's bug, said at once.
        tasks = [asyncio.create_task(pool.request("POST", "/sleep", b"", timeout_s=5)) for _ in range(4)]
        await asyncio.sleep(0.05)
        with pytest.raises(RuntimeError, match="full"):
            await pool.request("POST", "/echo", b"{}", timeout_s=5)
        await asyncio.gather(*tasks)

    run(main())


def test_a_timed_out_request_closes_its_connection(uvicorn_url: str) -> None:
    async def main() -> None:
        pool = pool_for(uvicorn_url)
        with pytest.raises(ResponseTimeoutError):
            await pool.request("POST", "/sleep", b"", timeout_s=0.2)
        assert pool.idle_connections == 0
        # The late answer can never be taken for the next request's.
        response = await pool.request("POST", "/echo", b"{}", timeout_s=5)
        assert response.body.startswith(b"POST /echo")
        assert pool.connections_opened == 2

    run(main())


def test_idle_connections_past_their_keep_alive_are_not_reused(uvicorn_url: str) -> None:
    async def main() -> None:
        pool = pool_for(uvicorn_url, keepalive_idle_s=0.1)
        await pool.request("POST", "/echo", b"{}", timeout_s=5)
        await asyncio.sleep(0.2)
        await pool.request("POST", "/echo", b"{}", timeout_s=5)
        assert pool.connections_opened == 2

    run(main())


def test_a_refused_connection_is_a_connect_failure() -> None:
    async def main() -> None:
        pool = pool_for(f"http://127.0.0.1:{free_port()}")
        with pytest.raises(ConnectFailedError, match="cannot connect"):
            await pool.request("POST", "/echo", b"{}", timeout_s=5)

    run(main())


def test_a_server_that_never_accepts_times_out_instead_of_hanging() -> None:
    # A listening socket whose backlog is full drops new SYNs: the handshake never completes (connect
    # timeout), or completes into a queue nobody reads (response timeout). Either way the call ends in time.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        for _ in range(8):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)

        async def main() -> float:
            pool = pool_for(f"http://127.0.0.1:{port}", connect_timeout_s=0.3)
            started = time.monotonic()
            with pytest.raises((ConnectTimeoutError, ResponseTimeoutError)):
                await pool.request("POST", "/echo", b"{}", timeout_s=0.6)
            return time.monotonic() - started

        try:
            assert run(main()) < 5
        finally:
            for filler in fillers:
                filler.close()


class RawServer:
    """Answers every connection's first request with ``reply`` and then does ``after`` ("close" or "keep")."""

    def __init__(self, reply: bytes, after: str = "close") -> None:
        self.reply = reply
        self.after = after
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            connection.recv(65536)
            connection.sendall(self.reply)
            if self.after == "close":
                connection.close()

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part", ConnectionBrokenError),
        (b"", ConnectionBrokenError),
        (b"NOT HTTP AT ALL\r\n\r\n", MalformedResponseError),
    ],
    ids=["cut-short", "closed-at-once", "garbage"],
)
def test_broken_answers_are_classified(reply: bytes, error: type[Exception]) -> None:
    server = RawServer(reply)

    async def main() -> None:
        pool = pool_for(server.url)
        with pytest.raises(error):
            await pool.request("POST", "/x", b"{}", timeout_s=5)
        assert pool.idle_connections == 0

    try:
        run(main())
    finally:
        server.close()


def test_connection_close_from_the_server_is_honoured() -> None:
    server = RawServer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

    async def main() -> None:
        pool = pool_for(server.url)
        for _ in range(3):
            response = await pool.request("POST", "/x", b"{}", timeout_s=5)
            assert response == type(response)(200, b"ok")
        assert pool.connections_opened == 3

    try:
        run(main())
    finally:
        server.close()


def test_a_url_that_is_not_http_is_refused() -> None:
    with pytest.raises(ValueError, match="not an http"):
        HttpPool("ftp://x", limit=1, keepalive_idle_s=1, connect_timeout_s=1)
