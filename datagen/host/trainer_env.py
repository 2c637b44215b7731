"""The training job's software environment: recorded at the halt, compared before training restarts.

A tool that halts training must never be why the restart fails: installing the serving stack into the
trainer's environment once moved torch from a cu128 to a cu130 build, and the restarted training ran out of
GPU memory. So the halt records what the trainer ran with (its interpreter, every installed distribution and
version, torch's version and CUDA build, the NVIDIA driver), and the hand-back compares that with what the
same interpreter sees now (:func:`environment_changes`); any change holds the restart back.

Everything is read without importing the trainer's packages: the trainer's own interpreter lists its
distributions' metadata (``importlib.metadata``), and torch's CUDA build is read from ``torch/version.py``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from pydantic import Field

from datagen.records import Record

logger = logging.getLogger(__name__)

READ_TIMEOUT_S = 60.0
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")
# Run by the trainer's interpreter: its prefix, its path, its distributions, torch's CUDA build (no imports of
# the trainer's packages: a broken torch must not hide what changed).
_LIST_SCRIPT = """
import json, sys, importlib.metadata as metadata, importlib.util as util
dists = {}
for dist in metadata.distributions():
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    if name and name not in dists:
        dists[name] = dist.version
cuda = None
spec = util.find_spec("torch")
if spec is not None and spec.submodule_search_locations:
    for folder in spec.submodule_search_locations:
        try:
            text = open(folder + "/version.py").read()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("cuda") and "=" in line:
                cuda = line.split("=", 1)[1].strip().strip("'\\"") or None
print(json.dumps({"prefix": sys.prefix, "path": [p for p in sys.path if p], "dists": dists, "torch_cuda": cuda}))
"""


class TrainerEnvironment(Record):
    """What the training job ran with, as the halt found it."""

    interpreter: str = Field(description="The interpreter that runs the trainer (its venv's python).")
    prefix: str = Field(description="The interpreter's sys.prefix: the trainer's environment.")
    sys_path: list[str] = Field(default_factory=list, description="Where its packages are imported from.")
    distributions: dict[str, str] = Field(default_factory=dict, description="Installed name -> version.")
    torch_version: str | None = Field(default=None, description="torch's version, e.g. 2.11.0+cu128.")
    torch_cuda: str | None = Field(default=None, description="The CUDA release torch was built for.")
    driver_version: str | None = Field(
        default=None, description="The NVIDIA kernel driver; None on CPU hosts."
    )


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def process_interpreter(pid: int) -> str | None:
    """The interpreter running ``pid``, as the path that selects its environment (a venv's ``bin/python``).

    ``/proc/<pid>/exe`` resolves a venv's symlinked python to the base interpreter, which names no venv; the
    command line's first word does (resolved against the process's working folder), so it is preferred when
    it is the same executable.
    """
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None
    argv = _cmdline(pid)
    if argv and "/" in argv[0]:
        first = Path(argv[0])
        if not first.is_absolute():
            try:
                first = Path(os.readlink(f"/proc/{pid}/cwd")) / first
            except OSError:
                return exe
        try:
            if first.resolve() == Path(exe).resolve():
                return str(first)
        except OSError:
            return exe
    return exe


def is_standin_trainer(pid: int) -> bool:
    """Whether ``pid`` runs datagen's own stand-in trainer (:mod:`datagen.host.standin_trainer`)."""
    return any(
        part == "datagen.host.standin_trainer" or part.endswith("/standin_trainer.py")
        for part in _cmdline(pid)
    )


def read_environment(interpreter: str, extra_env: dict[str, str] | None = None) -> TrainerEnvironment | None:
    """What ``interpreter`` sees now: its prefix, path, distributions, torch, and the host's driver.

    Returns:
        None when the interpreter cannot be run (gone, or not a Python).
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    env.update(extra_env or {})
    try:
        answer = subprocess.run(
            [interpreter, "-c", _LIST_SCRIPT],
            capture_output=True,
            text=True,
            timeout=READ_TIMEOUT_S,
            env=env,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.warning("could not read the trainer's environment interpreter=%s error=%s", interpreter, error)
        return None
    if answer.returncode != 0:
        logger.warning(
            "could not read the trainer's environment interpreter=%s error=%s",
            interpreter,
            (answer.stderr.strip().splitlines() or ["no output"])[-1],
        )
        return None
    found = json.loads(answer.stdout)
    distributions: dict[str, str] = found["dists"]
    return TrainerEnvironment(
        interpreter=interpreter,
        prefix=found["prefix"],
        sys_path=found["path"],
        distributions=distributions,
        torch_version=distributions.get("torch"),
        torch_cuda=found["torch_cuda"],
        driver_version=driver_version(),
    )


def _python_of(pid: int) -> tuple[str, dict[str, str]] | None:
    """The Python interpreter running ``pid`` and the variables that change its imports; None if not Python."""
    interpreter = process_interpreter(pid)
    if interpreter is None or "python" not in Path(interpreter).name:
        return None
    inherited = {key: value for key, value in _environ(pid).items() if key in {"PYTHONPATH", "PYTHONHOME"}}
    return interpreter, inherited


def read_process_environment(pid: int) -> TrainerEnvironment | None:
    """The environment of the running process ``pid`` (None when it is not a Python process we can read)."""
    python = _python_of(pid)
    return read_environment(*python) if python is not None else None


def read_job_environments(pids: list[int]) -> list[TrainerEnvironment]:
    """Each distinct environment the job's Python processes run in, read once per interpreter.

    A job started by a launcher (a shell, torchrun) runs its Python in the launcher's descendants: the
    launcher alone may be no Python at all, or another one than its workers'.
    """
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    found: list[TrainerEnvironment] = []
    for pid in pids:
        python = _python_of(pid)
        if python is None:
            continue
        interpreter, inherited = python
        key = (interpreter, tuple(sorted(inherited.items())))
        if key in seen:
            continue
        seen.add(key)
        environment = read_environment(interpreter, inherited)
        if environment is not None and environment not in found:
            found.append(environment)
    return found


def driver_version() -> str | None:
    """The NVIDIA kernel driver's version (``/proc/driver/nvidia/version``); None without one."""
    try:
        first = DRIVER_VERSION_FILE.read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    words = [word for word in first.split() if word[:1].isdigit() and "." in word]
    return words[0] if words else first.strip()


def environment_changes(before: TrainerEnvironment, now: TrainerEnvironment | None) -> list[str]:
    """What differs between the halt's environment and today's, one short phrase each (empty: unchanged)."""
    if now is None:
        return [f"its interpreter {before.interpreter} can no longer be run"]
    changes: list[str] = []
    if now.prefix != before.prefix:
        changes.append(f"environment {before.prefix} -> {now.prefix}")
    if now.torch_cuda != before.torch_cuda:
        changes.append(f"torch CUDA build {before.torch_cuda} -> {now.torch_cuda}")
    if now.driver_version != before.driver_version:
        changes.append(f"NVIDIA driver {before.driver_version} -> {now.driver_version}")
    for name in sorted(set(before.distributions) | set(now.distributions)):
        old, new = before.distributions.get(name), now.distributions.get(name)
        if old != new:
            changes.append(f"{name} {old or '(absent)'} -> {new or '(removed)'}")
    return changes


def shares_environment(trainer: TrainerEnvironment) -> str | None:
    """Why this process (datagen) runs in the trainer's environment, or None when it does not.

    The same prefix, or a trainer's site-packages folder on datagen's import path, means that installing
    or upgrading datagen's serving stack changes what training restarts with.
    """
    if Path(sys.prefix).resolve() == Path(trainer.prefix).resolve():
        return f"datagen runs from the training job's environment {trainer.prefix}"
    ours = {str(Path(entry).resolve()) for entry in sys.path if entry}
    for entry in trainer.sys_path:
        if "-packages" in entry and str(Path(entry).resolve()) in ours:
            return f"datagen imports packages from the training job's {entry}"
    return None
