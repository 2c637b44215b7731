"""Refresh every lock of the project: ``make lock`` (the one command; commit what it rewrites).

Each environment the project makes installs exactly one of these files, never a fresh resolution:

- ``dev.txt``: ``pyproject.toml``'s dependencies with the ``local`` and ``dev`` extras, resolved from PyPI alone
  for every interpreter from CPython 3.11 and every platform (a universal lock: markers say where a pin applies);
  torch is PyPI's build, which on Linux is built for CUDA and brings CUDA's runtime wheels (``nvidia-*``,
  ``cuda-*``, ``triton``). ``make setup``, ``make demo`` and ``make test`` sync ``.venv`` to it.
- ``dev-cpu.txt``: the same pins with torch's CPU build instead (``+cpu``, no CUDA wheels), from the wheel folder
  machines of this kind keep (``/opt/wheels``; the Makefile's ``LOCAL_WHEELS`` names another, or none when empty);
  the Makefile takes it where that folder holds the build for the interpreter and machine at hand
  (:func:`dev_lock_for`).
- ``bootstrap.txt``: uv, the installer, at ``dev.txt``'s version (pip installs it into a new ``.venv``).
- ``build.txt``: setuptools and wheel for the editable install of datagen itself.
- ``gpu.txt``: the serving set a GPU host installs into an environment of its own (never the trainer's):
  the dependencies with the ``gpu`` extra (sglang, its CUDA torch), for CPython 3.12 on Linux x86_64.
- ``sglang-<version>.txt``, ``trainer-<name>.txt``, ``transformers-gpu.txt``: the validation venvs' own packages
  (:mod:`tests.support.locked_venv`).

``dev.txt`` and ``gpu.txt`` record a digest of the declarations they were compiled from;
``tests/unit/test_locks.py`` fails when ``pyproject.toml`` and a lock disagree.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

LOCK_DIR = REPO_ROOT / "requirements"
PYPROJECT = REPO_ROOT / "pyproject.toml"
DIGEST_PREFIX = "# pyproject-digest: "
REFRESH_COMMAND = "make lock"
# The dev locks' lowest interpreter; they are universal (every later interpreter, every platform).
DEV_PYTHON = "3.11"
# The GPU hosts' serving set: CPython 3.12 (what the H200 hosts run), sglang's wheels need glibc 2.34.
GPU_TARGET = ("3.12", "x86_64-manylinux_2_34")
# torch's release in both dev locks: the CPU build of it lies on this kind of machine's disk (uv pins a local
# version such as ``2.13.0+cpu`` on its own, with its own hashes: one pin cannot name both builds).
TORCH_VERSION = "2.13.0"
CPU_TORCH_LOCAL = "+cpu"
# Where machines of this kind keep torch's CPU build (pip's find-links; uv reads no pip config); `make lock` needs it.
TORCH_WHEELS = Path("/opt/wheels")
# A pin line of a compiled lock: the requirement (with its marker, if any), then its name.
_PIN_LINE = r"^(([A-Za-z0-9][A-Za-z0-9._-]*)==[^\s;\\]+(?: ; [^\\]+?)?)\s*\\?$"
LOCKS: dict[str, tuple[tuple[str, ...], tuple[str, str] | None]] = {
    "dev.txt": (("local", "dev"), None),
    "dev-cpu.txt": (("local", "dev"), None),
    "gpu.txt": (("gpu",), GPU_TARGET),
}


def declared(extras: tuple[str, ...]) -> list[str]:
    """The requirement strings a lock is compiled from: the dependencies plus ``extras``, as written."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    return list(project["dependencies"]) + [req for extra in extras for req in optional[extra]]


def declaration_digest(extras: tuple[str, ...]) -> str:
    """A digest of what a lock is compiled from: any change to those declarations asks for ``make lock``."""
    return hashlib.sha256(json.dumps(declared(extras)).encode()).hexdigest()


def recorded_digest(lock: Path) -> str | None:
    """The digest a lock file recorded when it was compiled."""
    for line in lock.read_text().splitlines():
        if line.startswith(DIGEST_PREFIX):
            return line.removeprefix(DIGEST_PREFIX).strip()
    return None


