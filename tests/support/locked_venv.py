"""Validation venvs installed from their own committed locks, sharing only the locked dev ``.venv``.

A validation venv (a pinned sglang release, a drafter trainer's data code) holds a few packages of its own and
reads everything else (torch, numpy, pydantic, ...) from the interpreter running the tests through a ``.pth``
file that appends that interpreter's site-packages. Both halves are pinned: the venv's own packages come from
``requirements/<name>.txt`` (exact versions with hashes, installed ``--no-deps``: the lock is the whole set),
and the shared half is the dev ``.venv`` installed from ``requirements/dev.txt`` or ``dev-cpu.txt``
(:func:`dev_lock`). Nothing is resolved at build time, so what PyPI publishes after a lock was made never reaches a build.

``requirements/refresh.py`` (``make lock``) writes the locks: it builds each venv once by resolution
(:func:`resolve_into`), then freezes exactly what landed in the venv's own site-packages (:func:`freeze_own`)
and hashes those pins (:func:`lock_text`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
LOCK_DIR = REPO_ROOT / "requirements"
READY_MARKER = ".ready"
UV_TIMEOUT_S = 600
# Where machines of this kind keep the CPU build of torch (pip's find-links; uv reads no pip config). The Makefile
# exports LOCAL_WHEELS: another folder, or empty for none (`make test LOCAL_WHEELS=`: PyPI alone).
DEFAULT_LOCAL_WHEELS = "/opt/wheels"
SHARED_PTH = "zz_test_interpreter.pth"
# sglang's wheels need glibc 2.34 (this kind of machine has 2.36).
VALIDATION_PLATFORM = "x86_64-manylinux_2_34"


def local_wheels() -> Path | None:
    """The wheel folder offered beside PyPI: ``$LOCAL_WHEELS`` (empty: none), else ``/opt/wheels`` if present."""
    folder = os.environ.get("LOCAL_WHEELS", DEFAULT_LOCAL_WHEELS)
    return Path(folder) if folder and Path(folder).is_dir() else None


def uv(*args: str) -> list[str]:
    """The uv command of the dev ``.venv`` (installed from ``requirements/bootstrap.txt``)."""
    command = [sys.executable, "-m", "uv", *args]
    wheels = local_wheels()
    if args and args[0] == "pip" and wheels is not None:
        command += ["--find-links", str(wheels)]
    return command


def dev_lock() -> Path:
    """The dev lock this interpreter's venv was synced to: ``dev-cpu.txt`` where torch is its CPU build."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = ""
    return LOCK_DIR / ("dev-cpu.txt" if torch_version.endswith("+cpu") else "dev.txt")


def lock_path(name: str) -> Path:
    """The committed lock of validation venv ``name``."""
    return LOCK_DIR / f"{name}.txt"


def lock_digest(lock: Path) -> str:
    """What a built venv records in its ready marker: the lock it was built from."""
    return hashlib.sha256(lock.read_bytes()).hexdigest() + "\n"


def site_packages(venv: Path) -> Path:
    """The venv's own purelib folder."""
    answer = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(answer.stdout.strip())


def _fresh_venv(venv: Path) -> Path:
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = site_packages(venv)
    # After the venv's own packages: the test interpreter's (locked) torch, numpy, pydantic, ...
    (site / SHARED_PTH).write_text(sysconfig.get_paths()["purelib"] + "\n")
    return site


def is_ready(venv: Path, lock: Path) -> bool:
    """Whether ``venv`` was built from exactly ``lock``."""
    marker = venv / READY_MARKER
    return marker.is_file() and marker.read_text() == lock_digest(lock)


def build_from_lock(venv: Path, lock: Path) -> Path:
    """Build ``venv`` from ``lock`` (``--no-deps --require-hashes``); returns its site-packages."""
    site = _fresh_venv(venv)
    python = str(venv / "bin" / "python")
    command = uv("pip", "install", "--python", python, "--no-deps", "--require-hashes", "-q", "-r", str(lock))
    subprocess.run(command, check=True, timeout=UV_TIMEOUT_S)
    return site


def mark_ready(venv: Path, lock: Path) -> None:
    """Record that ``venv`` holds ``lock``'s packages (written last)."""
    (venv / READY_MARKER).write_text(lock_digest(lock))


def resolve_into(venv: Path, no_deps: list[str], with_deps: list[str]) -> Path:
    """Build ``venv`` by resolution (refresh only): ``no_deps`` alone, then ``with_deps`` with what they need.

    The resolver sees the shared site-packages as installed, so only what the dev ``.venv`` lacks (or pins
    differently from what these packages require) lands in the venv itself.
    """
    site = _fresh_venv(venv)
    python = str(venv / "bin" / "python")
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q"]
    if no_deps:
        subprocess.run([*pip, "--no-deps", *no_deps], check=True, timeout=UV_TIMEOUT_S)
    if with_deps:
        subprocess.run([*pip, *with_deps], check=True, timeout=UV_TIMEOUT_S)
    return site


def freeze_own(site: Path) -> list[str]:
    """``name==version`` of every distribution installed in ``site`` itself, sorted."""
    pins = {
        (dist.metadata["Name"].lower().replace("_", "-"), dist.version)
        for dist in metadata.distributions(path=[str(site)])
    }
    return [f"{name}=={version}" for name, version in sorted(pins)]


def lock_text(pins: list[str], header: str) -> str:
    """The hashed lock of exactly ``pins`` (``uv pip compile --no-deps --generate-hashes``)."""
    source = LOCK_DIR / ".pins.in"
    source.write_text("\n".join(pins) + "\n")
    try:
        answer = subprocess.run(
            uv(
                "pip",
                "compile",
                "--no-deps",
                "--generate-hashes",
                "--no-header",
                "--no-annotate",
                "--python-version",
                "3.11",
                "--python-platform",
                VALIDATION_PLATFORM,
                "-q",
                str(source),
            ),
            capture_output=True,
            text=True,
            timeout=UV_TIMEOUT_S,
        )
    finally:
        source.unlink()
    if answer.returncode != 0:
        raise RuntimeError(f"uv pip compile failed for {pins}:\n{answer.stderr}")
    return header + answer.stdout
