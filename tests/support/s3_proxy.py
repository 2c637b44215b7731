"""A fault-injecting HTTP proxy for S3 traffic, placed between a client (boto3, s3fs) and a real S3 server.

It listens on loopback only, reads each HTTP/1.1 request in full (Content-Length or chunked bodies; it
answers ``Expect: 100-continue`` itself), and then, per request, either forwards it unchanged to the
upstream server or injects one fault:

* ``500`` / ``503`` / ``409``: answers with a valid S3 XML error (``InternalError`` / ``SlowDown`` /
  ``ConditionalRequestConflict``) without forwarding;
* ``reset_before``: resets the client's connection without forwarding (nothing reached S3);
* ``reset_after``: forwards the request, reads S3's answer, then resets the client's connection instead of
  answering: the nasty case where a write happened and the client saw only an error, so its retry of a
  conditional ``PutObject`` meets ``412 PreconditionFailed``;
* ``truncate``: forwards the request, sends S3's headers and the first half of the body, then resets the
  connection (a download cut short mid-stream; without a body it behaves like ``reset_after``).

It can also leave chosen request headers out of everything it forwards (``drop_headers``): with
``if-none-match`` it stands in for an S3-compatible store that ignores conditional writes.

Faults come from a scripted queue first (``inject_next``, deterministic tests), then from seeded random
``rates``. Apart from faults, ``add_delay`` holds matching requests for some seconds before they are handled
(a slow S3: a test can tell from :class:`DelayRule` when a request is being held, and drive a run into the
stage that waits on it). The proxy counts what it injected and what it forwarded. It is bounded (connections, header
and body sizes) and ``stop()`` closes every socket and joins every thread. Test infrastructure, not
datagen code.
"""

from __future__ import annotations

import contextlib
import http.client
import random
import socket
import struct
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

FAULTS = ("500", "503", "409", "reset_before", "reset_after", "truncate")
MAX_CONNECTIONS = 64
MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
# Seconds an idle client connection or the upstream server may stay silent before the proxy gives up.
SOCKET_TIMEOUT_S = 30.0
# Seconds stop() waits for each connection thread.
JOIN_TIMEOUT_S = 5.0

