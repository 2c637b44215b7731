"""Real ``transformers serve --continuous-batching`` processes on CPU for integration tests.

Each server is its own process group (so SIGKILL of the group takes the whole server down, exactly as
a crash would), logs to a file, and is ready when ``GET /health`` answers 200 while the process lives.
A pool is meant to be session-scoped and shared: a test that kills a server calls
:meth:`TransformersServerPool.ensure_running` (or the next user does) to bring it back on the same port.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

READY_TIMEOUT_S = 120.0
READY_POLL_S = 0.25
STOP_GRACE_S = 10.0
# The first generation initialises the batching manager; paying it once at start keeps tests' timings honest.
WARMUP_TIMEOUT_S = 120.0
# Without an explicit cache size, continuous batching on CPU sizes its paged KV cache from *system*
# memory (~14 GiB per server even for the tiny model): two servers OOM a 23 GiB box. 256 blocks of 32
# tokens (8k tokens of cache) is plenty for short test generations.
CB_NUM_BLOCKS = 256
CB_BLOCK_SIZE_TOKENS = 32


def free_port() -> int:
    """A TCP port that is free right now on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TransformersServer:
    """One ``transformers serve`` process (group) on a fixed port."""

    def __init__(self, model_dir: Path, port: int, log_path: Path) -> None:
        self.model_dir = model_dir
        self.port = port
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The base URL."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def model(self) -> str:
        """The model name requests must carry (the path the server was started with)."""
        return str(self.model_dir)

    def argv(self) -> list[str]:
        """The command line."""
        return [
            # Launched as datagen's CPU engine launches it.
            sys.executable, "-m", "transformers.cli.transformers", "serve", "--continuous-batching",
            "--device", "cpu", "--host", "127.0.0.1", "--port", str(self.port),
            "--cb-num-blocks", str(CB_NUM_BLOCKS), "--cb-block-size", str(CB_BLOCK_SIZE_TOKENS),
            str(self.model_dir),
        ]  # fmt: skip

    def alive(self) -> bool:
        """Tell whether the process is running."""
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Launch in a new session (own process group); do not wait."""
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        # Two CPU servers share a small box: one thread each keeps them from fighting over cores.
        env.setdefault("OMP_NUM_THREADS", "1")
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns the handle
        try:
            self.process = subprocess.Popen(
                self.argv(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        finally:
            log.close()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Poll ``/health`` until 200, failing at once if the process exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"server on port {self.port} exited; log:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(READY_POLL_S)
        raise RuntimeError(
            f"server on port {self.port} not ready after {timeout_s}s; log:\n{self.log_tail()}"
        )

    def warm_up(self) -> None:
        """Send one short generation so the first real request does not pay the initialisation."""
        response = httpx.post(
            f"{self.url}/v1/chat/completions",
            json={"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=WARMUP_TIMEOUT_S,
        )
        response.raise_for_status()

    def kill(self) -> None:
        """SIGKILL the whole process group, as a crash would, and reap it."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(STOP_GRACE_S)

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL it after a grace period."""
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, lines: int = 40) -> str:
        """The end of the server log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


class TransformersServerPool:
    """N servers on the tiny model, started in parallel, restarted on demand.

    Args:
        model_dir: The model every server loads.
        count: How many servers.
        log_dir: Where each server's log goes.
    """

    def __init__(self, model_dir: Path, count: int, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.servers = [
            TransformersServer(model_dir, free_port(), log_dir / f"server-{index}.log")
            for index in range(count)
        ]

    @property
    def urls(self) -> list[str]:
        """Base URLs, in server order."""
        return [server.url for server in self.servers]

    @property
    def model(self) -> str:
        """The model name requests must carry."""
        return self.servers[0].model

    def liveness(self, url: str) -> bool:
        """Whether the process behind ``url`` is running (a Dispatcher liveness callback)."""
        return any(server.alive() for server in self.servers if server.url == url)

    def ensure_running(self) -> None:
        """Start every server that is not running, then wait for all of them and warm the new ones up."""
        started = [server for server in self.servers if not server.alive()]
        for server in started:
            server.start()
        for server in self.servers:
            server.wait_ready()
        for server in started:
            server.warm_up()

    def stop(self) -> None:
        """Stop every server."""
        for server in self.servers:
            server.stop()

    def __enter__(self) -> TransformersServerPool:
        try:
            self.ensure_running()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
