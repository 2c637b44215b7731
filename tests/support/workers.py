"""What one pytest-xdist worker may use without colliding with the others: its index, its ports, its folders.

`make test` runs the suite on several workers (``pytest -n``); each is a separate process with its own
session fixtures. Tests that must bind a fixed port (a planned fleet starts servers from ``fleet.base_port``
up) take it through :func:`worker_port`, so two workers never plan the same ports. Outside xdist the index
is 0: worker 0's window.
"""

from __future__ import annotations

import os

# PYTEST_XDIST_WORKER is "gw0", "gw1", ... in a worker; unset in a plain `pytest` run.
WORKER_ID = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
WORKER_INDEX = int(WORKER_ID[2:]) if WORKER_ID.startswith("gw") and WORKER_ID[2:].isdigit() else 0
# Every fixed base in the suite lies in 30000-34999 (no two tests' ranges overlap there), and each worker
# moves the whole window by this much: worker k uses 10000 + 5000k up, so no worker's ports reach another's
# (a stride of 1000 let test_plan on gw1 search from test_fleet's gw0 range).
PORT_STRIDE = 5000
# Where worker 0's window starts. Below Linux's ephemeral range (32768-60999 by default), which the kernel
# hands to every outgoing connection and `bind(("", 0))`: a planned server on gw1's old 36500 once found its
# port taken by one (CI-style run, "address already in use"). Four workers' windows fit below 30000.
PORT_WINDOW_START = 10000
WRITTEN_WINDOW_START = 30000


def worker_port(base: int) -> int:
    """``base`` (written in 30000-34999) moved into this worker's own range of ports, below the ephemeral ones."""
    return base - WRITTEN_WINDOW_START + PORT_WINDOW_START + WORKER_INDEX * PORT_STRIDE
