"""Drive a real `datagen run` into one of its states from outside, and check what is left when it ends.

Test infrastructure, not datagen code. Every slowness is real and comes from outside the product:

* :class:`CliRun`: ``python -m flows.cli_entry run --config X --run-id R`` in its own process group (a shell
  job), its output read line by line; it knows the run's processes (every descendant, the CLI's temporary
  Prefect API server included) so a test can check that none is left.
* :class:`Trainer`: the stand-in trainer (:mod:`datagen.host.standin_trainer`) with an events file that
  counts its starts and the stop signals it received, across the restarts the runs make.
* :class:`LockHolder`: another holder of the box's GPU lock file (``$DATAGEN_LOCK_DIR/<name>.lock``).
* :func:`write_fake_nvidia_smi`: an ``nvidia-smi`` early on ``PATH`` that sleeps on the probe's GPU query,
  then prints a recorded host from ``tests/fixtures/probe``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from datagen.processes import is_running

REPO = Path(__file__).resolve().parents[2]
PROBE_FIXTURES = REPO / "tests" / "fixtures" / "probe"
STAGE = re.compile(r"stage=([a-z-]+)")
# How often a waiting test re-reads the process table (every /proc/*/stat, ~2-6 ms of CPU each time): a run's
# lines are checked every 50 ms, its processes every 250 ms, and once more right before any signal is sent.
PROCESS_SCAN_INTERVAL_S = 0.25


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process now."""
    table: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            table[int(entry.name)] = (int(fields[1]), fields[0])
    return table


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, their children...)."""
    children: dict[int, list[int]] = {}
    for child, (parent, _) in process_table().items():
        children.setdefault(parent, []).append(child)
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone): the product's own check."""
    return is_running(pid)


def processes_mentioning(text: str) -> list[tuple[int, str]]:
    """Live processes whose command line contains ``text``: (pid, command line)."""
    found = []
    needle = text.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes()
            if needle in argv and alive(int(entry.name)):
                found.append((int(entry.name), argv.replace(b"\0", b" ").decode(errors="replace")))
    return found


