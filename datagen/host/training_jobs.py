"""Ways to reach the training job that holds the GPUs, behind one protocol (:class:`TrainingJob`).

A handle finds the job (:class:`JobTarget`), asks it to stop, tells whether it still runs, and kills it
when escalation is allowed. :func:`datagen.host.training.halt_training` drives any handle the same way.

A job is a process tree: the process the stop is addressed to (a pidfile's pid, a unit's main pid, each matched
process) and every descendant found when the job was located or while it stops. A launcher may forward the
stop (torchrun, accelerate) or not (a shell running ``python train.py &``): the job runs while any of its
processes does (:func:`live_pids`), and each process is known by its start time, so a reused pid is never
taken for the job.

- :class:`PidfileJob`: the pid in a file the trainer writes.
- :class:`CmdlineJob`: processes that hold GPU memory (``nvidia-smi --query-compute-apps``) *and* whose
  command line matches a regex, so a matching editor or shell is never signalled.
- :class:`SystemdJob`: a systemd unit (``systemctl stop`` or ``systemctl kill --signal``).
- :class:`FlowRunJob`: a Prefect flow run, cancelled through the API by an injected
  :class:`FlowRunControl` (``datagen`` stays Prefect-free; ``tasks/host.py`` supplies the client).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from datagen import processes
from datagen.config import TrainingJobConfig
from datagen.errors import TrainingHaltError
from datagen.host.nvidia_smi import parse_compute_apps_csv, query_compute_apps

# A process that started this long after the pidfile was written cannot be the one that wrote it.
PID_REUSE_SLACK_S = 5.0
SYSTEMCTL_TIMEOUT_S = 30.0
# systemd states in which the unit's processes may still hold the GPUs.
SYSTEMD_RUNNING_STATES = frozenset({"active", "activating", "deactivating", "reloading", "refreshing"})
# Prefect state types after which a flow run holds nothing any more.
PREFECT_FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "CRASHED"})


class JobTarget(BaseModel):
    """The training job as found before stopping it."""

    model_config = ConfigDict(extra="forbid")

    description: str = Field(description="What was found, for the record and logs, e.g. 'pid 42 from x.pid'.")
    running: bool
    pids: list[int] = Field(
        default_factory=list,
        description="Every process of the job: those the stop goes to first, then their descendants.",
    )
    stop_pids: list[int] = Field(
        default_factory=list,
        description="The processes the graceful stop is addressed to (a main pid, or every matched process).",
    )
    start_ticks: dict[int, int] = Field(
        default_factory=dict, description="Each process's start time (clock ticks since boot): its identity."
    )
    ids: list[str] = Field(default_factory=list, description="Non-process ids (Prefect flow run ids).")


def _same_process(target: JobTarget, pid: int) -> bool:
    """Whether ``pid`` still runs and is the process found (not a later one that reuses its number)."""
    if not processes.is_running(pid):
        return False
    known = target.start_ticks.get(pid)
    return known is None or processes.start_ticks(pid) == known


def process_tree(description: str, stop_pids: list[int]) -> JobTarget:
    """The job made of ``stop_pids`` and every live descendant of them, each with its start time."""
    pids = list(dict.fromkeys(stop_pids))
    pids += [child for child in processes.descendants_of(stop_pids) if child not in pids]
    ticks = {pid: tick for pid in pids if (tick := processes.start_ticks(pid)) is not None}
    target = JobTarget(
        description=description, running=True, pids=pids, stop_pids=list(stop_pids), start_ticks=ticks
    )
    target.running = bool(live_pids(target))
    return target


def live_pids(target: JobTarget) -> list[int]:
    """The job's processes that still run (in the order found: the stopped-first ones lead)."""
    return [pid for pid in target.pids if _same_process(target, pid)]


def joined_target(found: JobTarget, earlier: JobTarget) -> JobTarget:
    """The job as found now, plus the processes of the job as an earlier run found it that still run."""
    extra = [pid for pid in live_pids(earlier) if pid not in found.pids]
    if not extra:
        return found
    return found.model_copy(
        update={
            "running": True,
            "pids": [*found.pids, *extra],
            "start_ticks": {
                **{pid: earlier.start_ticks[pid] for pid in extra if pid in earlier.start_ticks},
                **found.start_ticks,
            },
        }
    )


