"""Ports and URLs of planned servers: free ports from ``fleet.base_port`` up, the URL clients connect to."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from datagen.errors import PlanError

# How far past a busy port the planner looks for a free one before giving up.
MAX_PORT_PROBES = 200
# Addresses that mean "every interface" are not connectable; clients use loopback instead.
WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


def port_is_free(host: str, port: int) -> bool:
    """Tell whether a server could bind ``host:port`` now.

    Args:
        host: Interface address.
        port: TCP port.

    Returns:
        True when a bind succeeds (the socket is closed again at once).

    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # Servers set SO_REUSEADDR too, so a port in TIME_WAIT counts as free, as it is for them.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def choose_ports(host: str, base_port: int, count: int, reasons: list[str]) -> list[int]:
    """Pick ``count`` free ports from ``base_port`` upwards, recording every skipped port in ``reasons``.

    Raises:
        PlanError: Not enough free ports within :data:`MAX_PORT_PROBES` of ``base_port``.

    """
    ports: list[int] = []
    candidate = base_port
    while len(ports) < count:
        if candidate >= base_port + MAX_PORT_PROBES or candidate > 65535:
            raise PlanError(
                f"found only {len(ports)} of {count} free ports on {host} in "
                f"{base_port}-{candidate - 1}; free some ports or set fleet.base_port elsewhere",
                host=host,
                base_port=base_port,
            )
        if port_is_free(host, candidate):
            ports.append(candidate)
        else:
            reasons.append(f"port {candidate} on {host} is in use: skipped")
        candidate += 1
    return ports


def next_free_port(host: str, after: int, avoid: set[int]) -> int:
    """The first port above ``after`` that is free now and not in ``avoid`` (the fleet's other ports).

    Raises:
        PlanError: None within :data:`MAX_PORT_PROBES` of ``after``.

    """
    for candidate in range(after + 1, min(after + 1 + MAX_PORT_PROBES, 65536)):
        if candidate not in avoid and port_is_free(host, candidate):
            return candidate
    raise PlanError(
        f"no free port on {host} in {after + 1}-{after + MAX_PORT_PROBES} to move a server to; free some ports "
        "or set fleet.base_port elsewhere",
        host=host,
        base_port=after,
    )


def client_url(host: str, port: int) -> str:
    """The base URL clients use for a server bound to ``host:port``."""
    connect_host = "127.0.0.1" if host in WILDCARD_HOSTS else host
    if ":" in connect_host:
        connect_host = f"[{connect_host}]"
    return f"http://{connect_host}:{port}"


def url_host(url: str) -> str:
    """The host of a server URL (loopback when it names none)."""
    return urlsplit(url).hostname or "127.0.0.1"


def url_port(url: str) -> int:
    """The port of a server URL (the scheme's default when it names none)."""
    parts = urlsplit(url)
    if parts.port is not None:
        return parts.port
    return 443 if parts.scheme == "https" else 80