class CliRun:
    """One ``datagen run`` process (its own process group), its output and its processes.

    Args:
        config: The run config file.
        run_id: The run id (``--run-id``); None for a series' next run (``datagen run --config X`` alone).
        env: The process's environment.
        transcript: File the output is copied to (appended), for a failing test's message.
        cwd: Where it runs: ``python -m`` imports the code of this checkout first.
    """

    def __init__(
        self, config: Path, run_id: str | None, env: dict[str, str], transcript: Path, cwd: Path = REPO
    ) -> None:
        self.command = [sys.executable, "-m", "flows.cli_entry", "run", "--config", str(config)]
        self.command += ["--run-id", run_id] if run_id else []
        self.transcript = transcript
        self.lines: list[tuple[float, str]] = []
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            self.command,
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group, like a shell job: signals go to the group
        )
        self.pids: set[int] = set()
        self._scanned = 0.0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        with self.transcript.open("a") as copy:
            copy.write(f"\n===== {' '.join(self.command)}\n")
            for line in iter(self.process.stdout.readline, ""):
                self.lines.append((time.monotonic(), line))
                copy.write(line)
                copy.flush()

    @property
    def pid(self) -> int:
        """The CLI's pid (= its process group id)."""
        return self.process.pid

    @property
    def text(self) -> str:
        """Everything it printed so far."""
        return "".join(line for _, line in list(self.lines))

    def tail(self, chars: int = 6000) -> str:
        """The end of its output, for assertion messages."""
        return self.text[-chars:]

    def flow_began(self) -> float:
        """When (monotonic) the run printed that its flow run began; its start when it never did."""
        for seen, line in list(self.lines):
            if "Beginning flow run" in line:
                return seen
        return self.started

    def stages(self) -> list[str]:
        """The ``stage=<name>`` markers it logged, in order."""
        return [match.group(1) for _, line in list(self.lines) for match in STAGE.finditer(line)]

    def remember_processes(self) -> set[int]:
        """Add the run's current processes (every descendant) to :attr:`pids`; returns them."""
        if self.process.poll() is None:
            self.pids |= descendants(self.pid)
            self._scanned = time.monotonic()
        return self.pids

    def _remember_processes_now_and_then(self) -> None:
        """:meth:`remember_processes` at most every :data:`PROCESS_SCAN_INTERVAL_S` (for polling loops)."""
        if time.monotonic() - self._scanned >= PROCESS_SCAN_INTERVAL_S:
            self.remember_processes()

    def wait_for(self, pattern: str, timeout_s: float, *, since: int = 0) -> str:
        """Block until a line (from line ``since`` on) matches ``pattern``; remember the processes meanwhile.

        Raises:
            AssertionError: The run exited first, or ``timeout_s`` passed.
        """
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        while True:
            for _, line in list(self.lines)[since:]:
                if regex.search(line):
                    self.remember_processes()
                    return line
            self._remember_processes_now_and_then()
            assert self.process.poll() is None or self._reader.is_alive(), (
                f"the run exited ({self.process.returncode}) before logging {pattern!r}:\n{self.tail()}"
            )
            assert time.monotonic() < deadline, (
                f"no line matching {pattern!r} in {timeout_s:.0f}s:\n{self.tail()}"
            )
            time.sleep(0.05)

    def wait_until(self, predicate: Any, what: str, timeout_s: float) -> None:
        """Block until ``predicate()`` is true while the run lives; remember its processes meanwhile."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            self._remember_processes_now_and_then()
            assert self.process.poll() is None, f"the run exited before {what}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"never {what} in {timeout_s:.0f}s:\n{self.tail()}"
            time.sleep(0.05)
        self.remember_processes()

    def send(self, signum: int) -> float:
        """Send ``signum`` to the whole process group; returns when (monotonic)."""
        self.remember_processes()
        sent = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signum)
        return sent

    def wait(self, timeout_s: float) -> int | None:
        """The exit code within ``timeout_s``; None if it still runs."""
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(10)
        return code

    def kill(self) -> None:
        """SIGKILL the process group and every process of the run still alive (cleanup)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        self._reader.join(10)

    def left_running(self, grace_s: float = 0.0) -> list[int]:
        """The run's remembered processes still alive (after up to ``grace_s`` for them to go)."""
        deadline = time.monotonic() + grace_s
        while True:
            left = sorted(pid for pid in self.pids if alive(pid))
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.1)


def describe(pids: list[int]) -> str:
    """One line per pid: its command line."""
    lines = []
    for pid in pids:
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            lines.append(f"{pid}: {argv}")
    return "\n".join(lines)


