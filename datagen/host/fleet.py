"""The single owner of the generation server processes: start, readiness, restart, stop.

:class:`Fleet` launches every server of a :class:`datagen.host.plan.ServerPlan` at once, each in its own
process group with its output in its own log file, and records them in a JSON pidfile registry
(``<state_dir>/servers.json``, :mod:`datagen.host.fleet_registry`) so another process (a Prefect state
hook, the next run after a crash) can stop them. Readiness means HTTP 200
on the engine's health path *and* a live process *and* no fatal line in the log, all under one deadline:
a crashed server is noticed at once, never after the whole timeout. When the plan has a router
(sglang-router), it is one more owned process, started once every server is ready; clients then use
:attr:`Fleet.client_urls` (the router) only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import IO

import httpx

from datagen.engines import get_engine
from datagen.engines.base import LaunchCommand
from datagen.errors import ServerStartError
from datagen.host import processes
from datagen.host.fleet_registry import (
    STOP_GRACE_S,
    FleetRegistry,
    ServerRecord,
    fleet_pidfile,
    mark_live,
    mark_stopped,
    write_registry,
)
from datagen.host.plan import ServerPlan, ServerSpec

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.25
HEALTH_TIMEOUT_S = 5.0
LOG_TAIL_LINES = 40
# Startup logs are small; reading more than this from the end is never needed to spot a fatal line.
MAX_LOG_SCAN_BYTES = 4 * 1024 * 1024


@dataclass
class _Server:
    """Runtime state of one planned server (internal)."""

    spec: ServerSpec
    process: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = None
    log_offset: int = 0
    started_at: str = ""
    restarts: int = 0
    ready: bool = False
    gave_up: bool = False
    history: list[str] = field(default_factory=list)
    argv: list[str] = field(
        default_factory=list
    )  # as launched: the plan's argv plus the key file's arguments

    @property
    def pgid(self) -> int | None:
        # start_new_session makes every server the leader of its own group: pgid == pid.
        return self.process.pid if self.process is not None else None


class Fleet:
    """Owner of the server processes of one plan (context manager: ``with Fleet(plan, dir) as fleet:``).

    Args:
        plan: What to start.
        state_dir: Host-local folder for the pidfile registry (logs go where the plan says).
        ready_timeout_s: Deadline for all servers to become ready (also per restart).
        max_restarts_per_server: Restarts :meth:`ensure_running` may spend on each server.
        health_path: Readiness path; the plan's (from the engine) when None.
        stop_grace_s: Time between SIGTERM and SIGKILL when stopping.
        api_key: Key every launched server requires (bearer token); given to each server in a file only this
            user can read (the engine's :meth:`~datagen.engines.base.Engine.api_key_args`), never on its
            command line, and replaced by ``***`` in every server log line datagen quotes.

    """

    def __init__(
        self,
        plan: ServerPlan,
        state_dir: Path,
        *,
        ready_timeout_s: float = 900.0,
        max_restarts_per_server: int = 3,
        health_path: str | None = None,
        stop_grace_s: float = STOP_GRACE_S,
        api_key: str | None = None,
    ) -> None:
        self.plan = plan
        self.state_dir = Path(state_dir)
        self.ready_timeout_s = ready_timeout_s
        self.max_restarts_per_server = max_restarts_per_server
        self.health_path = health_path or plan.health_path
        self.stop_grace_s = stop_grace_s
        self._api_key = api_key or None
        self._servers = [_Server(spec=spec) for spec in plan.servers]
        self._router = _Server(spec=plan.router) if plan.router is not None else None
        # Every owned process: the servers, then the router (started last, stopped with the rest).
        self._owned = [*self._servers, *([self._router] if self._router else [])]
        self._launches = any(server.spec.launch is not None for server in self._owned)
        self._fatal_patterns = get_engine(plan.engine).fatal_log_patterns
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None
        self._monitor_stop = threading.Event()
        self._started = False
        self._client = httpx.Client(timeout=HEALTH_TIMEOUT_S, trust_env=not self._launches)

    # --- public API -----------------------------------------------------------------------------

    @property
    def pidfile_path(self) -> Path:
        """The JSON registry of this fleet's processes."""
        return fleet_pidfile(self.state_dir)

    @property
    def urls(self) -> list[str]:
        """Base URLs of every server, in plan order."""
        return [server.spec.url for server in self._servers]

    @property
    def client_urls(self) -> list[str]:
        """Where requests go: the router's URL when the plan has one, else every server's."""
        return [self._router.spec.url] if self._router is not None else self.urls

    def start(self) -> None:
        """Launch every server in parallel and wait until all are ready.

        Raises:
            ServerStartError: A server died, logged a fatal error, or was not ready by the deadline;
                every server is stopped first and the message quotes the failing server's log.

        """
        with self._lock:
            if self._started:
                return
            self._stopping.clear()
            self._started = True
            mark_live(self.pidfile_path)
            try:
                for server in self._servers:
                    if server.spec.launch is not None:
                        self._launch(server)
                failures = self._wait_ready(self._servers, self.ready_timeout_s)
                if not failures and self._router is not None:
                    # The router health-checks its workers at start: launch it once they answer.
                    self._launch(self._router)
                    failures = self._wait_ready([self._router], self.ready_timeout_s)
            except BaseException:
                self.stop()
                raise
            if failures:
                self.stop()
                raise ServerStartError(
                    redact(_failure_message(failures), self._api_key),
                    urls=[server.spec.url for server, _ in failures],
                )
            logger.info("fleet ready servers=%d urls=%s", len(self._servers), ",".join(self.urls))

    def stop(self) -> None:
        """Stop every server: SIGTERM to each process group, bounded wait, SIGKILL leftovers.

        Idempotent; also stops the monitor thread and removes the pidfile.
        """
        self._stopping.set()
        self.stop_monitor()
        with self._lock:
            groups = [(server, server.pgid) for server in self._owned if server.process is not None]
            processes.terminate_groups([pgid for _, pgid in groups if pgid is not None], self.stop_grace_s)
            for server, _ in groups:
                assert server.process is not None
                with suppress(subprocess.TimeoutExpired):
                    server.process.wait(timeout=processes.KILL_WAIT_S)
                server.process = None
                server.ready = False
                self._close_log(server)
            if self._launches:
                with suppress(FileNotFoundError):
                    self.pidfile_path.unlink()
            for server in self._owned:
                with suppress(FileNotFoundError):
                    self._key_file(server.spec).unlink()
            self._started = False
            mark_stopped(self.pidfile_path)
            if groups:
                logger.info("fleet stopped servers=%d", len(groups))

    def close(self) -> None:
        """Stop the fleet and release the HTTP client."""
        self.stop()
        self._client.close()

    def is_alive(self, url: str) -> bool:
        """Tell whether the server at ``url`` is up.

        For launched servers this is a cheap check of the process (the dispatcher calls it on every
        failed request); for external servers it is a health probe.

        Args:
            url: One of :attr:`urls`.

        Returns:
            Launched: the process runs and has been ready since its last (re)start, so a server that is
            restarting counts as down. External: the health path answers 200.

        Raises:
            KeyError: ``url`` is not a server of this fleet.

        """
        server = self._server_by_url(url)
        if server.spec.launch is None:
            return self._healthy(server.spec.url)
        return server.ready and server.process is not None and server.process.poll() is None

    def ensure_running(self) -> list[str]:
        """Restart servers whose process died, within ``max_restarts_per_server`` each.

        Each restart waits for readiness. A server whose restarts are used up is left down (logged).

        Returns:
            URLs of the servers restarted and ready again.

        """
        restarted: list[str] = []
        with self._lock:
            if not self._started or self._stopping.is_set():
                return restarted
            for server in self._owned:
                if server.spec.launch is None or server.gave_up or self._stopping.is_set():
                    continue
                if server.process is not None and server.process.poll() is None:
                    continue
                if server.restarts >= self.max_restarts_per_server:
                    server.gave_up = True
                    logger.error(
                        "server down, restarts used up url=%s restarts=%d log=%s",
                        server.spec.url,
                        server.restarts,
                        server.spec.log_path,
                    )
                    continue
                if self._restart(server):
                    restarted.append(server.spec.url)
        return restarted

    def start_monitor(self, interval_s: float = 5.0) -> None:
        """Call :meth:`ensure_running` every ``interval_s`` in a background thread until :meth:`stop`."""
        if self._monitor is not None and self._monitor.is_alive():
            return
        self._monitor_stop.clear()
        self._monitor = threading.Thread(
            target=self._monitor_loop, args=(interval_s,), name="datagen-fleet-monitor", daemon=True
        )
        self._monitor.start()

    def stop_monitor(self) -> None:
        """Stop the background monitor (if running) and wait for it."""
        self._monitor_stop.set()
        monitor = self._monitor
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join()
        self._monitor = None

    def restarts(self, url: str) -> int:
        """How many times the server at ``url`` was restarted."""
        return self._server_by_url(url).restarts

    def pid(self, url: str) -> int | None:
        """The pid (= process group id) of the server at ``url``; None when not running or external."""
        server = self._server_by_url(url)
        return server.process.pid if server.process is not None else None

    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # --- internals -------------------------------------------------------------------------------

    def _server_by_url(self, url: str) -> _Server:
        wanted = url.rstrip("/")
        for server in self._owned:
            if server.spec.url == wanted:
                return server
        raise KeyError(f"{url} is not a server of this fleet ({', '.join(self.urls)})")

    def _launch(self, server: _Server) -> None:
        launch = server.spec.launch
        assert launch is not None
        log_path = Path(
            server.spec.log_path or self.state_dir / "logs" / f"server-{server.spec.index:02d}.log"
        )
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._close_log(server)
        # Append so a restarted server's earlier output (why it died) stays in the same file.
        server.log_file = log_path.open("ab")
        argv = server.argv = self.launch_argv(server.spec)
        shown = LaunchCommand(argv=argv, env=launch.env).shell_line()
        banner = f"\n=== datagen: starting server {server.spec.index} at {_now()}: {shown}\n"
        server.log_file.write(banner.encode())
        server.log_file.flush()
        server.log_offset = server.log_file.tell()
        server.ready = False
        try:
            server.process = subprocess.Popen(
                argv,
                env={**os.environ, **launch.env},
                stdin=subprocess.DEVNULL,
                stdout=server.log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as error:
            raise ServerStartError(
                f"cannot launch server {server.spec.index} ({launch.argv[0]}): {error}; check that the "
                "engine is installed for this interpreter (datagen preflight checks it)",
                url=server.spec.url,
            ) from error
        server.started_at = _now()
        logger.info(
            "server launched index=%d pid=%d url=%s log=%s",
            server.spec.index,
            server.process.pid,
            server.spec.url,
            log_path,
        )
        self._write_pidfile()

    def _restart(self, server: _Server) -> bool:
        old = server.process
        if old is not None:
            code = old.poll()
            server.history.append(f"exited with code {code} at {_now()}")
            # Children of a dead leader (engine workers holding GPU memory) would block the new server.
            processes.terminate_groups([old.pid], grace_s=0.0)
        server.restarts += 1
        logger.warning(
            "restarting server url=%s attempt=%d/%d",
            server.spec.url,
            server.restarts,
            self.max_restarts_per_server,
        )
        self._launch(server)
        failures = self._wait_ready([server], self.ready_timeout_s)
        if failures:
            logger.error("restart failed url=%s: %s", server.spec.url, failures[0][1])
            if server.process is not None:
                processes.terminate_groups([server.process.pid], grace_s=self.stop_grace_s)
                with suppress(subprocess.TimeoutExpired):
                    server.process.wait(timeout=processes.KILL_WAIT_S)
            return False
        logger.info("server restarted url=%s", server.spec.url)
        return True

    def _wait_ready(self, servers: list[_Server], timeout_s: float) -> list[tuple[_Server, str]]:
        """Poll until every server is ready; return (server, reason) for those that failed."""
        deadline = time.monotonic() + timeout_s
        pending = list(servers)
        failures: list[tuple[_Server, str]] = []
        while pending:
            if self._stopping.is_set():
                failures += [(server, "the fleet is stopping") for server in pending]
                break
            for server in list(pending):
                reason = self._startup_failure(server)
                if reason is not None:
                    failures.append((server, reason))
                    pending.remove(server)
                elif self._healthy(server.spec.url):
                    server.ready = True
                    pending.remove(server)
                    logger.info("server ready url=%s", server.spec.url)
            if not pending:
                break
            if time.monotonic() >= deadline:
                failures += [
                    (server, f"not ready after {timeout_s:.0f}s (GET {self.health_path} never answered 200)")
                    for server in pending
                ]
                break
            # Fail fast: one dead server dooms the start, so do not wait for the others.
            if failures and servers is self._servers:
                break
            time.sleep(POLL_INTERVAL_S)
        return failures

    def _startup_failure(self, server: _Server) -> str | None:
        if server.spec.launch is None:
            return None
        process = server.process
        if process is None:
            return "not launched"
        code = process.poll()
        if code is not None:
            return f"process exited with code {code} before becoming ready"
        fatal = self._fatal_line(server)
        if fatal is not None:
            return f"fatal line in log: {fatal!r}"
        return None

    def launch_argv(self, spec: ServerSpec) -> list[str]:
        """The argv a planned server is launched with: its plan's, plus the engine's key-file arguments.

        With an API key, the key file is (re)written first, readable by this user only.

        Args:
            spec: A launched server of this fleet's plan.

        Returns:
            The argv.

        """
        assert spec.launch is not None
        return [*spec.launch.argv, *self._key_args(spec)]

    def _key_file(self, spec: ServerSpec) -> Path:
        return self.state_dir / "secrets" / f"server-{spec.index:02d}-key.yaml"

    def _key_args(self, spec: ServerSpec) -> list[str]:
        if self._api_key is None:
            return []
        key_file = self._key_file(spec)
        args = get_engine(self.plan.engine).api_key_args(str(key_file))
        if args is None:
            # Preflight refuses a key with such an engine off the loopback address; on it the key is moot.
            return []
        key_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with suppress(FileNotFoundError):
            key_file.unlink()
        descriptor = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(f"api-key: {json.dumps(self._api_key)}\n")  # a JSON string is a YAML scalar
        return args

    def _fatal_line(self, server: _Server) -> str | None:
        text = redact(_read_log(server.spec.log_path, server.log_offset), self._api_key)
        for pattern in self._fatal_patterns:
            match = pattern.search(text)
            if match is not None:
                line_end = text.find("\n", match.start())
                return text[match.start() : line_end if line_end >= 0 else None].strip()
        return None

    def _healthy(self, url: str) -> bool:
        try:
            response = self._client.get(url + self.health_path)
        except httpx.HTTPError:
            return False
        return response.status_code == httpx.codes.OK

    def _monitor_loop(self, interval_s: float) -> None:
        while not self._monitor_stop.wait(interval_s):
            try:
                restarted = self.ensure_running()
            except Exception:
                logger.exception("fleet monitor failed to restart servers")
                continue
            if restarted:
                logger.warning("monitor restarted servers urls=%s", ",".join(restarted))

    def _write_pidfile(self) -> None:
        records = [
            ServerRecord(
                index=server.spec.index,
                pid=server.process.pid,
                pgid=server.process.pid,
                port=server.spec.port,
                url=server.spec.url,
                cmd=list(server.argv),
                log_path=server.spec.log_path,
                started_at=server.started_at,
            )
            for server in self._owned
            if server.process is not None
        ]
        registry = FleetRegistry(
            owner_pid=os.getpid(), owner_start_ticks=processes.start_ticks(os.getpid()), servers=records
        )
        write_registry(self.pidfile_path, registry)

    @staticmethod
    def _close_log(server: _Server) -> None:
        if server.log_file is not None:
            server.log_file.close()
            server.log_file = None


# --- logs and messages ------------------------------------------------------------------------


def redact(text: str, secret: str | None) -> str:
    """``text`` with every occurrence of ``secret`` replaced by ``***`` (sglang logs its API key at start)."""
    return text.replace(secret, "***") if secret else text


def _read_log(log_path: str | None, offset: int) -> str:
    if not log_path:
        return ""
    try:
        with open(log_path, "rb") as log:
            size = log.seek(0, os.SEEK_END)
            log.seek(max(offset, size - MAX_LOG_SCAN_BYTES))
            return log.read().decode(errors="replace")
    except OSError:
        return ""


def log_tail(log_path: str | None, offset: int = 0, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a server log written since ``offset``."""
    text = _read_log(log_path, offset)
    # Progress bars redraw with carriage returns; keep only what the last redraw shows.
    cleaned = [re.sub(r".*\r(?!$)", "", line) for line in text.splitlines()]
    return "\n".join(cleaned[-lines:])


def _failure_message(failures: list[tuple[_Server, str]]) -> str:
    parts = []
    for server, reason in failures:
        tail = log_tail(server.spec.log_path, server.log_offset)
        parts.append(
            f"server {server.spec.index} ({server.spec.url}) failed to start: {reason}.\n"
            f"Log file: {server.spec.log_path}\n"
            f"--- last {LOG_TAIL_LINES} log lines ---\n{tail}\n---"
        )
    hint = "Fix the cause shown in the log (model path, memory, port) and start the run again."
    return (
        f"{len(failures)} server(s) did not become ready; all servers were stopped.\n"
        + "\n".join(parts)
        + f"\n{hint}"
    )


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
