"""What one pytest-xdist worker may use without colliding with the others: its index, its ports, its folders.

`make test` runs the suite on several workers (``pytest -n``); each is a separate process with its own
session fixtures. Tests that must bind a fixed port (a planned fleet starts servers from ``fleet.base_port``
up) take it through :func:`worker_port`, so two workers never plan the same ports. Outside xdist the index
is 0 and every port is the one written in the test.
"""

from __future__ import annotations

import os

# PYTEST_XDIST_WORKER is "gw0", "gw1", ... in a worker; unset in a plain `pytest` run.
WORKER_ID = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
WORKER_INDEX = int(WORKER_ID[2:]) if WORKER_ID.startswith("gw") and WORKER_ID[2:].isdigit() else 0
# Every fixed base in the suite lies in 30000-34999 (no two tests' ranges overlap there), and each worker
# moves the whole window by this much: worker k uses 30000 + 5000k up, so no worker's ports reach another's
# (a stride of 1000 let test_plan on gw1 search from test_fleet's gw0 range). Seven workers fit under 65535.
PORT_STRIDE = 5000


def worker_port(base: int) -> int:
    """``base`` moved into this worker's own range of ports."""
    return base + WORKER_INDEX * PORT_STRIDE
