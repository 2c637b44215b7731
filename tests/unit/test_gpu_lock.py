"""The host GPU lock is an OS file lock: exclusive, named, freed by the kernel when its holder dies."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from datagen.errors import GpuLockTimeoutError, GpuLockUnavailableError
from datagen.host.gpu_lock import HostGpuLock, current_holder, hold_gpu_lock, is_held, lock_path, read_holder

REPO = Path(__file__).resolve().parents[2]

# A process that takes the lock, starts a long-lived child (as a fleet would), says so, and sleeps.
HOLDER = """
import subprocess, sys, time
from pathlib import Path
from datagen.host.gpu_lock import HostGpuLock, current_holder
lock = HostGpuLock(Path(sys.argv[1]))
assert lock.try_acquire(current_holder("held-run", "flow-1"))
child = subprocess.Popen(["sleep", "60"])
print(child.pid, flush=True)
time.sleep(60)
"""


def test_lock_names_are_safe_file_names_in_the_lock_dir(tmp_path: Path) -> None:
    path = lock_path(tmp_path, "datagen-gpus-box/../1 x")
    assert path.parent == tmp_path
    assert path.name == "datagen-gpus-box-..-1-x.lock"


def test_a_second_holder_is_refused_until_the_first_releases(tmp_path: Path) -> None:
    path = lock_path(tmp_path, "gpus")
    first, second = HostGpuLock(path), HostGpuLock(path)
    assert first.try_acquire(current_holder("run-a", None))
    assert not second.try_acquire(current_holder("run-b", None))
    assert is_held(path)
    holder = read_holder(path)
    assert holder is not None and holder.run_id == "run-a" and holder.pid == os.getpid()
    first.release()
    assert not is_held(path)
    assert second.try_acquire(current_holder("run-b", None))
    assert read_holder(path).run_id == "run-b"  # type: ignore[union-attr]
    second.release()


def test_a_holder_killed_outright_frees_the_lock_at_once_even_with_children_alive(tmp_path: Path) -> None:
    path = lock_path(tmp_path, "gpus")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert holder.stdout is not None
    child = int(holder.stdout.readline())
    try:
        assert is_held(path)
        assert read_holder(path).run_id == "held-run"  # type: ignore[union-attr]
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
        os.kill(child, 0)  # the child (a server, say) still runs...
        lock = HostGpuLock(path)
        assert lock.try_acquire(current_holder("next-run", None)), "...but it does not keep the lock"
        lock.release()
    finally:
        if holder.poll() is None:
            holder.kill()
        os.kill(child, signal.SIGKILL)


def test_waiting_times_out_with_the_holder_named(tmp_path: Path) -> None:
    path = lock_path(tmp_path, "gpus")
    other = HostGpuLock(path)
    assert other.try_acquire(current_holder("busy-run", "flow-9"))
    seen = []
    try:
        with (
            pytest.raises(GpuLockTimeoutError) as raised,
            hold_gpu_lock(path, current_holder("me", None), timeout_s=0.6, on_wait=seen.append, poll_s=0.1),
        ):
            pytest.fail("the lock is held by another holder")
    finally:
        other.release()
    assert [holder.run_id for holder in seen if holder] == ["busy-run"]  # said once, at once
    assert "run busy-run (flow run flow-9, pid" in str(raised.value)
    assert "datagen gpu-lock" in str(raised.value)


def test_a_signal_ends_the_wait_at_once(tmp_path: Path) -> None:
    path = lock_path(tmp_path, "gpus")
    other = HostGpuLock(path)
    assert other.try_acquire(current_holder("busy-run", None))

    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    started = time.monotonic()
    try:
        with pytest.raises(Interrupted), hold_gpu_lock(path, current_holder("me", None), timeout_s=60):
            pytest.fail("the lock is held by another holder")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        other.release()
    assert time.monotonic() - started < 2.0
    assert not is_held(path), "the interrupted waiter holds nothing"


def test_the_lock_is_released_when_the_block_ends(tmp_path: Path) -> None:
    path = lock_path(tmp_path, "gpus")
    with hold_gpu_lock(path, current_holder("me", None), timeout_s=1) as lock:
        assert lock.held and is_held(path)
    assert not is_held(path)


def test_the_gpu_lock_command_says_free_or_who_holds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {
        **os.environ,
        "DATAGEN_LOCK_DIR": str(tmp_path),
        "DATAGEN_GPU_LOCK": "box-7",
        "PYTHONPATH": str(REPO),
    }
    command = [sys.executable, "-m", "flows.cli_entry", "gpu-lock"]
    free = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert free.returncode == 0 and free.stdout.startswith("free"), free.stdout + free.stderr
    lock = HostGpuLock(lock_path(tmp_path, "box-7"))
    assert lock.try_acquire(current_holder("night-3", "f-1"))
    try:
        held = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    finally:
        lock.release()
    assert held.returncode == 1, held.stdout + held.stderr
    assert held.stdout.startswith("held: run night-3 (flow run f-1, pid ")
    after = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert after.returncode == 0 and "free (last held by run night-3" in after.stdout


def test_the_lock_folder_and_file_open_to_every_user_of_the_box_whatever_the_umask(tmp_path: Path) -> None:
    path = lock_path(tmp_path / "run" / "lock" / "datagen", "gpus")
    previous = os.umask(0o077)
    try:
        lock = HostGpuLock(path)
        assert lock.try_acquire(current_holder("run-a", None))
        lock.release()
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o777
    assert stat.S_IMODE(path.stat().st_mode) == 0o666


def test_a_lock_that_cannot_be_opened_refuses_with_the_fix(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with pytest.raises(GpuLockUnavailableError) as refused:
        HostGpuLock(lock_path(blocker / "datagen", "gpus")).try_acquire(current_holder("run-a", None))
    assert "DATAGEN_LOCK_DIR" in str(refused.value) and str(blocker / "datagen") in str(refused.value)
