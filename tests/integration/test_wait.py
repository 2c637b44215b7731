"""`datagen wait <flow run>`: its exit code is the run's final state, whatever the API does meanwhile.

Against Prefect's real API (the test harness): a flow run that Completed gives exit 0, one that Failed exit 1,
an unknown id exit 2. Against an HTTP server standing in for an API that blips (not listening at first, then
503, then answering): the wait goes on through the outage, says so once, and ends with the run's state.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _wait(api_url: str, flow_run_id: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": api_url}
    return subprocess.run(
        [sys.executable, "-m", "flows.cli_entry", "wait", flow_run_id, "--poll-s", "0.2", *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_exit_code_is_the_flow_runs_final_state(prefect_api: str) -> None:
    from prefect import flow
    from prefect.context import FlowRunContext

    seen: dict[str, str] = {}

    @flow(name="wait-target")
    def target(fail: bool) -> None:
        context = FlowRunContext.get()
        assert context is not None and context.flow_run is not None
        seen["failed" if fail else "completed"] = str(context.flow_run.id)
        if fail:
            raise RuntimeError("this run fails on purpose")

    target(False)
    with pytest.raises(RuntimeError):
        target(True)

    completed = _wait(prefect_api, seen["completed"])
    assert completed.returncode == 0 and "Completed" in completed.stdout, completed.stdout + completed.stderr
    failed = _wait(prefect_api, seen["failed"])
    assert failed.returncode == 1 and "ended Failed" in failed.stderr, failed.stdout + failed.stderr
    unknown = _wait(prefect_api, str(uuid.uuid4()))
    assert unknown.returncode == 2, unknown.stdout + unknown.stderr


class _BlippingApi(BaseHTTPRequestHandler):
    """Answers 503 ``unavailable`` times, then RUNNING ``running`` times, then COMPLETED."""

    calls = 0
    unavailable = 3
    running = 3

    def do_GET(self) -> None:
        cls = type(self)
        cls.calls += 1
        if cls.calls <= cls.unavailable:
            self.send_response(503)
            self.end_headers()
            return
        state = "RUNNING" if cls.calls <= cls.unavailable + cls.running else "COMPLETED"
        body: dict[str, Any] = {"name": "expand-night", "state": {"type": state, "name": state.title()}}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def test_an_api_that_blips_is_waited_out_and_only_the_runs_end_decides() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    api_url = f"http://127.0.0.1:{port}/api"
    result: dict[str, subprocess.CompletedProcess[str]] = {}
    waiter = threading.Thread(target=lambda: result.setdefault("wait", _wait(api_url, str(uuid.uuid4()))))
    waiter.start()
    time.sleep(1.5)  # nothing listens yet: connections are refused
    server = ThreadingHTTPServer(("127.0.0.1", port), _BlippingApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        waiter.join(60)
    finally:
        server.shutdown()
        server.server_close()
    done = result["wait"]
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("Prefect API not answering") == 1, done.stdout
    assert "answering again" in done.stdout and "ended Completed" in done.stdout, done.stdout