def with_new_descendants(target: JobTarget) -> JobTarget:
    """``target`` with the descendants its live processes started since it was found (a checkpoint writer)."""
    new = [child for child in processes.descendants_of(live_pids(target)) if child not in target.pids]
    if not new:
        return target
    ticks = {pid: tick for pid in new if (tick := processes.start_ticks(pid)) is not None}
    return target.model_copy(
        update={"pids": [*target.pids, *new], "start_ticks": {**target.start_ticks, **ticks}}
    )


@runtime_checkable
class TrainingJob(Protocol):
    """A handle on the training job (see the module docstring)."""

    kind: str

    def find(self) -> JobTarget:
        """Locate the job; ``running`` is False when nothing is left to stop."""
        ...

    def request_stop(self, target: JobTarget, signum: signal.Signals) -> None:
        """Ask the job to checkpoint and exit (graceful)."""
        ...

    def is_running(self, target: JobTarget) -> bool:
        """Whether the job found by :meth:`find` still runs."""
        ...

    def force_stop(self, target: JobTarget) -> None:
        """Kill the job (only called when ``training.escalate`` is on)."""
        ...

    def default_restart_argv(self) -> list[str] | None:
        """The command that starts the job again when none is configured; None if there is none."""
        ...


class FlowRunControl(Protocol):
    """What :class:`FlowRunJob` needs from the Prefect API (implemented in ``tasks/host.py``)."""

    def flow_run_state(self, flow_run_id: str) -> str:
        """The state type of a flow run, e.g. ``RUNNING``, ``CANCELLING``, ``CANCELLED``."""
        ...

    def active_flow_runs(self, deployment: str) -> list[str]:
        """Ids of the not-yet-final flow runs of ``flow-name/deployment-name``."""
        ...

    def cancel_flow_run(self, flow_run_id: str) -> None:
        """Move a flow run to Cancelling (its worker or runner then stops it)."""
        ...


# --- signalling ---------------------------------------------------------------------------------


def signal_processes(pids: list[int], signum: signal.Signals, what: str) -> None:
    """Send ``signum`` to each of ``pids`` (those already gone are skipped).

    Raises:
        TrainingHaltError: Not allowed to signal one of them; the message says how to fix it.

    """
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            continue
        except PermissionError as error:
            raise TrainingHaltError(
                f"not allowed to signal training pid {pid} ({what}): run datagen as the trainer's user or "
                "root, or stop the trainer yourself and set training.kind: none",
                pid=pid,
            ) from error


# --- pidfile ------------------------------------------------------------------------------------


def read_pidfile(pidfile: Path) -> int | None:
    """The pid in a trainer's pidfile (first token); None when the file does not exist.

    Raises:
        TrainingHaltError: The file is unreadable or holds no process id.

    """
    try:
        text = pidfile.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise TrainingHaltError(
            f"cannot read training pidfile {pidfile}: {error}; fix its permissions"
        ) from error
    first = text.split()[0] if text else ""
    if not first.isdigit() or int(first) <= 1:
        raise TrainingHaltError(
            f"training pidfile {pidfile} holds {text[:40]!r}, not a process id; point "
            "training.pidfile at the file the trainer writes its pid to",
            pidfile=str(pidfile),
        )
    return int(first)


