"""The dispatcher's HTTP/1.1 client: one keep-alive connection pool per server, a few microseconds a request.

Why not aiohttp or httpx here: the dispatcher sends thousands of small JSON requests a second from one
Python thread, so the client's own per-request work sets the ceiling, and a plain :class:`asyncio.Protocol`
per connection does several times less of it than aiohttp's ``ClientSession`` or httpx's pool (figures:
docs/performance.md, "The HTTP client"). The request bytes are built with one concatenation, responses
are parsed by ``httptools`` (the C parser uvicorn serves with; it handles ``Content-Length``, chunked bodies
and keep-alive rules), and each connection carries one request at a time (no pipelining).

What it does not do, on purpose: redirects, cookies, proxies, compression, HTTP/2. The servers it talks
to (SGLang, vLLM, ``transformers serve``, the SGLang router) answer JSON over HTTP/1.1 with keep-alive.
TLS (``https://``) is supported through asyncio's own transport. The dispatcher's /health probes use a
second, small pool per server, so a probe never takes a generation slot.

Errors are classified for the dispatcher's retry rules: :class:`ConnectFailedError` (refused or
unreachable: nothing listens), :class:`ConnectTimeoutError`, :class:`ConnectionBrokenError` (the
connection closed or broke before the whole answer arrived; the server may have finished the request),
:class:`ResponseTimeoutError` and :class:`MalformedResponseError`.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

try:  # libuv's loop: the loop's own per-request work (handles, transports) in C; Linux and macOS only
    import uvloop
except ImportError:  # pragma: no cover - Windows, or a host without the wheel
    uvloop = None  # type: ignore[assignment]

# Deadlines are checked by one sweep per pool at this interval, not by a timer per request: a timer costs
# more than the rest of a request's bookkeeping (asyncio copies the context for every handle), and request
# timeouts are seconds to minutes, so a tenth of a second of slack is nothing.
SWEEP_INTERVAL_S = 0.1


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The fastest event loop available: uvloop's where installed, else asyncio's.

    The dispatcher's CPU per request is a quarter lower on uvloop (docs/performance.md, "The HTTP client").
    """
    if uvloop is not None:
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class HttpError(Exception):
    """A request failed below HTTP semantics (no usable response)."""


class ConnectFailedError(HttpError):
    """The server refused the connection or could not be reached."""


class ConnectTimeoutError(HttpError):
    """Opening a connection took longer than the connect timeout."""


class ConnectionBrokenError(HttpError):
    """The connection closed or broke before the whole response arrived."""


class ResponseTimeoutError(HttpError):
    """The whole response did not arrive within the request timeout."""


class MalformedResponseError(HttpError):
    """The bytes received are not a valid HTTP/1.1 response."""


@dataclass(frozen=True, slots=True)
class Response:
    """An HTTP response: status code and the whole body."""

    status: int
    body: bytes


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    __slots__ = (
        "_body",
        "_complete",
        "_parser",
        "_status",
        "_waiter",
        "deadline",
        "idle_since",
        "keep_alive",
        "open",
        "transport",
    )

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.open = False
        self.keep_alive = True
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._body: list[bytes] = []
        self._complete = False
        self._status = 0
        self._waiter: asyncio.Future[Response] | None = None
        self.deadline = 0.0

    # --- asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is not a subclass)
        self.open = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        reason = f": {exc}" if exc else ""
        self._fail(ConnectionBrokenError(f"connection closed before the whole response arrived{reason}"))

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:
            # Bytes nobody asked for (a late answer after a timeout): the stream is out of step; drop it.
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(MalformedResponseError("the server switched protocols"))
            self.close()
            return
        except httptools.HttpParserError as error:
            self._fail(MalformedResponseError(f"invalid HTTP response: {error}"))
            self.close()
            return
        if self._complete:
            body = b"".join(self._body) if len(self._body) != 1 else self._body[0]
            response = Response(self._status, body)
            waiter = self._waiter
            self._waiter = None
            if not waiter.done():
                waiter.set_result(response)

    # --- httptools callbacks ----------------------------------------------------------------------

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        # Read here: once the parser moves past the message it reports the next one's (unknown) state.
        self._status = self._parser.get_status_code()
        self.keep_alive = self.keep_alive and self._parser.should_keep_alive()
        self._complete = True

    # --- used by the pool -------------------------------------------------------------------------

    def send(self, data: bytes, deadline: float) -> asyncio.Future[Response]:
        assert self.transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self._body = []
        self._complete = False
        self.deadline = deadline
        self.transport.write(data)
        return self._waiter

    @property
    def waiting(self) -> bool:
        """A request was sent and its response has not completed."""
        return self._waiter is not None

    def close(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.close()

    def time_out(self) -> None:
        self._fail(ResponseTimeoutError("no complete response within the request timeout"))
        # The answer may still come; this connection can no longer tell it from the next one's.
        self.close()

    def _fail(self, error: HttpError) -> None:
        waiter = self._waiter
        self._waiter = None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)