ERROR_BODIES = {
    "409": (
        "Conflict",
        "ConditionalRequestConflict",
        "A conflicting conditional operation is currently in progress against this resource.",
    ),
    "500": ("Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
    "503": ("Service Unavailable", "SlowDown", "Please reduce your request rate."),
}
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te", "upgrade"}

RequestMatcher = Callable[[str, str], bool]


@dataclass
class DelayRule:
    """Holds requests matching ``method`` and ``path_contains`` for ``seconds`` (the first ``times`` only)."""

    seconds: float
    method: str | None = None
    path_contains: str = ""
    times: int | None = None
    hits: int = 0
    held_now: int = 0
    released: threading.Event = field(default_factory=threading.Event)

    def matches(self, method: str, path: str) -> bool:
        """Whether a request is held by this rule (while it has holds left)."""
        if self.released.is_set() or (self.times is not None and self.hits >= self.times):
            return False
        return (self.method is None or method == self.method) and self.path_contains in path

    def release(self) -> None:
        """Let every held request through now, and hold no more."""
        self.released.set()


@dataclass(frozen=True)
class SeenRequest:
    """One request as the proxy saw it, with the fault it got (``ok`` when forwarded untouched).

    ``access_key_id`` is the key id of the request's SigV4 ``Authorization`` header (never a secret).
    """

    method: str
    path: str
    fault: str
    access_key_id: str


class _Request:
    def __init__(self, method: str, target: str, version: str, headers: list[tuple[str, str]], body: bytes):
        self.method = method
        self.target = target
        self.version = version
        self.headers = headers
        self.body = body

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None


class _ClientGone(Exception):
    """The client closed its connection (between requests: normal keep-alive end)."""


class _Reader:
    """Buffered reads of an HTTP message from a socket, bounded."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise _ClientGone
        self.buffer += chunk

    def read_until(self, marker: bytes, limit: int) -> bytes:
        while marker not in self.buffer:
            if len(self.buffer) > limit:
                raise ValueError("HTTP head too large")
            self._fill()
        head, _, self.buffer = self.buffer.partition(marker)
        return head

    def read_exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            self._fill()
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data

    def read_chunked(self) -> bytes:
        body = bytearray()
        while True:
            size_line = self.read_until(b"\r\n", MAX_HEADER_BYTES).split(b";")[0].strip()
            size = int(size_line, 16)
            if size == 0:
                # Trailers (if any) end with an empty line.
                while self.read_until(b"\r\n", MAX_HEADER_BYTES):
                    pass
                return bytes(body)
            if len(body) + size > MAX_BODY_BYTES:
                raise ValueError("request body too large")
            body += self.read_exactly(size)
            self.read_exactly(2)


class S3FaultProxy:
    """A loopback HTTP proxy in front of an S3 server that injects 5xx answers and connection resets.

    Args:
        upstream: ``http://host:port`` of the real S3 server.
        rates: Probability of each fault (keys from ``FAULTS``) for requests without a scripted fault.
        seed: Seed of the fault choice, so a run repeats.
        drop_headers: Request headers (lower case) never forwarded: e.g. ``if-none-match``, to stand in for an
            S3-compatible store that ignores conditional writes and overwrites.
    """

    def __init__(
        self,
        upstream: str,
        *,
        rates: dict[str, float] | None = None,
        seed: int = 0,
        drop_headers: frozenset[str] = frozenset(),
    ) -> None:
        host_port = upstream.removeprefix("http://").rstrip("/")
        host, _, port = host_port.partition(":")
        self.upstream_host = host
        self.upstream_port = int(port)
        self.rates = dict(rates or {})
        self.drop_headers = frozenset(name.lower() for name in drop_headers)
        unknown = set(self.rates) - set(FAULTS)
        if unknown or sum(self.rates.values()) > 1.0:
            raise ValueError(f"rates must use {FAULTS} and sum to at most 1: {self.rates}")
        self.injected: Counter[str] = Counter()
        self.forwarded = 0
        self.seen: list[SeenRequest] = []
        self._random = random.Random(seed)
        self._scripted: list[tuple[str, RequestMatcher]] = []
        self._delays: list[DelayRule] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._threads: set[threading.Thread] = set()
        self._clients: set[socket.socket] = set()
        self._stopping = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self._port = int(self._listener.getsockname()[1])
        self._accept_thread = threading.Thread(target=self._accept_loop, name="s3-proxy-accept", daemon=True)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` to give the client as its endpoint."""
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> S3FaultProxy:
        """Start accepting connections."""
        self._accept_thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, close every connection, join every thread."""
        self._stopping.set()
        self.clear_delays()
        self._accept_thread.join(JOIN_TIMEOUT_S)
        self._listener.close()
        with self._lock:
            clients = list(self._clients)
            threads = list(self._threads)
        for client in clients:
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(JOIN_TIMEOUT_S)

    def __enter__(self) -> S3FaultProxy:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

    def set_rates(self, rates: dict[str, float]) -> None:
        """Change the random fault rates (e.g. to 0 while a test sets up or checks)."""
        with self._lock:
            self.rates = dict(rates)

    def inject_next(self, fault: str, *, method: str | None = None, path_contains: str = "") -> None:
        """Give the next request matching ``method`` and ``path_contains`` this fault (queued, in order)."""
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; use one of {FAULTS}")

        def matches(request_method: str, path: str) -> bool:
            return (method is None or request_method == method) and path_contains in path

        with self._lock:
            self._scripted.append((fault, matches))

    def add_delay(
        self, seconds: float, *, method: str | None = None, path_contains: str = "", times: int | None = None
    ) -> DelayRule:
        """Hold each request matching ``method`` and ``path_contains`` for ``seconds`` before handling it.

        Args:
            seconds: How long each matching request is held (then handled as usual).
            method: Only requests of this HTTP method (any when None).
            path_contains: Only requests whose path contains this.
            times: Hold only the first ``times`` matching requests (every one when None).

        Returns:
            The rule: its ``hits`` and ``held_now`` say what it held; ``release()`` ends it.
        """
        rule = DelayRule(seconds, method, path_contains, times)
        with self._lock:
            self._delays.append(rule)
        return rule

    def clear_delays(self) -> None:
        """Release every delay rule (held requests go through now)."""
        with self._lock:
            rules, self._delays = self._delays, []
        for rule in rules:
            rule.release()

    def _hold(self, method: str, path: str) -> None:
        with self._lock:
            rule = next((rule for rule in self._delays if rule.matches(method, path)), None)
            if rule is None:
                return
            rule.hits += 1
            rule.held_now += 1
        try:
            rule.released.wait(rule.seconds)
        finally:
            with self._lock:
                rule.held_now -= 1

    # --- serving --------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._slots.acquire(timeout=SOCKET_TIMEOUT_S):
                client.close()
                continue
            thread = threading.Thread(target=self._serve, args=(client,), name="s3-proxy-conn", daemon=True)
            with self._lock:
                self._clients.add(client)
                self._threads.add(thread)
            thread.start()

    def _serve(self, client: socket.socket) -> None:
        try:
            client.settimeout(SOCKET_TIMEOUT_S)
            reader = _Reader(client)
            while not self._stopping.is_set():
                request = self._read_request(client, reader)
                self._hold(request.method, request.target)
                fault = self._choose_fault(request.method, request.target)
                with self._lock:
                    self.seen.append(
                        SeenRequest(request.method, request.target, fault, _access_key_id(request))
                    )
                    if fault != "ok":
                        self.injected[fault] += 1
                if fault in ERROR_BODIES:
                    client.sendall(_error_response(fault, request))
                    continue
                if fault == "reset_before":
                    _reset(client)
                    return
                # A fresh upstream connection per request: a stale keep-alive connection would fail in a
                # way that looks like an injected fault but is not counted as one.
                upstream = http.client.HTTPConnection(
                    self.upstream_host, self.upstream_port, timeout=SOCKET_TIMEOUT_S
                )
                try:
                    response = _forward(upstream, request, self.drop_headers)
                finally:
                    upstream.close()
                with self._lock:
                    self.forwarded += 1
                if fault == "reset_after":
                    _reset(client)
                    return
                if fault == "truncate":
                    head, _, body = response.partition(b"\r\n\r\n")
                    with contextlib.suppress(OSError):
                        client.sendall(head + b"\r\n\r\n" + body[: len(body) // 2])
                    _reset(client)
                    return
                client.sendall(response)
        except (_ClientGone, OSError, ValueError, http.client.HTTPException):
            pass
        finally:
            with contextlib.suppress(OSError):
                client.close()
            with self._lock:
                self._clients.discard(client)
                self._threads.discard(threading.current_thread())
            self._slots.release()

    def _read_request(self, client: socket.socket, reader: _Reader) -> _Request:
        head = reader.read_until(b"\r\n\r\n", MAX_HEADER_BYTES).decode("latin-1")
        request_line, *header_lines = head.split("\r\n")
        method, target, version = request_line.split(" ", 2)
        headers = []
        for line in header_lines:
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
        request = _Request(method, target, version, headers, b"")
        if (request.header("expect") or "").lower() == "100-continue":
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        if (request.header("transfer-encoding") or "").lower() == "chunked":
            request.body = reader.read_chunked()
        else:
            length = int(request.header("content-length") or 0)
            if length > MAX_BODY_BYTES:
                raise ValueError("request body too large")
            request.body = reader.read_exactly(length) if length else b""
        return request

    def _choose_fault(self, method: str, path: str) -> str:
        with self._lock:
            for position, (fault, matches) in enumerate(self._scripted):
                if matches(method, path):
                    del self._scripted[position]
                    return fault
            draw = self._random.random()
            for fault in FAULTS:
                rate = self.rates.get(fault, 0.0)
                if draw < rate:
                    return fault
                draw -= rate
        return "ok"


def _forward(
    upstream: http.client.HTTPConnection, request: _Request, drop_headers: frozenset[str] = frozenset()
) -> bytes:
    """Send ``request`` upstream (less ``drop_headers``) and return the full response, re-framed with a length."""
    upstream.putrequest(request.method, request.target, skip_host=True, skip_accept_encoding=True)
    for name, value in request.headers:
        if name.lower() not in HOP_BY_HOP | drop_headers and name.lower() != "content-length":
            upstream.putheader(name, value)
    if request.body or request.method in {"PUT", "POST"}:
        upstream.putheader("Content-Length", str(len(request.body)))
    upstream.endheaders(request.body or None)
    response = upstream.getresponse()
    body = response.read()
    lines = [f"HTTP/1.1 {response.status} {response.reason}"]
    for name, value in response.getheaders():
        if name.lower() in HOP_BY_HOP or (name.lower() == "content-length" and request.method != "HEAD"):
            continue
        lines.append(f"{name}: {value}")
    if request.method != "HEAD":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _error_response(fault: str, request: _Request) -> bytes:
    """A valid S3 error answer (XML body, request id headers) for a 500 or 503 fault."""
    reason, code, message = ERROR_BODIES[fault]
    request_id = uuid.uuid4().hex[:16].upper()
    resource = request.target.split("?")[0]
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message><Resource>{resource}</Resource>"
        f"<RequestId>{request_id}</RequestId></Error>"
    ).encode()
    payload = b"" if request.method == "HEAD" else body
    head = (
        f"HTTP/1.1 {fault} {reason}\r\n"
        "Content-Type: application/xml\r\n"
        f"x-amz-request-id: {request_id}\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode("latin-1") + payload


def _access_key_id(request: _Request) -> str:
    authorization = request.header("authorization") or ""
    _, _, credential = authorization.partition("Credential=")
    return credential.split("/", 1)[0]


def _reset(client: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer gets a TCP RST, not an orderly FIN."""
    with contextlib.suppress(OSError):
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        client.close()
