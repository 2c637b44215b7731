"""A launched stand-in for an engine's server: it loads for a while, then binds its port the way uvicorn does.

``--load-s`` delays the bind (a model loading); ``--answer-s`` is how long each chat answer takes. A port
another program holds is logged as uvicorn logs it
(``[Errno 98] error while attempting to bind on address (...): address already in use``) and ends the process
with code 1. Once bound, a :class:`tests.support.fault_server.FaultServer` answers ``/health``, chat
completions, and ``/v1/models`` with ``--model``.
"""

from __future__ import annotations

import argparse
import sys
import time

from tests.support.fault_server import FaultPlan, FaultServer


def main() -> None:
    """Parse the arguments, load, bind or fail as uvicorn does, serve until killed."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--load-s", type=float, default=0.0)
    parser.add_argument("--model", default="none")
    parser.add_argument("--answer-s", type=float, default=0.0, help="Seconds each chat answer takes.")
    args = parser.parse_args()
    print(f"loading model={args.model} for {args.load_s}s", flush=True)
    time.sleep(args.load_s)
    server = FaultServer(FaultPlan(base_delay_s=args.answer_s), port=args.port)
    server.models = [args.model]
    try:
        server.start()
    except OSError as error:
        print(
            f"ERROR:    [Errno {error.errno}] error while attempting to bind on address "
            f"({args.host!r}, {args.port}): {(error.strerror or '').lower()}",
            flush=True,
        )
        sys.exit(1)
    print(f"serving on {server.url}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
