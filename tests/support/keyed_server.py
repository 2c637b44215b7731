"""A server that takes its API key the way SGLang does: ``--config FILE`` naming a YAML file with ``api-key``.

Launched by a :class:`datagen.host.fleet.Fleet` in tests as an ``sglang`` plan's server. Like SGLang it logs its
arguments, key included, at start, and then requires the key on every path but ``/health`` and ``/metrics``
(:class:`tests.support.fault_server.FaultServer`). ``--crash`` exits after logging, with a traceback line.
"""

from __future__ import annotations

import argparse
import sys
import time

import yaml

from tests.support.fault_server import FaultServer


def main() -> None:
    """Parse SGLang-like arguments, log them, serve until killed."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config")
    parser.add_argument("--crash", action="store_true")
    args = parser.parse_args()
    api_key = None
    if args.config:
        with open(args.config) as handle:
            api_key = yaml.safe_load(handle).get("api-key")
    print(f"server_args=ServerArgs(host={args.host!r}, port={args.port}, api_key={api_key!r})", flush=True)
    if args.crash:
        print("Traceback (most recent call last):\n  RuntimeError: cannot start", flush=True)
        sys.exit(1)
    server = FaultServer(port=args.port)
    server.api_key = api_key
    server.start()
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