def _uv(*args: str) -> list[str]:
    return [sys.executable, "-m", "uv", *args]


def dev_lock_for(python_tag: str, machine: str, wheels: Path | None) -> Path:
    """The dev lock to install: ``dev-cpu.txt`` where ``wheels`` holds its torch for this interpreter and machine.

    Args:
        python_tag: The interpreter's wheel tag, such as ``cp311``.
        machine: ``platform.machine()`` of the host, such as ``x86_64``.
        wheels: The folder that may hold torch's CPU build (``None``: PyPI alone).

    Returns:
        ``dev-cpu.txt`` when a wheel of its torch fits, ``dev.txt`` (PyPI alone) otherwise.
    """
    cpu_build = f"torch-{TORCH_VERSION}{CPU_TORCH_LOCAL}-{python_tag}-{python_tag}-*_{machine}.whl"
    if wheels is not None and wheels.is_dir() and any(wheels.glob(cpu_build)):
        return LOCK_DIR / "dev-cpu.txt"
    return LOCK_DIR / "dev.txt"


def lock_pins(lock: Path) -> list[tuple[str, str]]:
    """``(name, requirement)`` of every pin in a compiled lock, its marker kept (``numpy==2.4.6 ; ...``).

    A universal lock may pin one package twice, at two versions under two markers.
    """
    found = re.findall(_PIN_LINE, lock.read_text(), flags=re.M)
    return [(name, requirement) for requirement, name in found]


def _constraints(name: str) -> str:
    """What lock ``name`` is held to: its torch, and for ``dev-cpu.txt`` every other pin of ``dev.txt``."""
    if name == "dev.txt":
        return f"torch=={TORCH_VERSION}\n"
    if name == "dev-cpu.txt":
        others = [requirement for pkg, requirement in lock_pins(LOCK_DIR / "dev.txt") if pkg != "torch"]
        return f"torch=={TORCH_VERSION}{CPU_TORCH_LOCAL}\n" + "".join(f"{line}\n" for line in others)
    return ""


def compile_project_lock(name: str) -> None:
    """``uv pip compile`` of ``pyproject.toml`` with the extras and target of lock ``name``.

    ``dev.txt`` and ``gpu.txt`` see PyPI alone; ``dev-cpu.txt`` also sees the wheel folder that holds torch's CPU
    build, and is held to ``dev.txt``'s other pins so the two locks differ only where torch's builds do.
    """
    extras, target = LOCKS[name]
    if name == "dev-cpu.txt" and not any(TORCH_WHEELS.glob(f"torch-{TORCH_VERSION}{CPU_TORCH_LOCAL}-*.whl")):
        raise SystemExit(
            f"dev-cpu.txt pins torch's CPU build, which must lie in {TORCH_WHEELS} to be locked (download "
            f"torch=={TORCH_VERSION}{CPU_TORCH_LOCAL} from https://download.pytorch.org/whl/cpu there first)"
        )
    where = ["--universal", "--python-version", DEV_PYTHON]
    if target is not None:
        where = ["--python-version", target[0], "--python-platform", target[1]]
    sources = ["--find-links", str(TORCH_WHEELS)] if name == "dev-cpu.txt" else []
    with tempfile.TemporaryDirectory() as scratch:
        constraints = Path(scratch) / "constraints.txt"
        constraints.write_text(_constraints(name))
        command = _uv(
            "pip",
            "compile",
            str(PYPROJECT),
            *[flag for extra in extras for flag in ("--extra", extra)],
            "--generate-hashes",
            *where,
            *sources,
            "--constraint",
            str(constraints),
            "--custom-compile-command",
            REFRESH_COMMAND,
            "-q",
        )
        compiled = subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO_ROOT).stdout
    # uv prints the constraint file's temporary path in its annotations: keep the lock the same on every refresh.
    compiled = re.sub(r"-c /tmp/\S+", "-c constraints", compiled)
    header = f"{DIGEST_PREFIX}{declaration_digest(extras)}\n"
    (LOCK_DIR / name).write_text(header + compiled)