class PidfileJob:
    """The trainer whose pid is in ``pidfile``; its descendants count as part of the job."""

    kind = "pidfile"

    def __init__(self, pidfile: str | Path) -> None:
        self.pidfile = Path(pidfile)

    def find(self) -> JobTarget:
        """Read the pidfile; a missing file, a dead pid or a reused pid means nothing runs."""
        pid = read_pidfile(self.pidfile)
        if pid is None:
            return JobTarget(description=f"no pidfile at {self.pidfile}", running=False)
        description = f"pid {pid} from {self.pidfile}"
        if not processes.is_running(pid) or self._reused(pid):
            return JobTarget(description=description, running=False, pids=[pid], stop_pids=[pid])
        return process_tree(description, [pid])

    def _reused(self, pid: int) -> bool:
        started = processes.start_epoch_s(pid)
        try:
            written = self.pidfile.stat().st_mtime
        except OSError:
            return False
        return started is not None and started > written + PID_REUSE_SLACK_S

    def request_stop(self, target: JobTarget, signum: signal.Signals) -> None:
        """Signal the main pid first, so a launcher that forwards the stop does its work.

        The halt signals the descendants still running once it is gone (or after a grace).
        """
        signal_processes(
            [pid for pid in target.stop_pids if _same_process(target, pid)], signum, str(self.pidfile)
        )

    def is_running(self, target: JobTarget) -> bool:
        """Whether any process of the job still runs."""
        return bool(live_pids(target))

    def force_stop(self, target: JobTarget) -> None:
        """SIGKILL every process of the job still running."""
        signal_processes(live_pids(target), signal.SIGKILL, str(self.pidfile))

    def default_restart_argv(self) -> list[str] | None:
        """A pidfile says nothing about how the job was started."""
        return None


# --- command line of GPU processes --------------------------------------------------------------


class CmdlineJob:
    """Processes holding GPU memory whose command line matches ``pattern``.

    Args:
        pattern: Regex searched (``re.search``) in each GPU process's space-joined command line.
        compute_apps: Returns ``nvidia-smi --query-compute-apps=pid,... --format=csv`` output, None without
            nvidia-smi; :func:`datagen.host.nvidia_smi.query_compute_apps` by default.

    """

    kind = "cmdline"

    def __init__(self, pattern: str, compute_apps: Callable[[], str | None] = query_compute_apps) -> None:
        self.pattern = re.compile(pattern)
        self.compute_apps = compute_apps

    def gpu_pids(self) -> set[int]:
        """Pids of processes holding GPU memory now.

        Raises:
            TrainingHaltError: nvidia-smi is missing, so GPU processes cannot be told apart.

        """
        text = self.compute_apps()
        if text is None:
            raise TrainingHaltError(
                "training.kind cmdline needs nvidia-smi to find the processes that hold GPUs, and it is not "
                "available; use training.kind pidfile or systemd on this host"
            )
        return {process.pid for process in parse_compute_apps_csv(text)}

    def find(self) -> JobTarget:
        """Match the pattern against the command lines of the GPU processes (never this process)."""
        own = {os.getpid(), os.getppid()}
        matched = []
        for pid in sorted(self.gpu_pids() - own):
            cmdline = processes.read_command_line(pid)
            if cmdline is not None and self.pattern.search(cmdline) and processes.is_running(pid):
                matched.append(pid)
        description = f"GPU processes matching /{self.pattern.pattern}/: {matched or 'none'}"
        if not matched:
            return JobTarget(description=description, running=False)
        return process_tree(description, matched)

    def request_stop(self, target: JobTarget, signum: signal.Signals) -> None:
        """Signal every matched process (their descendants once they are gone: see the module docstring)."""
        live = [pid for pid in target.stop_pids if _same_process(target, pid)]
        signal_processes(live, signum, f"matching /{self.pattern.pattern}/")

    def is_running(self, target: JobTarget) -> bool:
        """Whether any process of the job still runs."""
        return bool(live_pids(target))

    def force_stop(self, target: JobTarget) -> None:
        """SIGKILL every process of the job still running."""
        signal_processes(live_pids(target), signal.SIGKILL, f"matching /{self.pattern.pattern}/")

    def default_restart_argv(self) -> list[str] | None:
        """Matched processes say nothing about how to start them again."""
        return None


# --- systemd ------------------------------------------------------------------------------------


class SystemdStatus(BaseModel):
    """The part of ``systemctl show`` the halt needs."""

    model_config = ConfigDict(extra="forbid")

    main_pid: int | None
    active_state: str
    load_state: str | None = None

    @property
    def running(self) -> bool:
        """Whether the unit's processes may still hold GPUs."""
        return self.active_state in SYSTEMD_RUNNING_STATES


