"""A loopback TCP relay that can go away for a while: refused connections, as when a service is down.

It relays bytes both ways between its clients and one upstream (e.g. moto's S3 server), without reading
them. :meth:`TcpOutage.go_down` closes its listening socket (a new connection is refused: the client gets
a TCP RST to its SYN) and resets every open connection; :meth:`TcpOutage.come_back` listens again on the
same port. So a client sees what a real outage of the service looks like from the network, not HTTP errors.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from types import TracebackType

CHUNK_BYTES = 65536
ACCEPT_POLL_S = 0.1
JOIN_TIMEOUT_S = 5.0


class TcpOutage:
    """The relay (a context manager). ``url`` is what clients use instead of ``upstream``.

    Args:
        upstream: ``http://host:port`` of the real service.
    """

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").rstrip("/").partition(":")
        self._upstream = (host, int(port))
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._stopping = threading.Event()
        self._down = threading.Event()
        # Connections relayed so far.
        self.accepted = 0
        self._listener: socket.socket | None = None
        self._port = 0
        self._listen()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="tcp-outage-accept", daemon=True
        )

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``: the same through every outage."""
        return f"http://127.0.0.1:{self._port}"

    def __enter__(self) -> TcpOutage:
        self._accept_thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stopping.set()
        self._accept_thread.join(JOIN_TIMEOUT_S)
        self._close_listener()
        self._reset_all()

    def go_down(self) -> None:
        """Refuse every new connection and reset every open one, until :meth:`come_back`."""
        with self._lock:
            self._down.set()
        self._close_listener()
        self._reset_all()

    def come_back(self) -> None:
        """Listen again on the same port."""
        self._listen()
        self._down.clear()

    def _listen(self) -> None:
        listener = socket.create_server(("127.0.0.1", self._port))  # SO_REUSEADDR: the same port again
        listener.settimeout(ACCEPT_POLL_S)
        self._port = int(listener.getsockname()[1])
        with self._lock:
            self._listener = listener

    def _close_listener(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    def _reset_all(self) -> None:
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _reset(sock)

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                listener = self._listener
            if listener is None:
                self._stopping.wait(ACCEPT_POLL_S)
                continue
            try:
                client, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            try:
                upstream = socket.create_connection(self._upstream)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                if self._down.is_set():
                    _reset(client)
                    _reset(upstream)
                    continue
                self._sockets.update((client, upstream))
                self.accepted += 1
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(
                    target=self._pump, args=(source, sink), name="tcp-outage-pump", daemon=True
                ).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(CHUNK_BYTES):
                sink.sendall(chunk)
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)
        except OSError:
            _reset(sink)
            _reset(source)
        finally:
            with self._lock:
                self._sockets.discard(source)
            with contextlib.suppress(OSError):
                source.close()


def _reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer gets a TCP RST, not an orderly FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