def pinned_block(lock: Path, package: str) -> str:
    """The lines of ``package``'s pin (with its hashes) in a compiled lock."""
    lines = lock.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{package}=="))
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith("    --hash="):
            break
        block.append(line)
    return "\n".join(block).rstrip(" \\") + "\n"


def write_bootstrap() -> None:
    """``bootstrap.txt``: uv's pin copied from ``dev.txt``, so the installer is the version the lock holds."""
    header = f"# uv, installed by pip into a new .venv; copied from dev.txt by `{REFRESH_COMMAND}`.\n"
    (LOCK_DIR / "bootstrap.txt").write_text(header + pinned_block(LOCK_DIR / "dev.txt", "uv"))


def write_build() -> None:
    """``build.txt``: the build backend of datagen's own editable install."""
    from tests.support.locked_venv import lock_text

    project = tomllib.loads(PYPROJECT.read_text())
    requires = project["build-system"]["requires"]
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "build.in"
        source.write_text("\n".join(requires) + "\n")
        resolved = subprocess.run(
            _uv("pip", "compile", str(source), "--no-header", "--no-annotate", "-q"),
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
    header = (
        f"# The build backend of datagen's editable install ({', '.join(requires)}); `{REFRESH_COMMAND}`.\n"
    )
    (LOCK_DIR / "build.txt").write_text(lock_text(resolved, header))


def write_validation_locks() -> None:
    """Resolve each validation venv's recipe once, freeze what landed in the venv itself, lock it."""
    from tests.support import sglang_venv, trainer_venvs, transformers_gpu_venv
    from tests.support.locked_venv import freeze_own, lock_path, lock_text, resolve_into

    recipes: dict[str, tuple[list[str], list[str]]] = {
        transformers_gpu_venv.LOCK_NAME: transformers_gpu_venv.recipe()
    }
    for version in sglang_venv.SGLANG_VERSIONS:
        recipes[sglang_venv.lock_name(version)] = sglang_venv.resolve_recipe(version)
    for trainer, spec in trainer_venvs.TRAINERS.items():
        recipes[trainer_venvs.lock_name(trainer)] = (list(spec["no_deps"]), list(spec["deps"]))
    for name, (no_deps, with_deps) in recipes.items():
        with tempfile.TemporaryDirectory() as scratch:
            site = resolve_into(Path(scratch) / "venv", no_deps, with_deps)
            pins = freeze_own(site)
        header = (
            f"# {name}: the packages of its validation venv itself (the rest is dev.txt's, shared).\n"
            f"# Recipe: --no-deps {' '.join(no_deps)}; with dependencies {' '.join(with_deps) or 'none'}.\n"
            f"# Installed with --no-deps --require-hashes; refreshed by `{REFRESH_COMMAND}`.\n"
        )
        lock_path(name).write_text(lock_text(pins, header))
        print(f"{name}: {len(pins)} packages")


def main() -> int:
    """``project``: compile the project's locks; ``validation``: the validation venvs' (against ``.venv``).

    ``dev-lock``: print the dev lock this interpreter and machine install (the Makefile asks).

    ``make lock`` runs ``project``, syncs ``.venv`` to the new ``dev.txt``, then runs ``validation``: the
    validation venvs share ``.venv``, so they are resolved against the dev lock they will run with.
    """
    stage = sys.argv[1] if len(sys.argv) > 1 else ""
    if stage == "project":
        for name in LOCKS:
            compile_project_lock(name)
            print(f"{name}: compiled")
        write_bootstrap()
        write_build()
    elif stage == "validation":
        write_validation_locks()
    elif stage == "dev-lock":
        python_tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
        from tests.support.locked_venv import local_wheels

        print(dev_lock_for(python_tag, platform.machine(), local_wheels()).relative_to(REPO_ROOT))
    else:
        print(
            "usage: refresh.py project|validation|dev-lock (`make lock` runs the first two)", file=sys.stderr
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