def systemctl_show_argv(unit: str, systemctl: str = "systemctl") -> list[str]:
    """``systemctl show`` limited to the properties :func:`parse_systemctl_show` reads."""
    return [systemctl, "show", unit, "-p", "MainPID", "-p", "ActiveState", "-p", "LoadState"]


def parse_systemctl_show(text: str) -> SystemdStatus:
    """Parse ``KEY=value`` lines of ``systemctl show -p MainPID -p ActiveState``.

    Raises:
        ValueError: No ``ActiveState`` line (not systemctl show output).

    """
    values = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    if "ActiveState" not in values:
        raise ValueError(f"not `systemctl show` output (no ActiveState): {text[:200]!r}")
    main_pid = values.get("MainPID", "0").strip()
    return SystemdStatus(
        main_pid=int(main_pid) if main_pid.isdigit() and int(main_pid) > 0 else None,
        active_state=values["ActiveState"].strip(),
        load_state=values.get("LoadState", "").strip() or None,
    )


def systemctl_stop_argv(
    unit: str, mode: str, signum: signal.Signals, systemctl: str = "systemctl"
) -> list[str]:
    """The graceful stop: ``stop --no-block`` (unit's KillSignal) or ``kill --kill-whom=main --signal``."""
    if mode == "stop":
        # --no-block: the halt polls the state itself, under its own timeout.
        return [systemctl, "stop", "--no-block", unit]
    return [systemctl, "kill", "--kill-whom=main", f"--signal={signum.name}", unit]


def systemctl_kill_argv(unit: str, systemctl: str = "systemctl") -> list[str]:
    """The escalation: SIGKILL to every process of the unit."""
    return [systemctl, "kill", "--kill-whom=all", "--signal=SIGKILL", unit]


