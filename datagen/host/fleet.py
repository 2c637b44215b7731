"""The single owner of the generation server processes: start, readiness, restart, stop.

:class:`Fleet` launches every server of a :class:`datagen.host.plan.ServerPlan` at once, each in its own
process group with its output in its own log file, and records them in a JSON pidfile registry
(``<state_dir>/servers.json``, :mod:`datagen.host.fleet_registry`) so another process (a Prefect state
hook, the next run after a crash) can stop them. Readiness means a live process with no fatal line in
its log, *and* the socket on its port its own, *and* HTTP 200 on the engine's health path, *and* the
planned model in its model list (:mod:`datagen.host.server_process`), under one deadline: a crashed server
is noticed at once, never after the whole timeout. A server whose port another program took after the plan
(a bind failure in its log, or a listener not of its process tree) is stopped and launched again on the next
free port, at start and on restarts; :meth:`Fleet.on_server_moved` tells the dispatcher, and
:meth:`Fleet.on_server_restarted` a multi-host run's parent (through its host part). When the plan has a router
(sglang-router), it is one more owned process, started once every server is ready; clients then use
:attr:`Fleet.client_urls` (the router) only.
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from datagen import processes
from datagen.errors import PlanError, ServerStartError
from datagen.host.fleet_registry import STOP_GRACE_S, fleet_pidfile, mark_live, mark_stopped
from datagen.host.plan import ServerPlan, ServerSpec
from datagen.host.ports import client_url, next_free_port
from datagen.host.server_process import (
    ServerLauncher,
    ServerProcess,
    failure_message,
    now,
    redact,
    write_pidfile,
)

logger = logging.getLogger(__name__)

# Moves one server may make off ports other programs took before its start counts as failed.
MAX_PORT_MOVES = 5
# A server moved off a taken port is still loading: it is stopped with this grace, not the fleet's.
MOVE_STOP_GRACE_S = 5.0


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
        self._servers = [ServerProcess(spec=spec) for spec in plan.servers]
        self._router = ServerProcess(spec=plan.router) if plan.router is not None else None
        # Every owned process: the servers, then the router (started last, stopped with the rest).
        self._owned = [*self._servers, *([self._router] if self._router else [])]
        self._launches = any(server.spec.launch is not None for server in self._owned)
        self._launcher = ServerLauncher(
            plan.engine,
            self.state_dir,
            self._api_key,
            self.health_path,
            plan.served_model_name,
            trust_env=not self._launches,
        )
        self._moved_listeners: list[Callable[[str, str], None]] = []
        self._restart_listeners: list[Callable[[str, str], None]] = []
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None
        self._monitor_stop = threading.Event()
        self._started = False

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
                failures = self._launcher.wait_ready(
                    self._servers,
                    self.ready_timeout_s,
                    self._stopping,
                    fail_fast=True,
                    relocate=self._relocate,
                )
                if not failures and self._router is not None:
                    # The router health-checks its workers at start: launch it once they answer.
                    self._route_to_current_urls()
                    self._launch(self._router)
                    failures = self._launcher.wait_ready(
                        [self._router], self.ready_timeout_s, self._stopping, relocate=self._relocate
                    )
            except BaseException:
                self.stop()
                raise
            if failures:
                self.stop()
                raise ServerStartError(
                    redact(failure_message(failures), self._api_key),
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
                server.close_log()
            if self._launches:
                with suppress(FileNotFoundError):
                    self.pidfile_path.unlink()
            for server in self._owned:
                with suppress(FileNotFoundError):
                    self._launcher.key_file(server.spec).unlink()
            self._started = False
            mark_stopped(self.pidfile_path)
            if groups:
                logger.info("fleet stopped servers=%d", len(groups))

    def close(self) -> None:
        """Stop the fleet and release the HTTP client."""
        self.stop()
        self._launcher.close()

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
            return self._launcher.healthy(server.spec.url)
        if server.spec.url != url.rstrip("/"):
            return False  # a URL it was moved off: another program listens there
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

    def on_server_moved(self, callback: Callable[[str, str], None]) -> None:
        """Call ``callback(old_url, new_url)`` whenever a server moves to another port on a restart.

        Moves while :meth:`start` runs need no callback: :attr:`urls` are final once it returns.
        """
        self._moved_listeners.append(callback)

    def on_server_restarted(self, callback: Callable[[str, str], None]) -> None:
        """Call ``callback(old_url, new_url)`` after every restart that made a server ready again.

        The URLs differ when the restart moved the server off a port another program took. A multi-host run's
        host part publishes each restart this way: the parent cannot see whose process listens on a remote
        port, so it trusts a server that went away again only once its host says it restarted it.
        """
        self._restart_listeners.append(callback)

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

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- internals -------------------------------------------------------------------------------

    def _server_by_url(self, url: str) -> ServerProcess:
        wanted = url.rstrip("/")
        for server in self._owned:
            if server.spec.url == wanted or wanted in server.former_urls:
                return server
        raise KeyError(f"{url} is not a server of this fleet ({', '.join(self.urls)})")

    def launch_argv(self, spec: ServerSpec) -> list[str]:
        """The argv a planned server is launched with (see :meth:`ServerLauncher.launch_argv`)."""
        return self._launcher.launch_argv(spec)

    def _launch(self, server: ServerProcess) -> None:
        self._launcher.launch(server)
        write_pidfile(self.pidfile_path, self._owned)

    def _restart(self, server: ServerProcess) -> bool:
        old = server.process
        if old is not None:
            code = old.poll()
            server.history.append(f"exited with code {code} at {now()}")
            # Children of a dead leader (engine workers holding GPU memory) would block the new server.
            processes.terminate_groups([old.pid], grace_s=0.0)
        server.restarts += 1
        logger.warning(
            "restarting server url=%s attempt=%d/%d",
            server.spec.url,
            server.restarts,
            self.max_restarts_per_server,
        )
        url_before = server.spec.url
        self._launch(server)
        failures = self._launcher.wait_ready(
            [server], self.ready_timeout_s, self._stopping, relocate=self._relocate
        )
        if not failures and server.spec.url != url_before:
            self._announce_move(server, url_before)
        if failures:
            logger.error("restart failed url=%s: %s", server.spec.url, failures[0][1])
            if server.process is not None:
                processes.terminate_groups([server.process.pid], grace_s=self.stop_grace_s)
                with suppress(subprocess.TimeoutExpired):
                    server.process.wait(timeout=processes.KILL_WAIT_S)
            return False
        logger.info("server restarted url=%s", server.spec.url)
        for callback in self._restart_listeners:
            try:
                callback(url_before, server.spec.url)
            except Exception:
                logger.exception("server restart listener failed old=%s new=%s", url_before, server.spec.url)
        return True

    def _relocate(self, server: ServerProcess, why: str) -> str | None:
        """Stop ``server`` and launch it again on the next free port; None when relaunched, else why not."""
        spec = server.spec
        if spec.launch is None:
            return why
        if server.port_moves >= MAX_PORT_MOVES:
            return f"its port was taken {server.port_moves + 1} times in a row; last: {why}"
        logger.warning("server port taken url=%s index=%d: %s", spec.url, spec.index, why)
        if server.process is not None:
            processes.terminate_groups([server.process.pid], grace_s=MOVE_STOP_GRACE_S)
            with suppress(subprocess.TimeoutExpired):
                server.process.wait(timeout=processes.KILL_WAIT_S)
        taken = {other.spec.port for other in self._owned}
        try:
            port = next_free_port(spec.host, spec.port, taken)
            launch = self._launcher.engine.launch_on_port(spec.launch, port)
        except (PlanError, ValueError) as error:
            return f"{why}; it cannot be moved: {error}"
        server.former_urls.append(spec.url)
        server.port_moves += 1
        server.spec = spec.model_copy(
            update={"port": port, "url": client_url(spec.host, port), "launch": launch}
        )
        logger.warning(
            "server moved index=%d from=%s to=%s move=%d/%d",
            spec.index,
            spec.url,
            server.spec.url,
            server.port_moves,
            MAX_PORT_MOVES,
        )
        self._launch(server)
        return None

    def _route_to_current_urls(self) -> None:
        """Point the router's argv at the servers' current URLs (some may have moved since the plan)."""
        router = self._router
        if router is None or router.spec.launch is None:
            return
        moved = {former: server.spec.url for server in self._servers for former in server.former_urls}
        argv = [moved.get(arg, arg) for arg in router.spec.launch.argv]
        if argv != router.spec.launch.argv:
            launch = router.spec.launch.model_copy(update={"argv": argv})
            router.spec = router.spec.model_copy(update={"launch": launch})

    def _announce_move(self, server: ServerProcess, old_url: str) -> None:
        """A restart moved ``server``: reroute the router (restarted by the monitor) or tell the listeners."""
        if self._router is not None and server is not self._router:
            self._route_to_current_urls()
            if self._router.process is not None:
                logger.warning(
                    "restarting the router: server %d moved to %s", server.spec.index, server.spec.url
                )
                processes.terminate_groups([self._router.process.pid], grace_s=self.stop_grace_s)
            return
        for callback in self._moved_listeners:
            try:
                callback(old_url, server.spec.url)
            except Exception:
                logger.exception("server move listener failed old=%s new=%s", old_url, server.spec.url)

    def _monitor_loop(self, interval_s: float) -> None:
        while not self._monitor_stop.wait(interval_s):
            try:
                restarted = self.ensure_running()
            except Exception:
                logger.exception("fleet monitor failed to restart servers")
                continue
            if restarted:
                logger.warning("monitor restarted servers urls=%s", ",".join(restarted))
