"""Stand-in training jobs started the ways operators start real ones, and the venv a trainer runs from.

The trainer itself is :mod:`datagen.host.standin_trainer`; these helpers start it directly, under a shell
launcher that writes its own pid to the pidfile and runs the trainer as its child (``bash -c 'echo $$ > pid;
python train.py & wait'``), or under a launcher that forwards SIGTERM to its child as torchrun does. A trainer
venv holds a torch distribution laid out as pip lays out a CUDA build (metadata and ``torch/version.py``;
nothing imports it), so a test can "upgrade" torch between a halt and a hand-back.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STANDIN = REPO / "datagen" / "host" / "standin_trainer.py"

# Runs argv[2:] as its child, writes its own pid to argv[1], forwards SIGTERM to the child and exits with it.
FORWARDING_LAUNCHER = (
    "import os, signal, subprocess, sys\n"
    "child = subprocess.Popen(sys.argv[2:])\n"
    "signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signum))\n"
    "with open(sys.argv[1] + '.tmp', 'w') as handle:\n"
    "    handle.write(f'{os.getpid()}\\n')\n"
    "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
    "sys.exit(child.wait())\n"
)


def make_trainer_venv(root: Path, torch_build: str) -> Path:
    """A venv (no pip) under ``root`` holding torch ``2.11.0+<torch_build>``."""
    venv = root / "trainer-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    install_torch(venv, torch_build)
    return venv


def _site(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def install_torch(venv: Path, build: str) -> None:
    """Lay out torch ``2.11.0+<build>`` as pip would (metadata and version.py), replacing any other build."""
    site = _site(venv)
    for old in site.glob("torch-*.dist-info"):
        for item in old.iterdir():
            item.unlink()
        old.rmdir()
    info = site / f"torch-2.11.0+{build}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0+{build}\n")
    (site / "torch").mkdir(exist_ok=True)
    cuda = f"{build[2:4]}.{build[4:]}"
    (site / "torch" / "version.py").write_text(f"__version__ = '2.11.0+{build}'\ncuda = '{cuda}'\n")


def trainer_argv(
    python: Path | str,
    pidfile: Path,
    checkpoints: Path,
    *,
    events: Path | None = None,
    ignore_first: bool = False,
) -> list[str]:
    """The stand-in trainer's command line: it writes ``pidfile`` itself and checkpoints into ``checkpoints``."""
    argv = [str(python), str(STANDIN), "--pidfile", str(pidfile), "--checkpoint-dir", str(checkpoints)]
    argv += ["--step-interval-s", "0.05"]
    if events is not None:
        argv += ["--events", str(events)]
    if ignore_first:
        argv.append("--ignore-first-signal")
    return argv


def shell_launcher_argv(pidfile: Path, trainer: list[str]) -> list[str]:
    """``bash -c 'echo $$ > pidfile; trainer & wait'``: the shell's pid in the pidfile, the trainer its child."""
    script = f"echo $$ > {shlex.quote(str(pidfile))}; {shlex.join(trainer)} & wait"
    return ["bash", "-c", script]


def forwarding_launcher_argv(pidfile: Path, trainer: list[str]) -> list[str]:
    """A Python launcher that writes its pid to ``pidfile`` and forwards SIGTERM to the trainer (torchrun-like)."""
    return [sys.executable, "-c", FORWARDING_LAUNCHER, str(pidfile), *trainer]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs and is no zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def kill(pid: int) -> None:
    """SIGKILL ``pid`` if it still runs."""
    if pid > 1 and alive(pid):
        os.kill(pid, signal.SIGKILL)


def wait_pid(pidfile: Path, not_pid: int | None = None, timeout_s: float = 30.0) -> int:
    """The live pid written to ``pidfile`` (other than ``not_pid``), once there is one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid = int(pidfile.read_text().strip())
        except (OSError, ValueError):
            pid = None
        if pid is not None and pid != not_pid and alive(pid):
            return pid
        time.sleep(0.05)
    raise AssertionError(f"no process wrote {pidfile}")


def trainers(checkpoints: Path) -> list[int]:
    """Live stand-in trainers whose command line names ``checkpoints``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = proc.joinpath("cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # The trainer itself (argv[1] is the stand-in), not a launcher whose arguments name it.
        is_trainer = len(argv) > 1 and argv[1] == str(STANDIN).encode() and str(checkpoints).encode() in argv
        if is_trainer and alive(int(proc.name)):
            found.append(int(proc.name))
    return sorted(found)
