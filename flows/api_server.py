"""The temporary Prefect API server of a `datagen run` on a host without a configured one, owned by us.

Without ``PREFECT_API_URL`` Prefect starts a temporary API server as a plain child process: in a terminal,
Ctrl-C reaches it with the rest of the process group, it dies first, and the interrupted run then spends
minutes retrying ``ws://127.0.0.1:.../events`` before it can exit. Here the same server (Prefect 3.9's own
recipe: ``uvicorn --factory prefect.server.api.server:create_app``, see
``prefect.server.api.server.SubprocessASGIServer``) is started in its own session, so a signal to the
terminal's process group never reaches it, and it is stopped last: after the flow returned or raised and
Prefect's log and event workers have drained. It also dies with this process (``PR_SET_PDEATHSIG``) if
this process is killed outright. It requires an auth string only this process holds (set as
``PREFECT_API_AUTH_STRING`` here for the block): another user of the box cannot read the run or start one on it
over loopback, and a ``PREFECT_SERVER_API_AUTH_STRING`` the shell exports for a shared server is not inherited.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger(__name__)

# The server imports Prefect and migrates its SQLite database before it answers: ~8-12 s on a 2-core box,
# more under load (Prefect's own default of 20 s was seen to run out).
API_START_TIMEOUT_S = 120.0
API_HEALTH_POLL_S = 0.2
# A terminated server finishes its lifespan shutdown within a second or two; then it is killed.
API_STOP_TIMEOUT_S = 5.0
# How long Prefect's log and event workers may take to send what they hold before the server stops.
WORKER_DRAIN_TIMEOUT_S = 5.0
# The temporary server's own auth string (random bytes, URL-safe text): as strong as the README's shared one.
AUTH_STRING_BYTES = 24
# prctl(2) option: the signal the kernel sends the child when its parent thread dies.
PR_SET_PDEATHSIG = 1


def _libc_prctl() -> Any:
    """The C library's ``prctl``, looked up before any fork (a lookup in the forked child could deadlock)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl() if sys.platform == "linux" else None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask the kernel to SIGTERM the server when the thread that started it dies."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class LocalApiServer:
    """One Prefect API server process in its own session, started and stopped by this object.

    Args:
        log_path: Where the server's output goes.
        start_timeout_s: How long to wait for ``/api/health``.
    """

    def __init__(self, log_path: Path, start_timeout_s: float = API_START_TIMEOUT_S) -> None:
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.port = _free_port()
        # Only this process knows it: other users of the box cannot read or start runs on its server, and an
        # auth string the shell exports for a shared server (PREFECT_SERVER_API_AUTH_STRING) is not inherited.
        self.auth_string = secrets.token_urlsafe(AUTH_STRING_BYTES)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def api_url(self) -> str:
        """The API URL clients use."""
        return f"http://127.0.0.1:{self.port}/api"

    def spawn(self, *, with_settings: bool = True) -> None:
        """Start the server process without waiting for it (idempotent).

        Args:
            with_settings: Pass this process's Prefect settings on (imports Prefect). Without, the server
                reads the same environment and profile itself: what :func:`spawn_early` does before this
                process has imported Prefect, so the two boot at once.

        """
        if self.process is not None:
            return
        env = {
            **os.environ,
            # What Prefect's own temporary server runs with: no UI, ephemeral-server behaviour.
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
        }
        if with_settings:
            from prefect.settings import get_current_settings

            env.update(get_current_settings().to_environment_variables(exclude_unset=True))
        env["PREFECT_SERVER_API_AUTH_STRING"] = self.auth_string
        spec = importlib.util.find_spec("prefect")
        assert spec is not None and spec.submodule_search_locations
        argv = [
            sys.executable,
            "-m",
            "uvicorn",
            "--app-dir",
            str(Path(next(iter(spec.submodule_search_locations))).parent),
            "--factory",
            "prefect.server.api.server:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "error",
            "--lifespan",
            "on",
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent if _PRCTL is not None else None,
            )
        logger.info("prefect api server starting pid=%d url=%s", self.process.pid, self.api_url)

    def start(self) -> str:
        """Start the server (unless :meth:`spawn` did) and wait until it answers; return its API URL.

        Raises:
            RuntimeError: The server exited or did not answer within ``start_timeout_s``.
        """
        self.spawn()
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"the temporary Prefect API server exited with code {self.process.returncode}; "
                        f"see {self.log_path}, or set PREFECT_API_URL to a running `prefect server start`"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.api_url}/health").status_code == httpx.codes.OK:
                        return self.api_url
                time.sleep(API_HEALTH_POLL_S)
        self.stop()
        raise RuntimeError(
            f"the temporary Prefect API server did not answer within {self.start_timeout_s:.0f}s; see "
            f"{self.log_path}, or set PREFECT_API_URL to a running `prefect server start`"
        )

    def stop(self) -> None:
        """Stop the server's process group: SIGTERM, then SIGKILL after a grace period (idempotent)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(API_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def drain_prefect_workers() -> None:
    """Send what Prefect's log and event workers still hold, while the API server still runs."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=WORKER_DRAIN_TIMEOUT_S)
        except Exception as error:  # a log line lost is not worth failing the run's exit
            logger.debug("prefect worker drain failed worker=%s error=%s", worker.__name__, error)


