"""Halting a real (stand-in) training process: graceful, stubborn, escalated, already gone, idempotent;
through a pidfile, GPU processes matched by command line, systemd (commands and parsing), a Prefect flow
run on the real test API; the checkpoint marker, the GPU release check, and the restart."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

import pytest

from datagen.config import TrainingJobConfig
from datagen.errors import TrainingHaltError
from datagen.host.training import (
    GpuQueries,
    find_marker,
    gpu_memory_released,
    halt_training,
    restart_training,
    validate_training_job,
)
from datagen.host.training_jobs import (
    CmdlineJob,
    JobTarget,
    SystemdJob,
    parse_systemctl_show,
    systemctl_kill_argv,
    systemctl_show_argv,
    systemctl_stop_argv,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "probe"

STARTUP_TIMEOUT_S = 30.0
STEP_INTERVAL_S = "0.05"


@dataclass
class Trainer:
    process: subprocess.Popen[bytes]
    pidfile: Path
    checkpoint_dir: Path

    def config(self, **changes: object) -> TrainingJobConfig:
        return TrainingJobConfig.model_validate(
            {
                "kind": "pidfile",
                "pidfile": str(self.pidfile),
                "checkpoint_glob": str(self.checkpoint_dir / "checkpoint-*.pt"),
                "stop_timeout_s": 20,
                **changes,
            }
        )


def _start_trainer(tmp_path: Path, *extra: str) -> Trainer:
    pidfile = tmp_path / "trainer.pid"
    checkpoint_dir = tmp_path / "ckpt"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "datagen.host.standin_trainer",
            "--pidfile",
            str(pidfile),
            "--checkpoint-dir",
            str(checkpoint_dir),
            "--step-interval-s",
            STEP_INTERVAL_S,
            *extra,
        ],
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not (checkpoint_dir / "step.txt").exists():
        assert process.poll() is None, process.stderr.read() if process.stderr else b""
        assert time.monotonic() < deadline, "stand-in trainer did not start"
        time.sleep(0.05)
    return Trainer(process=process, pidfile=pidfile, checkpoint_dir=checkpoint_dir)


@pytest.fixture()
def trainer(tmp_path: Path) -> Iterator[Trainer]:
    started = _start_trainer(tmp_path)
    yield started
    started.process.kill()
    started.process.wait()


@pytest.fixture()
def stubborn_trainer(tmp_path: Path) -> Iterator[Trainer]:
    started = _start_trainer(tmp_path, "--ignore-first-signal")
    yield started
    started.process.kill()
    started.process.wait()


def test_graceful_halt_waits_for_the_checkpoint_and_the_exit(trainer: Trainer) -> None:
    record = halt_training(trainer.config())

    assert trainer.process.wait(timeout=5) == 0
    assert record.stopped
    assert not record.already_gone
    assert not record.escalated
    assert record.pid == trainer.process.pid
    assert record.signal == "SIGTERM"
    assert record.last_checkpoint is not None
    checkpoint = Path(record.last_checkpoint)
    assert checkpoint.parent == trainer.checkpoint_dir
    assert checkpoint.name.startswith("checkpoint-")
    assert checkpoint.read_bytes()
    assert 0 < record.waited_s < 20


def test_the_signal_is_recorded_right_before_it_goes_out_and_right_after(trainer: Trainer) -> None:
    seen: list[tuple[str, list[int], bool | None]] = []

    @contextlib.contextmanager
    def recording_signal(target: JobTarget) -> Iterator[None]:
        # Entered before the signal: the trainer has not begun its checkpoint yet.
        seen.append(("before", target.pids, any(trainer.checkpoint_dir.glob("checkpoint-*.pt"))))
        yield
        seen.append(("after", target.pids, None))

    record = halt_training(trainer.config(), recording_signal=recording_signal)

    assert record.stopped and trainer.process.wait(timeout=5) == 0
    assert seen == [("before", [trainer.process.pid], False), ("after", [trainer.process.pid], None)]


def test_second_halt_finds_the_job_already_gone_and_keeps_the_checkpoint(trainer: Trainer) -> None:
    first = halt_training(trainer.config())
    trainer.process.wait(timeout=5)

    second = halt_training(trainer.config())

    assert second.already_gone
    assert not second.stopped
    assert second.pid == first.pid
    assert second.last_checkpoint == first.last_checkpoint


def test_configured_signal_is_the_one_sent(tmp_path: Path) -> None:
    started = _start_trainer(tmp_path, "--signal", "SIGUSR1")
    try:
        record = halt_training(started.config(signal="USR1"))

        assert record.signal == "SIGUSR1"
        assert started.process.wait(timeout=5) == 0
        assert record.last_checkpoint is not None
    finally:
        started.process.kill()
        started.process.wait()


def test_stubborn_job_without_escalation_raises_and_is_left_running(stubborn_trainer: Trainer) -> None:
    with pytest.raises(TrainingHaltError, match="escalate") as raised:
        halt_training(stubborn_trainer.config(stop_timeout_s=1))

    assert str(stubborn_trainer.process.pid) in str(raised.value)
    assert stubborn_trainer.process.poll() is None


def test_stubborn_job_with_escalation_is_killed(stubborn_trainer: Trainer) -> None:
    record = halt_training(stubborn_trainer.config(stop_timeout_s=1, escalate=True))

    assert stubborn_trainer.process.wait(timeout=5) == -signal.SIGKILL
    assert record.stopped
    assert record.escalated
    assert record.last_checkpoint is None
    assert record.waited_s >= 1


def test_missing_pidfile_means_already_gone(tmp_path: Path) -> None:
    config = TrainingJobConfig(kind="pidfile", pidfile=str(tmp_path / "absent.pid"))

    record = halt_training(config)

    assert record.already_gone
    assert record.pid is None
    assert not record.stopped


def test_kind_none_halts_nothing() -> None:
    record = halt_training(TrainingJobConfig())

    assert record.kind == "none"
    assert not record.stopped and not record.already_gone


def test_pidfile_without_a_pid_is_an_error_naming_the_file(tmp_path: Path) -> None:
    pidfile = tmp_path / "bad.pid"
    pidfile.write_text("not-a-pid\n")

    with pytest.raises(TrainingHaltError, match=r"bad\.pid"):
        halt_training(TrainingJobConfig(kind="pidfile", pidfile=str(pidfile)))
    assert validate_training_job(TrainingJobConfig(kind="pidfile", pidfile=str(pidfile)))


def test_validation_accepts_a_running_job_and_reports_a_missing_pidfile(
    trainer: Trainer, tmp_path: Path
) -> None:
    assert validate_training_job(trainer.config()) == []
    assert validate_training_job(TrainingJobConfig()) == []

    problems = validate_training_job(TrainingJobConfig(kind="pidfile", pidfile=str(tmp_path / "absent.pid")))

    assert len(problems) == 1
    assert "training.pidfile" in problems[0]
    assert trainer.process.poll() is None


# --- GPU processes matched by command line ------------------------------------------------------

# The header nvidia-smi prints, as recorded on the H200 host.
COMPUTE_APPS_HEADER = (FIXTURES / "h200x2-nvlink" / "compute-apps.csv").read_text().splitlines()[0]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def _driver_listing(gpu_pids: list[int]) -> Callable[[], str]:
    """What `nvidia-smi --query-compute-apps` prints when these processes hold GPU memory while alive."""

    def query() -> str:
        rows = [f"{pid}, {sys.executable}, 20480 MiB, GPU-114030db" for pid in gpu_pids if _alive(pid)]
        return "\n".join([COMPUTE_APPS_HEADER, *rows]) + "\n"

    return query


def test_cmdline_job_stops_only_the_matching_process_that_holds_a_gpu(tmp_path: Path) -> None:
    on_gpu = _start_trainer(tmp_path / "gpu")
    off_gpu = _start_trainer(tmp_path / "cpu")
    try:
        listing = _driver_listing([on_gpu.process.pid])
        job = CmdlineJob(r"datagen\.host\.standin_trainer", compute_apps=listing)
        config = TrainingJobConfig(
            kind="cmdline", cmdline_pattern=r"datagen\.host\.standin_trainer", stop_timeout_s=20
        )

        record = halt_training(config, job=job, gpu=GpuQueries(compute_apps=listing, gpu_memory=lambda: None))

        assert on_gpu.process.wait(timeout=5) == 0
        assert off_gpu.process.poll() is None
        assert record.stopped and record.pids == [on_gpu.process.pid]
        assert record.gpu_memory_released is True
        assert "standin_trainer" in (record.target or "")
        assert halt_training(config, job=job).already_gone
    finally:
        for trainer in (on_gpu, off_gpu):
            trainer.process.kill()
            trainer.process.wait()


def test_a_shell_launched_trainer_is_stopped_whole_and_its_gpus_judged_after_its_last_process(
    tmp_path: Path,
) -> None:
    from tests.support.standin_trainers import shell_launcher_argv, trainer_argv, trainers, wait_pid

    pidfile, checkpoints = tmp_path / "train.pid", tmp_path / "checkpoints"
    trainer = trainer_argv(sys.executable, tmp_path / "own.pid", checkpoints)
    launcher = subprocess.Popen(shell_launcher_argv(pidfile, trainer), start_new_session=True)
    try:
        wait_pid(pidfile, timeout_s=STARTUP_TIMEOUT_S)
        # Written once the trainer's stop handler is installed (a stop before it would leave no checkpoint).
        child = wait_pid(tmp_path / "own.pid", timeout_s=STARTUP_TIMEOUT_S)
        assert trainers(checkpoints) == [child]
        listing = _driver_listing([child])  # the Python child holds the GPU, not the shell
        config = TrainingJobConfig(
            kind="pidfile",
            pidfile=str(pidfile),
            checkpoint_glob=str(checkpoints / "checkpoint-*.pt"),
            stop_timeout_s=20,
        )

        record = halt_training(config, gpu=GpuQueries(compute_apps=listing, gpu_memory=lambda: None))

        assert record.stopped and record.pid == launcher.pid and child in record.pids
        assert not _alive(child) and trainers(checkpoints) == []
        assert record.gpu_memory_released is True
        assert record.last_checkpoint == str(max(checkpoints.glob("checkpoint-*.pt")))
    finally:
        launcher.kill()
        launcher.wait()
        for pid in trainers(checkpoints):
            os.kill(pid, signal.SIGKILL)


def test_cmdline_job_without_nvidia_smi_explains_what_to_use_instead() -> None:
    job = CmdlineJob("trainer", compute_apps=lambda: None)

    with pytest.raises(TrainingHaltError, match="pidfile or systemd"):
        job.find()


def test_gpu_release_is_judged_from_the_job_pids_or_from_memory_used() -> None:
    target = JobTarget(description="t", running=False, pids=[48211])
    no_pids = JobTarget(description="flow run", running=False, ids=["x"])
    recorded_apps = (FIXTURES / "pcie-8gpu" / "compute-apps.csv").read_text()
    busy_gpus = (FIXTURES / "pcie-8gpu" / "query-gpu.csv").read_text()
    idle_gpus = (FIXTURES / "h200x2-nvlink" / "query-gpu.csv").read_text()

    assert gpu_memory_released(target, GpuQueries(lambda: recorded_apps, lambda: idle_gpus)) is False
    assert gpu_memory_released(target, GpuQueries(lambda: COMPUTE_APPS_HEADER, lambda: idle_gpus)) is True
    assert gpu_memory_released(no_pids, GpuQueries(lambda: None, lambda: busy_gpus)) is False
    assert gpu_memory_released(no_pids, GpuQueries(lambda: None, lambda: idle_gpus)) is True
    assert gpu_memory_released(target, GpuQueries(lambda: None, lambda: None)) is None


# --- checkpoint marker --------------------------------------------------------------------------


def test_halt_waits_for_the_checkpoint_marker_written_after_the_signal(tmp_path: Path) -> None:
    marker = tmp_path / "ckpt" / "CHECKPOINT_DONE"
    started = _start_trainer(tmp_path, "--marker", str(marker), "--checkpoint-delay-s", "0.5")
    try:
        record = halt_training(started.config(checkpoint_marker=str(marker)))

        assert record.checkpoint_marker == str(marker)
        assert record.notes == []
        assert record.waited_s >= 0.5
        assert marker.read_text().strip() == record.last_checkpoint
    finally:
        started.process.kill()
        started.process.wait()


def test_a_marker_older_than_the_stop_signal_does_not_count(tmp_path: Path) -> None:
    old = tmp_path / "old.done"
    new = tmp_path / "new.done"
    old.write_text("")
    new.write_text("")
    os.utime(old, (time.time() - 3600, time.time() - 3600))

    assert find_marker(str(tmp_path / "*.done"), since_epoch_s=time.time() - 60) == str(new)
    assert find_marker(str(old), since_epoch_s=time.time() - 60) is None
    assert find_marker(str(old), since_epoch_s=None) == str(old)


# --- systemd --------------------------------------------------------------------------------------


def test_systemd_commands_stop_kill_and_show_the_unit() -> None:
    assert systemctl_stop_argv("train.service", "stop", signal.SIGTERM) == [
        "systemctl",
        "stop",
        "--no-block",
        "train.service",
    ]
    assert systemctl_stop_argv("train.service", "kill", signal.SIGUSR1) == [
        "systemctl",
        "kill",
        "--kill-whom=main",
        "--signal=SIGUSR1",
        "train.service",
    ]
    assert systemctl_kill_argv("train.service") == [
        "systemctl",
        "kill",
        "--kill-whom=all",
        "--signal=SIGKILL",
        "train.service",
    ]
    assert systemctl_show_argv("train.service")[:3] == ["systemctl", "show", "train.service"]
    assert SystemdJob("train.service").default_restart_argv() == ["systemctl", "start", "train.service"]


def test_systemctl_show_output_is_parsed_into_pid_and_state() -> None:
    running = parse_systemctl_show("MainPID=48211\nActiveState=active\nLoadState=loaded\n")
    stopped = parse_systemctl_show("MainPID=0\nActiveState=inactive\nLoadState=loaded\n")
    stopping = parse_systemctl_show("ActiveState=deactivating\nMainPID=48211\n")

    assert (running.main_pid, running.running) == (48211, True)
    assert (stopped.main_pid, stopped.running) == (None, False)
    assert stopping.running
    with pytest.raises(ValueError, match="ActiveState"):
        parse_systemctl_show("System has not been booted with systemd as init system (PID 1).\n")


def test_unknown_systemd_unit_is_a_halt_error_naming_the_unit() -> None:
    unit = "datagen-test-no-such-unit.service"
    config = TrainingJobConfig(kind="systemd", systemd_unit=unit)

    with pytest.raises(TrainingHaltError, match=unit):
        halt_training(config)
    problems = validate_training_job(config)
    assert len(problems) == 1 and unit in problems[0]


# --- restart --------------------------------------------------------------------------------------


def test_restart_starts_training_detached_and_it_can_be_halted_again(
    trainer: Trainer, tmp_path: Path
) -> None:
    first = halt_training(trainer.config())
    trainer.process.wait(timeout=5)
    command = [
        sys.executable,
        "-m",
        "datagen.host.standin_trainer",
        "--pidfile",
        str(trainer.pidfile),
        "--checkpoint-dir",
        str(trainer.checkpoint_dir),
        "--step-interval-s",
        STEP_INTERVAL_S,
    ]
    config = trainer.config(restart_after_run=True, restart_command=command)

    restarted = restart_training(config, tmp_path / "restart.log")
    try:
        assert restarted is not None
        assert _wait_for_pidfile(trainer.pidfile, restarted.pid)
        assert os.getsid(restarted.pid) == restarted.pid
        assert (
            int(Path(f"/proc/{restarted.pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) != os.getpid()
        )

        second = halt_training(config)

        assert second.stopped and second.pid == restarted.pid != first.pid
        assert second.last_checkpoint != first.last_checkpoint or second.last_checkpoint is not None
    finally:
        if restarted is not None and _alive(restarted.pid):
            os.kill(restarted.pid, signal.SIGKILL)


def test_restart_is_off_by_default_and_needs_a_command_when_on(trainer: Trainer, tmp_path: Path) -> None:
    assert restart_training(trainer.config(), tmp_path / "restart.log") is None
    with pytest.raises(ValueError, match="restart_command"):
        trainer.config(restart_after_run=True)
    broken = trainer.config(restart_after_run=True, restart_command=[str(tmp_path / "no-such-program")])
    with pytest.raises(TrainingHaltError, match="restart_command"):
        restart_training(broken, tmp_path / "restart.log")


def _wait_for_pidfile(pidfile: Path, pid: int) -> bool:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if pidfile.is_file() and pidfile.read_text().strip() == str(pid):
            return True
        time.sleep(0.05)
    return False


# --- Prefect flow run -------------------------------------------------------------------------------


def _worker_that_finishes_cancellations(flow_run_id: str, stop: threading.Event) -> threading.Thread:
    """Plays the training run's worker: once the run is Cancelling, it marks it Cancelled."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    def loop() -> None:
        with get_client(sync_client=True) as client:
            while not stop.is_set():
                run = client.read_flow_run(UUID(flow_run_id))
                if run.state is not None and run.state.name == "Cancelling":
                    client.set_flow_run_state(run.id, Cancelled(), force=True)
                    return
                time.sleep(0.1)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def test_prefect_flow_run_is_cancelled_through_the_api(prefect_api: str) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from tasks.host import PrefectFlowRunControl

    @flow(name="datagen-test-training")
    def training() -> None:
        pass

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(training, state=Running())
    stop = threading.Event()
    worker = _worker_that_finishes_cancellations(str(run.id), stop)
    config = TrainingJobConfig(kind="prefect", prefect_flow_run_id=str(run.id), stop_timeout_s=30)
    try:
        record = halt_training(config, flow_runs=PrefectFlowRunControl())
    finally:
        stop.set()
        worker.join(timeout=5)

    assert record.stopped and record.flow_run_ids == [str(run.id)]
    assert PrefectFlowRunControl().flow_run_state(str(run.id)) == "CANCELLED"
    assert halt_training(config, flow_runs=PrefectFlowRunControl()).already_gone


def test_prefect_deployment_runs_not_started_are_cancelled_at_once(prefect_api: str) -> None:
    from prefect.client.orchestration import get_client

    from tasks.host import PrefectFlowRunControl

    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("datagen-test-trainer")
        deployment_id = client.create_deployment(flow_id, "nightly")
        scheduled = client.create_flow_run_from_deployment(deployment_id)
    config = TrainingJobConfig(
        kind="prefect", prefect_deployment="datagen-test-trainer/nightly", stop_timeout_s=10
    )

    record = halt_training(config, flow_runs=PrefectFlowRunControl())

    assert record.stopped and record.flow_run_ids == [str(scheduled.id)]
    assert PrefectFlowRunControl().flow_run_state(str(scheduled.id)) == "CANCELLED"


def test_prefect_kind_outside_the_flow_says_where_to_halt_it() -> None:
    with pytest.raises(TrainingHaltError, match=r"tasks\.host\.halt_training"):
        halt_training(TrainingJobConfig(kind="prefect", prefect_flow_run_id="x"))
