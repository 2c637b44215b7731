"""The committed locks agree with pyproject.toml, and every environment holds exactly what its lock pins."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest
from packaging.markers import Marker, default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support import sglang_venv, trainer_venvs, transformers_gpu_venv
from tests.support.locked_venv import LOCK_DIR, dev_lock, lock_path

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)(?: ; ([^\\]+?))?\s*\\?$")
# Installed into every venv by `python -m venv` itself, and datagen's own editable install.
SEED_AND_SELF = {"pip", "setuptools", "datagen"}


def _refresh() -> ModuleType:
    spec = importlib.util.spec_from_file_location("refresh", LOCK_DIR / "refresh.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pins(lock: Path, environment: dict[str, str] | None = None) -> dict[str, str]:
    """``{canonical name: version}`` of every pin in a lock, checking each carries a hash.

    A universal lock may pin a package twice under two markers: with ``environment``, only the pins whose
    marker holds there count (this interpreter's, for what a venv holds).
    """
    lines = lock.read_text().splitlines()
    found: dict[str, str] = {}
    for index, line in enumerate(lines):
        match = PIN.match(line)
        if match:
            assert index + 1 < len(lines) and "--hash=sha256:" in lines[index + 1], (
                f"{lock.name}: {line} has no hash"
            )
            if environment is None or match[3] is None or Marker(match[3]).evaluate(environment):
                found[canonicalize_name(match[1])] = match[2]
    return found


PROJECT_LOCKS = ["dev.txt", "dev-cpu.txt", "gpu.txt"]


def _check_pypi() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_pypi", LOCK_DIR / "check_pypi.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_pypi"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("lock_name", PROJECT_LOCKS)
def test_a_project_lock_was_compiled_from_todays_pyproject(lock_name: str) -> None:
    refresh = _refresh()
    extras, _ = refresh.LOCKS[lock_name]
    recorded = refresh.recorded_digest(LOCK_DIR / lock_name)
    assert recorded == refresh.declaration_digest(extras), (
        f"pyproject.toml's dependencies changed since requirements/{lock_name} was compiled: run `make lock`"
    )


@pytest.mark.parametrize("lock_name", PROJECT_LOCKS)
def test_every_declared_requirement_is_pinned_at_a_version_it_allows(lock_name: str) -> None:
    refresh = _refresh()
    extras, target = refresh.LOCKS[lock_name]
    python_version = target[0] if target else refresh.DEV_PYTHON
    environment = {**default_environment(), "python_version": python_version, "sys_platform": "linux"}
    locked = pins(LOCK_DIR / lock_name)
    for text in refresh.declared(extras):
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        name = canonicalize_name(requirement.name)
        assert name in locked, f"{text} is declared but not in requirements/{lock_name}: run `make lock`"
        assert requirement.specifier.contains(Version(locked[name]), prereleases=True), (
            f"requirements/{lock_name} pins {name}=={locked[name]}, outside {text}: run `make lock`"
        )


def test_the_dev_locks_differ_only_in_torchs_build_and_the_bootstrap_holds_their_uv() -> None:
    pypi, cpu = pins(LOCK_DIR / "dev.txt"), pins(LOCK_DIR / "dev-cpu.txt")
    assert cpu["torch"] == pypi["torch"] + "+cpu"
    only_pypi = set(pypi) - set(cpu)
    assert only_pypi and all(name.startswith(("nvidia-", "cuda-", "triton")) for name in only_pypi), only_pypi
    assert {name for name in set(cpu) - set(pypi)} <= {"httpx2-jsfetch", "pywin32"}  # resolved apart per fork
    assert {name: cpu[name] for name in cpu if name in pypi and name != "torch"} == {
        name: pypi[name] for name in cpu if name in pypi and name != "torch"
    }
    assert pins(LOCK_DIR / "bootstrap.txt") == {"uv": pypi["uv"]}


def test_the_cpu_lock_is_installed_only_where_the_wheel_folder_holds_its_torch_for_this_interpreter(
    tmp_path: Path,
) -> None:
    refresh = _refresh()
    assert refresh.dev_lock_for("cp311", "x86_64", tmp_path / "absent").name == "dev.txt"
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    assert refresh.dev_lock_for("cp311", "x86_64", tmp_path).name == "dev-cpu.txt"
    assert refresh.dev_lock_for("cp312", "x86_64", tmp_path).name == "dev.txt"
    assert refresh.dev_lock_for("cp311", "aarch64", tmp_path).name == "dev.txt"
    assert refresh.dev_lock_for("cp311", "x86_64", None).name == "dev.txt"


def test_an_empty_local_wheels_variable_installs_the_pypi_lock_even_where_the_folder_holds_the_cpu_build(
    tmp_path: Path,
) -> None:
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    (tmp_path / f"torch-2.13.0+cpu-{tag}-{tag}-manylinux_2_28_{platform.machine()}.whl").touch()

    def dev_lock(local_wheels: str) -> str:
        env = {**os.environ, "LOCAL_WHEELS": local_wheels}
        command = [sys.executable, str(LOCK_DIR / "refresh.py"), "dev-lock"]
        return subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout.strip()

    assert dev_lock(str(tmp_path)) == "requirements/dev-cpu.txt"
    assert dev_lock("") == "requirements/dev.txt"


def test_the_pypi_check_fails_a_pin_built_elsewhere_or_missing_a_wheel_for_a_target() -> None:
    check = _check_pypi()
    lock = (
        "torch==2.13.0+cpu \\\n    --hash=sha256:" + "a" * 64 + "\n"
        "pyyaml==6.0.3 \\\n    --hash=sha256:" + "b" * 64 + " \\\n    --hash=sha256:" + "c" * 64 + "\n"
        "uvloop==0.23.0 ; sys_platform != 'win32' \\\n    --hash=sha256:" + "d" * 64 + "\n"
    )
    index = {
        "torch": check.pypi_files(
            {
                "files": [
                    {
                        "filename": "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl",
                        "hashes": {"sha256": "e" * 64},
                    }
                ]
            }
        ),
        "pyyaml": check.pypi_files(
            {
                "files": [
                    {
                        "filename": "pyyaml-6.0.3-cp311-cp311-manylinux_2_17_x86_64.whl",
                        "hashes": {"sha256": "b" * 64},
                    }
                ]
            }
        ),
        "uvloop": check.pypi_files(
            {"files": [{"filename": "uvloop-0.23.0.tar.gz", "hashes": {"sha256": "d" * 64}}]}
        ),
    }
    targets = [check.Target((3, 11), "x86_64", (2, 28)), check.Target((3, 11), "aarch64", (2, 28))]
    found = check.problems("dev.txt", check.parse_lock(lock), targets, index)
    assert found == [
        "dev.txt: torch==2.13.0+cpu is not on PyPI",
        "dev.txt: pyyaml==6.0.3 lists 1 sha256 PyPI does not hold (a build from another source): cccccccccccccccc...",
        "dev.txt: pyyaml==6.0.3 has no PyPI file for CPython 3.11 on Linux aarch64",
    ]
    assert check.problems("dev-cpu.txt", check.parse_lock(lock), targets[:1], index) == [
        found[1].replace("dev.txt", "dev-cpu.txt")
    ]


def test_the_serving_lock_holds_sglang_and_never_the_cpu_torch() -> None:
    gpu = pins(LOCK_DIR / "gpu.txt")
    assert Requirement("sglang>=0.5.23,<0.6").specifier.contains(gpu["sglang"])
    assert "sglang-router" in gpu
    assert not gpu["torch"].endswith("+cpu")


def test_each_validation_lock_pins_its_release() -> None:
    for version in sglang_venv.SGLANG_VERSIONS:
        locked = pins(lock_path(sglang_venv.lock_name(version)))
        assert locked["sglang"] == version
        assert locked["sglang-router"] == sglang_venv.SGLANG_ROUTER_VERSION
        assert "transformers" in locked and "kernels" in locked
    for trainer, spec in trainer_venvs.TRAINERS.items():
        locked = pins(lock_path(trainer_venvs.lock_name(trainer)))
        for requirement in spec["no_deps"]:
            parsed = Requirement(requirement)
            assert parsed.specifier.contains(locked[canonicalize_name(parsed.name)])


def test_the_template_venv_holds_the_serving_sets_transformers() -> None:
    gpu = pins(LOCK_DIR / "gpu.txt")
    assert pins(lock_path(transformers_gpu_venv.LOCK_NAME)) == {
        name: gpu[name] for name in transformers_gpu_venv.PACKAGES
    }


def test_the_dev_venv_holds_exactly_the_dev_lock() -> None:
    locked = pins(dev_lock(), dict(default_environment()))
    installed = {canonicalize_name(dist.metadata["Name"]): dist.version for dist in metadata.distributions()}
    extra = {
        name: version
        for name, version in installed.items()
        if name not in locked and name not in SEED_AND_SELF
    }
    assert not extra, f"installed but not locked (make setup syncs .venv to {dev_lock().name}): {extra}"
    differing = {
        name: (version, locked[name])
        for name, version in installed.items()
        if locked.get(name, version) != version
    }
    assert not differing, f"installed at another version than locked: {differing}"


def _visible_distributions(python: Path) -> list[tuple[str, str, str]]:
    """(name, version, folder) of every distribution on ``python``'s path, shadowed ones included."""
    script = (
        "import json, importlib.metadata as m\n"
        "print(json.dumps([[d.metadata['Name'], d.version, str(d._path.parent)] for d in m.distributions()]))"
    )
    answer = subprocess.run([str(python), "-c", script], check=True, capture_output=True, text=True)
    return [(canonicalize_name(name), version, where) for name, version, where in json.loads(answer.stdout)]


VALIDATION_VENVS = [
    *[
        (sglang_venv.ensure_venv, version, sglang_venv.lock_name(version))
        for version in sglang_venv.SGLANG_VERSIONS
    ],
    *[
        (trainer_venvs.ensure_venv, trainer, trainer_venvs.lock_name(trainer))
        for trainer in trainer_venvs.TRAINERS
    ],
    (lambda _: transformers_gpu_venv.ensure_venv(), "", transformers_gpu_venv.LOCK_NAME),
]


@pytest.mark.parametrize(
    ("ensure", "key", "lock_name"), VALIDATION_VENVS, ids=[v[2] for v in VALIDATION_VENVS]
)
def test_a_validation_venv_sees_only_locked_packages(ensure, key: str, lock_name: str) -> None:  # type: ignore[no-untyped-def]
    """What a validation venv imports is its own lock's or, through the shared .pth, the dev lock's."""
    python = ensure(key)
    own = pins(lock_path(lock_name))
    dev = pins(dev_lock(), dict(default_environment()))
    own_site = str(Path(python).parent.parent)
    for name, version, where in _visible_distributions(python):
        if where.startswith(own_site):
            assert own.get(name) == version, f"{lock_name}: {name}=={version} is in the venv but not its lock"
        elif name not in SEED_AND_SELF:
            assert dev.get(name) == version, f"{lock_name}: {name}=={version} leaks in from {where} unpinned"


def test_the_validation_venvs_are_built_with_this_interpreter() -> None:
    assert sys.version_info[:2] in ((3, 11), (3, 12)), "the dev locks support CPython 3.11 and 3.12"
