"""One server process of a fleet: its launch (argv, API key file, log), its readiness, why its start failed.

:class:`datagen.host.fleet.Fleet` decides when servers start, restart, move and stop; this module does what
one launch takes. Each server runs in its own process group with its output appended to its own log file (a
restarted server's earlier output, why it died, stays in the file); its API key, when the run has one, is
written to a file only this user can read, never put on its command line, and replaced by ``***`` in every
log line datagen quotes.

Ready means ours and the planned model: for a launched server, the socket listening on its port belongs to
its process tree (``/proc/net/tcp{,6}`` against ``/proc/<pid>/fd``), and only then is ``/health`` asked;
for every server, once ``/health`` answers 200, the engine's model list names the planned model. A
listener that is not ours, or a bind failure in the log, means the port was taken after the plan: the
fleet moves the server to the next free port. A foreign listener is named in the log and never sent a
request.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Literal, NamedTuple

import httpx

from datagen import processes
from datagen.engines import get_engine
from datagen.engines.base import BIND_FAILURE_LOG_PATTERNS, LaunchCommand, compile_patterns
from datagen.errors import ServerStartError
from datagen.host.fleet_registry import FleetRegistry, ServerRecord, write_registry
from datagen.host.plan import ServerSpec
from datagen.host.ports import url_host

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.25
HEALTH_TIMEOUT_S = 5.0
LOG_TAIL_LINES = 40
# Startup logs are small; reading more than this from the end is never needed to spot a fatal line.
MAX_LOG_SCAN_BYTES = 4 * 1024 * 1024
BIND_FAILURE_PATTERNS = compile_patterns(BIND_FAILURE_LOG_PATTERNS)

# What one readiness poll of a server found: it is ready, not yet, will never be, or lost its port.
PollVerdict = Literal["ready", "waiting", "failed", "port_taken"]
# Moves a server to another port after its port was taken: None when relaunched, else why it cannot be.
Relocate = Callable[["ServerProcess", str], str | None]


class Listener(NamedTuple):
    """Who listens on a launched server's port: nobody yet, its own process tree, another program, or unknown."""

    verdict: Literal["none", "ours", "foreign", "unknown"]
    detail: str = ""


@dataclass
class ServerProcess:
    """Runtime state of one planned server (or the router)."""

    spec: ServerSpec
    process: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = None
    log_offset: int = 0
    started_at: str = ""
    restarts: int = 0
    ready: bool = False
    gave_up: bool = False
    history: list[str] = field(default_factory=list)
    # As launched: the plan's argv plus the key file's arguments.
    argv: list[str] = field(default_factory=list)
    # URLs it had before it was moved off ports another program took (oldest first), and how many moves.
    former_urls: list[str] = field(default_factory=list)
    port_moves: int = 0

    @property
    def pgid(self) -> int | None:
        """The process group (start_new_session makes every server its group's leader: pgid == pid)."""
        return self.process.pid if self.process is not None else None

    def close_log(self) -> None:
        """Close the log file this process writes to (if open)."""
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None