class Trainer:
    """The stand-in trainer under a pidfile, counting its starts and the stop signals it got (events file).

    Args:
        folder: Where its pidfile, checkpoints, events and logs go.
        checkpoint_delay_s: How long its checkpoint takes after the stop signal.
    """

    def __init__(self, folder: Path, checkpoint_delay_s: float = 0.0) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.pidfile = folder / "trainer.pid"
        self.events = folder / "events.txt"
        self.argv = [
            sys.executable,
            "-m",
            "datagen.host.standin_trainer",
            "--pidfile",
            str(self.pidfile),
            "--checkpoint-dir",
            str(folder / "checkpoints"),
            "--events",
            str(self.events),
            "--step-interval-s",
            "0.5",
            "--checkpoint-delay-s",
            str(checkpoint_delay_s),
        ]

    def training_config(self, **changes: Any) -> dict[str, Any]:
        """The run config's ``training`` section: halt it by pidfile, restart it with the same command."""
        return {
            "kind": "pidfile",
            "pidfile": str(self.pidfile),
            "stop_timeout_s": 120,
            "restart_after_run": True,
            "restart_command": list(self.argv),
            **changes,
        }

    def start(self) -> None:
        """Start it (detached, its own session) and wait until it runs."""
        with (self.folder / "trainer.log").open("ab") as log:
            subprocess.Popen(
                self.argv,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.wait_for(starts=len(self.started_pids()) + 1, timeout_s=60)

    def _events(self) -> list[list[str]]:
        try:
            return [line.split() for line in self.events.read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            return []

    def started_pids(self) -> list[int]:
        """The pid of every start so far, in order."""
        return [int(event[1]) for event in self._events() if event[0] == "start"]

    def signals(self) -> Counter[int]:
        """Stop signals received, per trainer pid."""
        return Counter(int(event[2]) for event in self._events() if event[0] == "signal")

    def running(self) -> list[int]:
        """Trainer processes alive now."""
        return [pid for pid in self.started_pids() if alive(pid)]

    def wait_for(self, *, starts: int, timeout_s: float) -> bool:
        """Wait until it has started ``starts`` times and the last one runs; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pids = self.started_pids()
            if len(pids) >= starts and alive(pids[-1]) and self.pidfile.exists():
                return True
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        """SIGKILL every trainer process of this test still alive (cleanup).

        Only a process whose command line names this trainer's events file: a pid from the events file may
        have been reused by another process since that trainer exited.
        """
        for pid, _ in processes_mentioning(str(self.events)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def summary(self) -> str:
        """Its events, for assertion messages."""
        return self.events.read_text() if self.events.exists() else "(no events)"


HOLD_LOCK = """
import datetime, fcntl, json, os, socket, sys, time
path = sys.argv[1]
os.makedirs(os.path.dirname(path), exist_ok=True)
handle = open(path, "a+")
fcntl.flock(handle, fcntl.LOCK_EX)
handle.seek(0)
handle.truncate()
since = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
holder = {"run_id": "other-run", "pid": os.getpid(), "host": socket.gethostname(), "started_at": since}
handle.write(json.dumps(holder))
handle.flush()
print("held", flush=True)
time.sleep(3600)
"""


class LockHolder:
    """Another process holding the host GPU lock file (an OS file lock), until :meth:`release`."""

    def __init__(self, lock_dir: Path, lock_name: str) -> None:
        self.path = lock_dir / f"{lock_name}.lock"
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOLD_LOCK, str(self.path)], stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "held", "the lock holder did not take the lock"

    def release(self) -> None:
        """End the holder (the kernel releases its lock)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


FAKE_NVIDIA_SMI = """#!/bin/sh
# A stand-in for nvidia-smi: the probe's GPU query sleeps first (a slow driver), then recorded outputs print.
fixtures={fixtures}
case "$*" in
  *query-compute-apps*) cat "$fixtures/compute-apps.csv" ;;
  *query-gpu=*uuid*) echo "$$" >> {started}; sleep {sleep_s}; cat "$fixtures/query-gpu.csv" ;;
  *query-gpu*) cat "$fixtures/query-gpu.csv" ;;
  "topo -m") cat "$fixtures/topo.txt" ;;
  *) cat "$fixtures/nvidia-smi.txt" ;;
esac
"""


def write_fake_nvidia_smi(folder: Path, sleep_s: float, fixture: str = "h200x1") -> tuple[Path, Path]:
    """An ``nvidia-smi`` in ``folder`` (put it first on PATH) whose GPU query sleeps ``sleep_s`` first.

    Returns:
        The folder, and the file each sleeping call appends its pid to (the probe has begun).
    """
    folder.mkdir(parents=True, exist_ok=True)
    started = folder / "probe-started.txt"
    script = folder / "nvidia-smi"
    script.write_text(
        FAKE_NVIDIA_SMI.format(fixtures=PROBE_FIXTURES / fixture, started=started, sleep_s=sleep_s)
    )
    script.chmod(0o755)
    return folder, started


def answered(rows: list[dict[str, Any]]) -> Counter[tuple[str, int]]:
    """(prompt id, sample index) -> how many final records hold it."""
    return Counter((row["prompt_id"], int(row["sample_index"])) for row in rows)


def jsonl_rows(data: bytes) -> list[dict[str, Any]]:
    """The rows of a JSONL object."""
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]
