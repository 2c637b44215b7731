"""Check that every committed lock installs from PyPI alone: ``make check-locks`` (CI runs it before the tests).

For each lock and each interpreter and machine it serves (:data:`TARGETS`), every pin whose marker holds there must
name a PyPI file of its version that installs there (a wheel whose tags fit, or a source distribution) and whose
sha256 the lock lists; and every sha256 a lock lists must be one of PyPI's files of that version. A build that
exists only in a local wheel folder or on another index (``torch==2.13.0+cpu``) therefore fails the check, except
in ``dev-cpu.txt``, whose torch is that build by design (:data:`LOCAL_BY_DESIGN`).

PyPI's simple JSON API (PEP 691) answers it: one request per locked project, nothing downloaded, so the check costs
seconds where installing ``dev.txt`` costs gigabytes.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
from packaging.markers import Marker
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

LOCK_DIR = Path(__file__).resolve().parent
PYPI_SIMPLE = "https://pypi.org/simple"
PEP_691 = "application/vnd.pypi.simple.v1+json"
REQUEST_TIMEOUT_S = 60
# PyPI answers many small requests at once; more than this gains nothing on a CI runner.
PARALLEL_REQUESTS = 16
# The oldest glibc the dev locks promise (RHEL 8, Debian 10; every Ubuntu LTS since 20.04 has more): torch's wheels
# are manylinux_2_28.
DEV_GLIBC = (2, 28)
# sglang's wheels need glibc 2.34 (the GPU hosts').
GPU_GLIBC = (2, 34)


@dataclass(frozen=True)
class Target:
    """One interpreter on one machine a lock promises to install on."""

    python: tuple[int, int]
    machine: str
    glibc: tuple[int, int]

    def __str__(self) -> str:
        return f"CPython {self.python[0]}.{self.python[1]} on Linux {self.machine}"

    def tags(self) -> set[Tag]:
        """Every wheel tag an installer accepts for this target."""
        platforms = [f"manylinux_2_{minor}_{self.machine}" for minor in range(self.glibc[1], 16, -1)]
        platforms += [f"manylinux2014_{self.machine}"]
        if self.machine == "x86_64":
            platforms += ["manylinux2010_x86_64", "manylinux1_x86_64"]
        return set(cpython_tags(self.python, platforms=platforms)) | set(
            compatible_tags(self.python, platforms=platforms)
        )

    def environments(self) -> list[dict[str, str]]:
        """The marker environments of the first and a late patch release (markers may name patch releases)."""
        version = f"{self.python[0]}.{self.python[1]}"
        base = {
            "implementation_name": "cpython",
            "implementation_version": f"{version}.0",
            "os_name": "posix",
            "platform_machine": self.machine,
            "platform_python_implementation": "CPython",
            "platform_system": "Linux",
            "python_version": version,
            "sys_platform": "linux",
            "platform_release": "",
            "platform_version": "",
        }
        return [{**base, "python_full_version": f"{version}.{patch}"} for patch in (0, 99)]


def _targets(
    pythons: Iterable[tuple[int, int]], machines: Iterable[str], glibc: tuple[int, int]
) -> list[Target]:
    return [Target(python, machine, glibc) for python in pythons for machine in machines]


DEV_TARGETS = _targets([(3, 11), (3, 12)], ["x86_64", "aarch64"], DEV_GLIBC)
# The validation venvs (sglang's parsers, the trainers' data code) run beside the dev venv wherever `make test` runs:
# the machines the dev lock serves, with the glibc sglang's wheels need.
VALIDATION_TARGETS = _targets([(3, 11), (3, 12)], ["x86_64", "aarch64"], GPU_GLIBC)
TARGETS: dict[str, list[Target]] = {
    "dev.txt": DEV_TARGETS,
    "dev-cpu.txt": _targets([(3, 11)], ["x86_64"], DEV_GLIBC),
    "bootstrap.txt": DEV_TARGETS,
    "build.txt": DEV_TARGETS,
    "gpu.txt": _targets([(3, 12)], ["x86_64"], GPU_GLIBC),
    **{lock.name: VALIDATION_TARGETS for lock in sorted(LOCK_DIR.glob("sglang-*.txt"))},
    **{lock.name: VALIDATION_TARGETS for lock in sorted(LOCK_DIR.glob("trainer-*.txt"))},
    "transformers-gpu.txt": VALIDATION_TARGETS,
}
# Pins whose build is not PyPI's on purpose: the lock exists for it.
LOCAL_BY_DESIGN = {("dev-cpu.txt", "torch")}

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)\s*(?:;\s*([^\\]+?))?\s*\\?$")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


@dataclass(frozen=True)
class Pin:
    """One ``name==version`` of a lock with its marker and the sha256 digests it accepts."""

    name: str
    version: str
    marker: str | None
    hashes: frozenset[str]


@dataclass(frozen=True)
class PypiFile:
    """One file PyPI holds for a project: its version, sha256, and wheel tags (empty for a source archive)."""

    version: Version
    sha256: str
    tags: frozenset[Tag]


def parse_lock(text: str) -> list[Pin]:
    """The pins of a lock in ``uv pip compile --generate-hashes`` form."""
    pins: list[Pin] = []
    lines = text.splitlines()
    for index, line in enumerate(lines):
        match = _PIN.match(line)
        if not match:
            continue
        hashes: set[str] = set()
        for follower in lines[index + 1 :]:
            found = _HASH.search(follower)
            if not found:
                break
            hashes.add(found[1])
        pins.append(Pin(canonicalize_name(match[1]), match[2], match[3], frozenset(hashes)))
    return pins


def pypi_files(answer: Mapping[str, object]) -> list[PypiFile]:
    """The files of a PEP 691 project page that name a version (wheels and source archives)."""
    files: list[PypiFile] = []
    for entry in answer.get("files", []):  # type: ignore[union-attr]
        filename, sha256 = entry["filename"], entry.get("hashes", {}).get("sha256")
        if not sha256 or entry.get("yanked"):
            continue
        try:
            if filename.endswith(".whl"):
                _, version, _, tags = parse_wheel_filename(filename)
                files.append(PypiFile(version, sha256, frozenset(tags)))
            else:
                _, version = parse_sdist_filename(filename)
                files.append(PypiFile(version, sha256, frozenset()))
        except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
            continue
    return files


def problems(
    lock_name: str, pins: list[Pin], targets: list[Target], index: Mapping[str, list[PypiFile]]
) -> list[str]:
    """What keeps ``pins`` from installing from PyPI alone on each of ``targets`` (empty when nothing does)."""
    found: list[str] = []
    for pin in pins:
        if (lock_name, pin.name) in LOCAL_BY_DESIGN:
            continue
        version = Version(pin.version)
        released = {file.sha256: file for file in index.get(pin.name, []) if file.version == version}
        if not released:
            found.append(f"{lock_name}: {pin.name}=={pin.version} is not on PyPI")
            continue
        elsewhere = sorted(pin.hashes - released.keys())
        if elsewhere:
            found.append(
                f"{lock_name}: {pin.name}=={pin.version} lists {len(elsewhere)} sha256 PyPI does not hold "
                f"(a build from another source): {elsewhere[0][:16]}..."
            )
        offered = [released[digest] for digest in pin.hashes & released.keys()]
        for target in targets:
            marker = Marker(pin.marker) if pin.marker else None
            if marker is not None and not any(marker.evaluate(env) for env in target.environments()):
                continue
            accepted = target.tags()
            if not any(not file.tags or file.tags & accepted for file in offered):
                found.append(f"{lock_name}: {pin.name}=={pin.version} has no PyPI file for {target}")
    return found


def fetch_index(names: Iterable[str]) -> dict[str, list[PypiFile]]:
    """PyPI's files of every project in ``names`` (one PEP 691 request each)."""

    def one(client: httpx.Client, name: str) -> tuple[str, list[PypiFile]]:
        answer = client.get(f"{PYPI_SIMPLE}/{name}/", headers={"Accept": PEP_691})
        if answer.status_code == 404:
            return name, []
        answer.raise_for_status()
        return name, pypi_files(answer.json())

    with (
        httpx.Client(timeout=REQUEST_TIMEOUT_S, follow_redirects=True) as client,
        ThreadPoolExecutor(PARALLEL_REQUESTS) as pool,
    ):
        return dict(pool.map(lambda name: one(client, name), sorted(set(names))))


def main() -> int:
    """Check every lock of :data:`TARGETS`; print what fails and exit 1, or one line per lock and exit 0."""
    locks = {name: parse_lock((LOCK_DIR / name).read_text()) for name in TARGETS}
    index = fetch_index(pin.name for pins in locks.values() for pin in pins)
    failed = False
    for name, pins in locks.items():
        found = problems(name, pins, TARGETS[name], index)
        failed = failed or bool(found)
        for line in found:
            print(line, file=sys.stderr)
        where = ", ".join(str(target) for target in TARGETS[name])
        print(f"{name}: {len(pins)} pins, {'FAILED' if found else 'all on PyPI'} for {where}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