def spawn_early(log_dir: Path) -> LocalApiServer | None:
    """Start booting a temporary API server now, before Prefect is imported here, unless the environment names one.

    Booting the server (its imports and database) takes seconds, and so does importing Prefect in this
    process: started first, the two overlap. :func:`prefect_api` then uses it, or stops it when Prefect's
    settings name an API after all (a profile's URL).
    """
    if os.environ.get("PREFECT_API_URL"):
        return None
    server = LocalApiServer(log_dir / f"prefect-api-{os.getpid()}.log")
    server.spawn(with_settings=False)
    return server


def _silence_prefect_workers() -> None:
    """Keep what Prefect's log and event workers could not send from printing once the temporary server stops.

    A loaded host can cut the drain short; what is left has nowhere to go once the server stops (the log lines
    are in the run's own log file). Without this the log worker writes "--- Error logging to API ---" and the
    event worker logs "Unable to connect" / "EventsWorker failed with N pending items" at interpreter exit,
    after the run's last line.
    """
    logging.raiseExceptions = False
    names = ["prefect", *[name for name in logging.root.manager.loggerDict if name.startswith("prefect.")]]
    for name in names:
        silenced = logging.getLogger(name)
        silenced.setLevel(logging.CRITICAL + 1)
        silenced.disabled = True  # Prefect's internal loggers ignore levels (their own isEnabledFor)


@contextlib.contextmanager
def prefect_api(log_dir: Path, early: LocalApiServer | None = None) -> Iterator[str | None]:
    """Use the configured Prefect API, or own a temporary one for the duration of the block.

    With ``PREFECT_API_URL`` set (environment or profile) nothing is started and the URL is yielded. Else a
    :class:`LocalApiServer` runs for the block: this process's Prefect settings point at it, and on the way
    out Prefect's workers drain first, then the server stops, whatever ended the block.

    Args:
        log_dir: Folder for the temporary server's log.
        early: A server :func:`spawn_early` started; used instead of a new one (stopped if an API is set).

    Yields:
        The API URL in use (None only if Prefect is left to its own ephemeral mode).
    """
    from prefect.context import refresh_global_settings_context
    from prefect.settings import get_current_settings

    # Set while this process runs against its own temporary server: what that server keeps (concurrency leases
    # among it) lives only as long as this process.
    from tasks.run_lease import TEMPORARY_API_ENV

    configured = get_current_settings().api.url
    if configured:
        if early is not None:
            early.stop()
        try:
            yield configured
        finally:
            drain_prefect_workers()
        return
    server = early or LocalApiServer(log_dir / f"prefect-api-{os.getpid()}.log")
    names = ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", TEMPORARY_API_ENV)
    previous = {name: os.environ.get(name) for name in names}
    try:
        os.environ["PREFECT_API_URL"] = server.start()
        os.environ["PREFECT_API_AUTH_STRING"] = server.auth_string
        os.environ[TEMPORARY_API_ENV] = server.api_url
        refresh_global_settings_context()
        yield server.api_url
    finally:
        try:
            drain_prefect_workers()
        finally:
            _silence_prefect_workers()
            server.stop()
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            refresh_global_settings_context()