class ServerLauncher:
    """Launch the servers of one plan's engine and tell a failed start from a slow one.

    Args:
        engine: The plan's engine kind (its fatal log lines, API-key arguments and model list).
        state_dir: Host-local folder (key files under ``secrets/``, logs under ``logs/`` unless planned).
        api_key: Key every launched server requires; None for none.
        health_path: The readiness path.
        served_model: The model name requests carry: a ready server's model list must name it.
        trust_env: Whether health checks honour proxy variables (only for servers datagen did not start).

    """

    def __init__(
        self,
        engine: str,
        state_dir: Path,
        api_key: str | None,
        health_path: str,
        served_model: str,
        *,
        trust_env: bool,
    ) -> None:
        self.engine = get_engine(engine)
        self.state_dir = state_dir
        self.api_key = api_key
        self.health_path = health_path
        self.served_model = served_model
        self.fatal_patterns = self.engine.fatal_log_patterns
        # Proxies from the environment only for servers datagen did not start (they may sit behind one).
        self._client = httpx.Client(timeout=HEALTH_TIMEOUT_S, trust_env=trust_env)
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Servers whose model could not be checked (no model list): warned about once each.
        self._unchecked: set[str] = set()
        # The last read of the listening sockets: when, and what (None: no /proc here).
        self._listening: tuple[float, dict[int, list[tuple[processes.IPAddress, int]]] | None] | None = None

    def launch(self, server: ServerProcess) -> None:
        """Start ``server``'s process (its log appended to, a banner with the command first).

        Raises:
            ServerStartError: The program cannot be started (not installed for this interpreter).

        """
        launch = server.spec.launch
        assert launch is not None
        log_path = Path(
            server.spec.log_path or self.state_dir / "logs" / f"server-{server.spec.index:02d}.log"
        )
        log_path.parent.mkdir(parents=True, exist_ok=True)
        server.close_log()
        # Append so a restarted server's earlier output (why it died) stays in the same file.
        server.log_file = log_path.open("ab")
        argv = server.argv = self.launch_argv(server.spec)
        shown = LaunchCommand(argv=argv, env=launch.env).shell_line()
        banner = f"\n=== datagen: starting server {server.spec.index} at {now()}: {shown}\n"
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
        server.started_at = now()
        logger.info(
            "server launched index=%d pid=%d url=%s log=%s",
            server.spec.index,
            server.process.pid,
            server.spec.url,
            log_path,
        )

    def wait_ready(
        self,
        servers: list[ServerProcess],
        timeout_s: float,
        stopping: threading.Event,
        *,
        fail_fast: bool = False,
        relocate: Relocate | None = None,
    ) -> list[tuple[ServerProcess, str]]:
        """Poll until every server is ready; return (server, reason) for those that failed.

        Args:
            servers: The servers just launched.
            timeout_s: The deadline for each of them (from its launch; a moved server's from its move).
            stopping: Set when the fleet stops: the wait ends at once.
            fail_fast: Stop at the first failure (one dead server dooms the fleet's start).
            relocate: Moves a server whose port another program took; without it that is a failure.

        """
        deadlines = {id(server): time.monotonic() + timeout_s for server in servers}
        pending = list(servers)
        failures: list[tuple[ServerProcess, str]] = []
        while pending:
            if stopping.is_set():
                failures += [(server, "the fleet is stopping") for server in pending]
                break
            for server in list(pending):
                verdict, detail = self.poll(server)
                if verdict == "port_taken":
                    reason = relocate(server, detail) if relocate is not None else detail
                    if reason is None:
                        deadlines[id(server)] = time.monotonic() + timeout_s
                        continue
                    verdict, detail = "failed", reason
                if verdict == "failed":
                    failures.append((server, detail))
                    pending.remove(server)
                elif verdict == "ready":
                    server.ready = True
                    pending.remove(server)
                    logger.info("server ready url=%s model=%s", server.spec.url, self.served_model)
                elif time.monotonic() >= deadlines[id(server)]:
                    failures.append(
                        (
                            server,
                            f"not ready after {timeout_s:.0f}s (GET {self.health_path} never answered 200)",
                        )
                    )
                    pending.remove(server)
            if not pending:
                break
            # Fail fast: one dead server dooms the start, so do not wait for the others.
            if failures and fail_fast:
                break
            time.sleep(POLL_INTERVAL_S)
        return failures

    def poll(self, server: ServerProcess) -> tuple[PollVerdict, str]:
        """One readiness check of ``server`` (see the module docstring), with why when it is not ready."""
        if server.spec.launch is not None:
            bind_failure = self._log_match(server, BIND_FAILURE_PATTERNS)
            if bind_failure is not None:
                return "port_taken", f"it could not bind port {server.spec.port}: {bind_failure!r}"
            reason = self.startup_failure(server)
            if reason is not None:
                return "failed", reason
            listener = self.listener(server)
            if listener.verdict == "foreign":
                return "port_taken", listener.detail
            if listener.verdict == "none":
                return "waiting", ""
        if not self.healthy(server.spec.url):
            return "waiting", ""
        models = self.served_models(server.spec.url)
        if models is not None and self.served_model not in models:
            return "failed", wrong_model_message(models, self.served_model, self.engine.models_path)
        return "ready", ""

    def listener(self, server: ServerProcess) -> Listener:
        """Who listens on launched ``server``'s port (sockets that its URL does not reach are ignored)."""
        spec = server.spec
        if server.process is None:
            return Listener("unknown")
        return port_listener(
            server.process.pid,
            spec.port,
            lambda address: _reaches(address, spec),
            self._listening_sockets(),
            owner=f"server {spec.index}",
            secret=self.api_key,
        )

    def _listening_sockets(self) -> dict[int, list[tuple[processes.IPAddress, int]]] | None:
        """The host's listening sockets, read at most once per poll round (the table grows with connections)."""
        now = time.monotonic()
        if self._listening is None or now - self._listening[0] >= POLL_INTERVAL_S / 2:
            self._listening = (now, processes.listening_sockets())
        return self._listening[1]

    def served_models(self, url: str) -> list[str] | None:
        """The model names the server at ``url`` lists; None when it has no usable list (warned once)."""
        path = self.engine.models_path
        models = list_served_models(self._client, url + path, self._auth)
        if models is None and url not in self._unchecked:
            self._unchecked.add(url)
            logger.warning(
                "served model not checked url=%s: GET %s gave no model list; requests name model=%s",
                url,
                path,
                self.served_model,
            )
        return models

    def healthy(self, url: str) -> bool:
        """Whether ``url`` answers 200 on the health path now."""
        try:
            response = self._client.get(url + self.health_path)
        except httpx.HTTPError:
            return False
        return response.status_code == httpx.codes.OK

    def close(self) -> None:
        """Release the health-check client."""
        self._client.close()

    def startup_failure(self, server: ServerProcess) -> str | None:
        """Why ``server`` will never become ready (exited, or a fatal log line); None while it may."""
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
            spec: A launched server of the plan.

        Returns:
            The argv.

        """
        assert spec.launch is not None
        return [*spec.launch.argv, *self._key_args(spec)]

    def key_file(self, spec: ServerSpec) -> Path:
        """Where ``spec``'s API key file is written."""
        return self.state_dir / "secrets" / f"server-{spec.index:02d}-key.yaml"

    def _key_args(self, spec: ServerSpec) -> list[str]:
        if self.api_key is None:
            return []
        key_file = self.key_file(spec)
        args = self.engine.api_key_args(str(key_file))
        if args is None:
            # Preflight refuses a key with such an engine off the loopback address; on it the key is moot.
            return []
        key_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with suppress(FileNotFoundError):
            key_file.unlink()
        descriptor = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(f"api-key: {json.dumps(self.api_key)}\n")  # a JSON string is a YAML scalar
        return args

    def _fatal_line(self, server: ServerProcess) -> str | None:
        return self._log_match(server, self.fatal_patterns)

    def _log_match(self, server: ServerProcess, patterns: tuple[re.Pattern[str], ...]) -> str | None:
        """The first log line since the launch matching one of ``patterns`` (redacted); None if none does."""
        text = redact(_read_log(server.spec.log_path, server.log_offset), self.api_key)
        for pattern in patterns:
            match = pattern.search(text)
            if match is not None:
                line_end = text.find("\n", match.start())
                return text[match.start() : line_end if line_end >= 0 else None].strip()
        return None


