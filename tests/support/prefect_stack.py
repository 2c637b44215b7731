"""A real Prefect stack for tests and scripts: `prefect server start` on a free loopback port, process workers.

Everything runs as separate processes in their own process groups (stopped with the group, never left
behind: the kernel also SIGTERMs the server and the workers when the test process dies, say an interrupted run),
with a private ``PREFECT_HOME`` so nothing touches the user's profile or database.

The server runs with basic authentication on, as docs/security.md sets it up: every client the stack starts
(CLI calls, workers, ``datagen deploy``, the flow runs, :attr:`PrefectStack.api`) sends the stack's auth string.
"""

from __future__ import annotations

import base64
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from flows.api_server import _PRCTL, _die_with_parent
from tests.support.prefect_db import seed_prefect_home

# `prefect server start` takes ~15 s here; on a loaded 2-core box much more.
SERVER_START_TIMEOUT_S = 180.0
STOP_GRACE_S = 10.0
# How often a worker asks the server for work (the default 10 s makes every test wait).
WORKER_QUERY_S = "1"
# Answers Prefect's own client asks again (its server answers 503 while its SQLite database is busy, seen under
# load on a request to create a flow run), how often, and the first pause (doubled each time).
API_RETRY_CODES = frozenset({429, 502, 503})
API_RETRIES = 5
API_RETRY_PAUSE_S = 0.5
# How often a test polls a flow run's state while it waits for its end.
FLOW_RUN_POLL_S = 0.5
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CRASHED", "CANCELLED"})
# Started in their own sessions (stopped by group), so they would outlive a killed test process: the kernel
# SIGTERMs them when the thread that started them dies.
DIE_WITH_PARENT = _die_with_parent if _PRCTL is not None else None

# Prefect's command line (server, workers, CLI calls), from this interpreter.
PREFECT = [sys.executable, "-m", "prefect"]

OFFLINE_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    # `prefect deployment run --watch` prints the run's logs only when the server streams them out.
    "PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true",
    "PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true",
}


def basic_auth_header(auth_string: str) -> dict[str, str]:
    """The ``Authorization`` header Prefect's client sends for ``PREFECT_API_AUTH_STRING``."""
    return {"Authorization": "Basic " + base64.b64encode(auth_string.encode()).decode()}


def _new_auth_string() -> str:
    return f"datagen-test:{secrets.token_urlsafe(16)}"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process's group, wait, SIGKILL what is left."""
    stop_groups([process])