class HttpPool:
    """Keep-alive connections to one server, at most ``limit`` of them busy at once.

    Args:
        base_url: ``http://host:port`` or ``https://host:port``, optionally with a path prefix.
        limit: The most requests in flight at once (the dispatcher's per-server cap); a caller asking
            for more is a bug, reported as a RuntimeError.
        keepalive_idle_s: Idle connections older than this are closed instead of reused (keep it below the
            server's own idle timeout, so a request never goes down a socket the server is closing).
        connect_timeout_s: Longest wait for a new connection.
        headers: Extra headers sent with every request (e.g. ``Authorization``).

    """

    def __init__(
        self,
        base_url: str,
        *,
        limit: int,
        keepalive_idle_s: float,
        connect_timeout_s: float,
        headers: dict[str, str] | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        self._prefix = parts.path.rstrip("/")
        default_port = (parts.scheme == "https" and self.port == 443) or (
            parts.scheme == "http" and self.port == 80
        )
        host_header = self.host if default_port else f"{self.host}:{self.port}"
        lines = [f"Host: {host_header}", "Content-Type: application/json"]
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        self._header_block = ("\r\n".join(lines) + "\r\nContent-Length: ").encode("latin-1")
        self._request_lines: dict[tuple[str, str], bytes] = {}
        self.limit = limit
        self.keepalive_idle_s = keepalive_idle_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: deque[_Connection] = deque()
        self._sending: set[_Connection] = set()
        self._sweep_handle: asyncio.TimerHandle | None = None
        self._busy = 0
        self.connections_opened = 0
        self._closed = False

    async def request(self, method: str, path: str, body: bytes, *, timeout_s: float) -> Response:
        """Send one request and return the whole response.

        Args:
            method: ``POST`` or ``GET``.
            path: The path below the base URL, starting with ``/``.
            body: The JSON body (``b""`` for none).
            timeout_s: Longest wait, from now, for the whole response (connecting included).

        Returns:
            The status and body.

        Raises:
            HttpError: One of this module's subclasses; the caller classifies it.
            RuntimeError: More than ``limit`` requests at once, or the pool is closed.

        """
        if self._closed:
            raise RuntimeError("HttpPool is closed")
        if self._busy >= self.limit:
            raise RuntimeError(f"HttpPool for {self.host}:{self.port} is full ({self.limit} in flight)")
        deadline = asyncio.get_running_loop().time() + timeout_s
        self._busy += 1
        connection: _Connection | None = None
        try:
            connection = self._take_idle() or await self._connect(deadline)
            head = self._request_lines.get((method, path))
            if head is None:
                head = f"{method} {self._prefix}{path} HTTP/1.1\r\n".encode("latin-1") + self._header_block
                self._request_lines[(method, path)] = head
            waiter = connection.send(head + str(len(body)).encode() + b"\r\n\r\n" + body, deadline)
            self._sending.add(connection)
            if self._sweep_handle is None:
                self._sweep_handle = asyncio.get_running_loop().call_later(SWEEP_INTERVAL_S, self._sweep)
            response = await waiter
        except BaseException:
            # Cancelled or failed mid-request: the connection's stream state is unknown.
            if connection is not None:
                connection.close()
            raise
        finally:
            self._busy -= 1
            if connection is not None:
                self._sending.discard(connection)
        if connection.open and connection.keep_alive and not self._closed:
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
            self._close_stale()
        else:
            connection.close()
        return response

    def close(self) -> None:
        """Close every idle connection; requests in flight keep theirs until they end (then close them)."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()
        if self._sweep_handle is not None and not self._sending:
            self._sweep_handle.cancel()
            self._sweep_handle = None

    @property
    def idle_connections(self) -> int:
        """Connections open and waiting for a request."""
        return len(self._idle)

    def _sweep(self) -> None:
        self._sweep_handle = None
        now = asyncio.get_running_loop().time()
        for connection in [c for c in self._sending if c.waiting and c.deadline <= now]:
            connection.time_out()
        if self._sending:
            self._sweep_handle = asyncio.get_running_loop().call_later(SWEEP_INTERVAL_S, self._sweep)

    def _take_idle(self) -> _Connection | None:
        # Most recently used first: it is the least likely to be near the server's idle timeout.
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if connection.open and now - connection.idle_since < self.keepalive_idle_s:
                return connection
            connection.close()
        return None

    def _close_stale(self) -> None:
        # The oldest idle connections sit at the left: close those past their keep-alive, O(1) amortised.
        limit = time.monotonic() - self.keepalive_idle_s
        while self._idle and (not self._idle[0].open or self._idle[0].idle_since < limit):
            self._idle.popleft().close()

    async def _connect(self, deadline: float) -> _Connection:
        loop = asyncio.get_running_loop()
        timeout = max(0.0, min(self.connect_timeout_s, deadline - loop.time()))
        try:
            async with asyncio.timeout(timeout):
                _, protocol = await loop.create_connection(_Connection, self.host, self.port, ssl=self._ssl)
        except TimeoutError as error:
            if loop.time() >= deadline:
                raise ResponseTimeoutError("no connection within the request timeout") from error
            raise ConnectTimeoutError(
                f"no connection to {self.host}:{self.port} within {timeout:.0f} s"
            ) from error
        except OSError as error:
            raise ConnectFailedError(f"cannot connect to {self.host}:{self.port}: {error}") from error
        self.connections_opened += 1
        return protocol