def write_pidfile(path: Path, owned: list[ServerProcess]) -> None:
    """Record every running process of ``owned`` in the fleet's pidfile registry (for hooks and cleanup)."""
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
        for server in owned
        if server.process is not None
    ]
    registry = FleetRegistry(
        owner_pid=os.getpid(), owner_start_ticks=processes.start_ticks(os.getpid()), servers=records
    )
    write_registry(path, registry)


def port_listener(
    pid: int,
    port: int,
    reaches: Callable[[processes.IPAddress], bool],
    listening: dict[int, list[tuple[processes.IPAddress, int]]] | None,
    *,
    owner: str,
    secret: str | None = None,
) -> Listener:
    """Who listens on ``port``: nobody, the process tree of ``pid`` (ours), another program, or unknown.

    Args:
        pid: The launched server's process (its group and descendants count as it).
        port: The port it was told to bind.
        reaches: Whether a socket listening on an address receives what is sent to the server's URL.
        listening: :func:`datagen.processes.listening_sockets` (None where there is no ``/proc``).
        owner: How the log names the server (``server 3``).
        secret: The servers' API key, replaced by ``***`` where a command line is quoted.

    """
    if listening is None:
        return Listener("unknown")
    inodes = {inode for address, inode in listening.get(port, []) if reaches(address)}
    if not inodes:
        return Listener("none")
    foreign = processes.not_held_by(pid, inodes)
    if not foreign:
        return Listener("ours")
    holders = []
    for inode in sorted(foreign):
        holder = processes.socket_holder(inode)
        if holder is None:
            holders.append("pid unknown (a process this user cannot inspect)")
        else:
            holders.append(f"pid={holder} cmd={redact(processes.read_command_line(holder) or '?', secret)!r}")
    return Listener("foreign", f"another program listens on port {port} ({'; '.join(holders)}), not {owner}")


def list_served_models(client: httpx.Client, models_url: str, headers: dict[str, str]) -> list[str] | None:
    """The model names the engine's model list at ``models_url`` gives; None when there is no usable list."""
    try:
        response = client.get(models_url, headers=headers)
        entries = response.json()["data"] if response.status_code == httpx.codes.OK else None
        return [str(entry["id"]) for entry in entries] if isinstance(entries, list) else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def wrong_model_message(models: list[str], planned: str, models_path: str) -> str:
    """Why a server that lists ``models`` but not ``planned`` is not the one requests are meant for."""
    return (
        f"it serves {', '.join(repr(model) for model in models) or 'no model'}, not the planned "
        f"{planned!r} (GET {models_path}): another program or run holds this "
        "address; point the run at its own servers or set model.served_name to the name they serve"
    )


def _reaches(address: processes.IPAddress, spec: ServerSpec) -> bool:
    """Whether a socket listening on ``address`` receives what is sent to ``spec``'s URL."""
    try:
        targets = {ipaddress.ip_address(spec.host), ipaddress.ip_address(url_host(spec.url))}
    except ValueError:
        return True  # a host name: any listener on the port may be the one it resolves to
    return address.is_unspecified or address in targets


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


def failure_message(failures: list[tuple[ServerProcess, str]]) -> str:
    """Why servers did not start, each with its log's last lines and where the log is."""
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


def now() -> str:
    """The time now, ISO 8601 in UTC to the second (log banners, restart history)."""
    return datetime.now(UTC).isoformat(timespec="seconds")