def stop_groups(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process's group at once, wait up to :data:`STOP_GRACE_S` for all, SIGKILL what is left.

    All at once: a Prefect worker takes its grace period over SIGTERM, and one after another that adds up.
    """
    running = [process for process in processes if process.poll() is None]
    for process in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for process in running:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def copy_checkout(repo: Path, destination: Path) -> Path:
    """A stand-alone git checkout of the working tree at ``destination`` (tracked + untracked, not ignored).

    The copy gets one commit of its own, so ``datagen deploy`` versions it and the flow can check it.
    """
    files = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        source = repo / name.decode()
        if not source.is_file():  # deleted in the working tree
            continue
        target = destination / name.decode()
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    git = ["git", "-C", str(destination), "-c", "user.name=datagen-test", "-c", "user.email=test@localhost"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "snapshot of the working tree"], check=True)
    return destination


class RetryingClient(httpx.Client):
    """An HTTP client that sends a request again on a busy server's answer, as Prefect's own client does."""

    def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        """Send ``request``; on an answer in :data:`API_RETRY_CODES`, wait and send it again (bounded)."""
        attempt = 0
        while True:
            response = super().send(request, **kwargs)
            if response.status_code not in API_RETRY_CODES or attempt == API_RETRIES:
                return response
            response.close()
            time.sleep(API_RETRY_PAUSE_S * 2**attempt)
            attempt += 1


@dataclass
class PrefectStack:
    """A Prefect server plus the workers started on it (see :meth:`start`).

    ``server_env``: settings for the server process alone (its services' periods, say). ``auth_string``: the
    server's ``PREFECT_SERVER_API_AUTH_STRING``, sent by every client as ``PREFECT_API_AUTH_STRING``.
    ``ui_api_url``: where the UI tells the browser the API is (``PREFECT_UI_API_URL``; :attr:`api_url` if None).
    """

    home: Path
    port: int = field(default_factory=free_port)
    server_env: dict[str, str] = field(default_factory=dict)
    auth_string: str = field(default_factory=_new_auth_string)
    ui_api_url: str | None = None
    server: subprocess.Popen[bytes] | None = None
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[IO[bytes]] = field(default_factory=list)
    _api: RetryingClient | None = field(default=None, init=False, repr=False)

    @property
    def api_url(self) -> str:
        """The server's API URL."""
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def ui_url(self) -> str:
        """The server's UI URL."""
        return f"http://127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a process that talks to this server."""
        return {
            **os.environ,
            **OFFLINE_ENV,
            "PREFECT_HOME": str(self.home),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_API_AUTH_STRING": self.auth_string,
            **extra,
        }

    def client_settings(self) -> dict[Any, str]:
        """Prefect settings for an in-process client of this server (``temporary_settings(...)``)."""
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL

        return {PREFECT_API_URL: self.api_url, PREFECT_API_AUTH_STRING: self.auth_string}

    def _log(self, name: str) -> IO[bytes]:
        handle = (self.home / f"{name}.log").open("ab")
        self.logs.append(handle)
        return handle

    @property
    def api(self) -> httpx.Client:
        """One HTTP client on the API (paths relative to ``/api``), for a test's requests and polls.

        One client, not ``httpx.get`` per request: a new client builds its TLS context, ~20 ms of CPU a call,
        which a test polling every 0.2 s turns into a tenth of a core. It asks again when the server is busy
        (:class:`RetryingClient`), like the Prefect CLI these requests stand in for.
        """
        if self._api is None:
            self._api = RetryingClient(
                base_url=self.api_url, timeout=10, headers=basic_auth_header(self.auth_string)
            )
        return self._api

    def start(self) -> PrefectStack:
        """Start the server and wait until its API answers (:meth:`launch`, then :meth:`wait_ready`).

        Raises:
            RuntimeError: It exited or did not answer in time (the message quotes its log).
        """
        return self.launch().wait_ready()

    def launch(self) -> PrefectStack:
        """Start the server without waiting for it: the caller can prepare its checkout meanwhile."""
        seed_prefect_home(self.home)  # a migrated database: the server skips ~6 s of migrations
        env = self.env(**self.server_env)
        env.pop("PREFECT_API_URL")
        env["PREFECT_SERVER_API_AUTH_STRING"] = self.auth_string
        env["PREFECT_UI_API_URL"] = (
            self.ui_api_url or self.api_url
        )  # the UI's browser code calls the API here
        self.server = subprocess.Popen(
            [
                *PREFECT,
                "server",
                "start",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            env=env,
            stdout=self._log("server"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=DIE_WITH_PARENT,
        )
        return self

    def wait_ready(self) -> PrefectStack:
        """Wait until the launched server's API answers.

        Raises:
            RuntimeError: It exited or did not answer in time (the message quotes its log).
        """
        assert self.server is not None, "launch() the server first"
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                break
            try:
                if self.api.get("/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        tail = (self.home / "server.log").read_text(errors="replace")[-3000:]
        self.stop()
        raise RuntimeError(f"prefect server did not start on port {self.port}:\n{tail}")

    def stop_server(self) -> None:
        """Stop the server alone (its process group), as a restart or a crash does: the API is away.

        The workers and their flow runs go on; :meth:`start` brings the server back on the same port and database.
        """
        if self.server is not None:
            stop_group(self.server)
            self.server = None

    def create_work_queue(self, pool: str, name: str) -> None:
        """Create work queue ``name`` in ``pool`` through the API (what `prefect work-queue create` sends)."""
        response = self.api.post(f"/work_pools/{pool}/queues", json={"name": name})
        assert response.status_code == 201, response.text

    def create_flow_run(self, deployment: str, **parameters: Any) -> str:
        """Start a run of ``deployment`` (``flow/name``) through the API; returns its flow run id.

        The requests `prefect deployment run` (not watched) sends, without a Prefect CLI start (~1.5 CPU-s) and,
        for a watched run, the `--watch` process that polls it to its end. For tests whose subject is the flow
        on a worker; test_operations runs the README's `prefect deployment run --watch` itself.
        """
        found = self.api.get(f"/deployments/name/{deployment}")
        found.raise_for_status()
        created = self.api.post(
            f"/deployments/{found.json()['id']}/create_flow_run", json={"parameters": parameters}
        )
        assert created.status_code == 201, created.text
        return str(created.json()["id"])

    def flow_run(self, flow_run_id: str) -> dict[str, Any]:
        """The flow run as the API returns it."""
        response = self.api.get(f"/flow_runs/{flow_run_id}")
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    def wait_final(self, flow_run_id: str, timeout_s: float) -> str:
        """The flow run's final state type, waited for up to ``timeout_s`` (its last state if none)."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = str(self.flow_run(flow_run_id)["state_type"])
            if state in FINAL_STATES or time.monotonic() > deadline:
                return state
            time.sleep(FLOW_RUN_POLL_S)

    def flow_run_logs(self, flow_run_id: str, limit: int = 200) -> str:
        """The flow run's last ``limit`` log lines, oldest first: what `--watch` would have printed."""
        response = self.api.post(
            "/logs/filter",
            json={"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "TIMESTAMP_DESC", "limit": limit},
        )
        response.raise_for_status()
        return "\n".join(entry["message"] for entry in reversed(response.json()))

    def start_worker(
        self, pool: str, cwd: Path, name: str, work_queue: str | None = None, **env: str
    ) -> subprocess.Popen[bytes]:
        """Start ``prefect worker start --pool POOL --limit 1`` in ``cwd`` (not the checkout, on purpose).

        With ``work_queue`` the worker polls only that queue of the pool (one box of a multi-host run). A worker
        given its checkout (``PYTHONPATH``) logs with the checkout's ``deployments/logging.yml``, as the box's
        service does.
        """
        cwd.mkdir(parents=True, exist_ok=True)
        logging_settings = Path(env.get("PYTHONPATH", "")) / "deployments" / "logging.yml"
        if "PYTHONPATH" in env and logging_settings.is_file():
            env.setdefault("PREFECT_LOGGING_SETTINGS_PATH", str(logging_settings))
        queue = ["--work-queue", work_queue] if work_queue else []
        worker = subprocess.Popen(
            [
                *PREFECT,
                "worker",
                "start",
                "--pool",
                pool,
                "--type",
                "process",
                "--limit",
                "1",
                "--name",
                name,
                *queue,
            ],
            cwd=cwd,
            env=self.env(PREFECT_WORKER_QUERY_SECONDS=WORKER_QUERY_S, **env),
            stdout=self._log(name),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=DIE_WITH_PARENT,
        )
        self.workers.append(worker)
        return worker

    def prefect(
        self, *args: str, cwd: Path | None = None, timeout_s: float = 600.0, **env: str
    ) -> subprocess.CompletedProcess[str]:
        """Run the ``prefect`` CLI against this server."""
        return subprocess.run(
            [*PREFECT, *args],
            cwd=cwd,
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def stop(self) -> None:
        """Stop the workers, then the server (process groups), and close the logs."""
        stop_groups(self.workers)
        if self.server is not None:
            stop_group(self.server)
        if self._api is not None:
            self._api.close()
            self._api = None
        for handle in self.logs:
            handle.close()