class SystemdJob:
    """A trainer run as a systemd unit.

    Args:
        unit: The unit name.
        mode: ``stop`` or ``kill`` (see ``training.systemd_stop``).
        systemctl: The systemctl executable.

    """

    kind = "systemd"

    def __init__(self, unit: str, mode: str = "stop", systemctl: str = "systemctl") -> None:
        self.unit = unit
        self.mode = mode
        self.systemctl = systemctl

    def _run(self, argv: list[str]) -> str:
        try:
            result = subprocess.run(
                argv, capture_output=True, text=True, timeout=SYSTEMCTL_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            raise TrainingHaltError(
                f"`{' '.join(argv)}` failed: {error}; is systemd running here? Use another training.kind "
                "if not",
            ) from error
        if result.returncode != 0:
            raise TrainingHaltError(
                f"`{' '.join(argv)}` exited {result.returncode}: {(result.stderr or result.stdout).strip()}; "
                "check training.systemd_unit and that datagen may manage it (root or polkit rule)",
            )
        return result.stdout

    def status(self) -> SystemdStatus:
        """The unit's main pid and active state now."""
        return parse_systemctl_show(self._run(systemctl_show_argv(self.unit, self.systemctl)))

    def find(self) -> JobTarget:
        """The unit and its main pid; not running unless the unit is active."""
        status = self.status()
        if status.load_state == "not-found":
            raise TrainingHaltError(
                f"systemd unit {self.unit} does not exist: fix training.systemd_unit",
                unit=self.unit,
            )
        description = f"systemd unit {self.unit} ({status.active_state}, main pid {status.main_pid})"
        if status.main_pid is None:
            return JobTarget(description=description, running=status.running)
        target = process_tree(description, [status.main_pid])
        target.running = status.running or target.running
        return target

    def request_stop(self, target: JobTarget, signum: signal.Signals) -> None:
        """``systemctl stop --no-block`` or ``systemctl kill --signal``."""
        self._run(systemctl_stop_argv(self.unit, self.mode, signum, self.systemctl))

    def is_running(self, target: JobTarget) -> bool:
        """Whether the unit is still active (or deactivating), or any process found in it still runs."""
        return bool(live_pids(target)) or self.status().running

    def force_stop(self, target: JobTarget) -> None:
        """SIGKILL every process of the unit, and those found in it that left it."""
        self._run(systemctl_kill_argv(self.unit, self.systemctl))
        signal_processes(live_pids(target), signal.SIGKILL, f"unit {self.unit}")

    def default_restart_argv(self) -> list[str] | None:
        """``systemctl start <unit>``."""
        return [self.systemctl, "start", self.unit]


# --- Prefect flow run ---------------------------------------------------------------------------


class FlowRunJob:
    """A training job that is itself a Prefect flow run, cancelled through the API.

    Args:
        control: The API calls (``tasks.host.PrefectFlowRunControl`` in the flow).
        flow_run_id: The flow run to cancel, or
        deployment: ``flow-name/deployment-name`` whose active flow runs are all cancelled.

    """

    kind = "prefect"

    def __init__(
        self, control: FlowRunControl, *, flow_run_id: str | None = None, deployment: str | None = None
    ) -> None:
        if not (flow_run_id or deployment):
            raise ValueError("FlowRunJob needs flow_run_id or deployment")
        self.control = control
        self.flow_run_id = flow_run_id
        self.deployment = deployment

    def find(self) -> JobTarget:
        """The flow run(s) not yet in a final state."""
        if self.flow_run_id:
            candidates = [self.flow_run_id]
            what = f"flow run {self.flow_run_id}"
        else:
            assert self.deployment is not None
            candidates = self.control.active_flow_runs(self.deployment)
            what = f"active flow runs of deployment {self.deployment}"
        active = [run for run in candidates if self.control.flow_run_state(run) not in PREFECT_FINAL_STATES]
        return JobTarget(description=f"{what}: {active or 'none active'}", running=bool(active), ids=active)

    def request_stop(self, target: JobTarget, signum: signal.Signals) -> None:
        """Cancel every active flow run (Prefect's runner delivers the stop; ``signum`` is not used)."""
        for flow_run_id in target.ids:
            self.control.cancel_flow_run(flow_run_id)

    def is_running(self, target: JobTarget) -> bool:
        """Whether any of the flow runs is not final yet."""
        return any(self.control.flow_run_state(run) not in PREFECT_FINAL_STATES for run in target.ids)

    def force_stop(self, target: JobTarget) -> None:
        """The API offers nothing stronger than cancelling.

        Raises:
            TrainingHaltError: Always, naming the runs that did not stop.

        """
        raise TrainingHaltError(
            f"flow run(s) {target.ids} are still not final after cancelling; the API cannot force them. "
            "Check the worker that runs them (it delivers the cancellation), or stop them by hand",
        )

    def default_restart_argv(self) -> list[str] | None:
        """Restarting a flow run needs a configured command (e.g. ``prefect deployment run``)."""
        return None


def job_for(cfg: TrainingJobConfig, *, flow_runs: FlowRunControl | None = None) -> TrainingJob | None:
    """The handle ``training.kind`` asks for; None for ``none``.

    Args:
        cfg: The training job config.
        flow_runs: Prefect API calls, needed for ``kind: prefect``.

    Raises:
        TrainingHaltError: ``kind: prefect`` without ``flow_runs``.

    """
    if cfg.kind == "pidfile":
        assert cfg.pidfile is not None
        return PidfileJob(cfg.pidfile)
    if cfg.kind == "cmdline":
        assert cfg.cmdline_pattern is not None
        return CmdlineJob(cfg.cmdline_pattern)
    if cfg.kind == "systemd":
        assert cfg.systemd_unit is not None
        return SystemdJob(cfg.systemd_unit, cfg.systemd_stop, shutil.which("systemctl") or "systemctl")
    if cfg.kind == "prefect":
        if flow_runs is None:
            raise TrainingHaltError(
                "training.kind prefect needs the Prefect API; halt it from the flow (tasks.host.halt_training)"
            )
        return FlowRunJob(flow_runs, flow_run_id=cfg.prefect_flow_run_id, deployment=cfg.prefect_deployment)
    return None
