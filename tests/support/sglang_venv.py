"""Small per-version sglang environments for validating our argv and request bodies on a CPU-only box.

``.venv-sglang/<version>/`` is a venv holding the sglang wheel, sglang-router, the few pure-Python packages
that ``sglang.srt.server_args``, the OpenAI protocol models and ``io_struct`` import, and the exact
``transformers``/``xgrammar``/``apache-tvm-ffi``/``kernels`` versions that sglang release pins (its import-time
behaviour depends on them). It is installed from its own lock, ``requirements/sglang-<version>.txt``; torch,
numpy, pydantic, fastapi, ... come from the locked dev ``.venv`` (:mod:`tests.support.locked_venv`). GPU-only
packages (triton, torchvision, sgl-kernel, flashinfer) are stubbed by :mod:`datagen.engines.sglang_introspect`;
releases without sglang's own ``_platform_stubs.py`` get a copy of the newest pinned release's.

Built once (seconds, from the lock) and reused while ``.venv-sglang/<version>/.ready`` names the same lock:
``python -m tests.support.sglang_venv`` (what ``make test`` runs) or on first use by the test fixture.
``make lock`` re-resolves the recipe below (:func:`resolve_recipe`) and rewrites the locks.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

from tests.support.locked_venv import (
    REPO_ROOT,
    build_from_lock,
    is_ready,
    lock_path,
    mark_ready,
    site_packages,
)

VENV_ROOT = REPO_ROOT / ".venv-sglang"
# The sglang releases we support and validate against: the current release, and an older one still in use.
SGLANG_VERSIONS = ("0.5.23", "0.5.14")
SGLANG_ROUTER_VERSION = "0.3.2"
# Installed at the version the sglang release pins: its import-time behaviour depends on them (0.5.14's
# transformers imports `kernels`, whose newer releases refuse its layer table).
PINNED_FROM_SGLANG = ("transformers", "xgrammar", "apache-tvm-ffi", "kernels", "compressed-tensors")
# Installed with --no-deps: their own dependencies are GPU stacks or already in the test interpreter.
NO_DEPS_PINNED = frozenset({"xgrammar", "apache-tvm-ffi", "compressed-tensors"})
# Pure-Python imports of server_args / protocol / io_struct / launch_router missing from the dev venv.
SMALL_DEPS = (
    "pybase64",
    "pillow",
    "msgspec",
    "pyzmq",
    "IPython",
    "setproctitle",
    "partial-json-parser",
    "sentencepiece",
    "loguru",
    "gguf",
    "einops",
    # custom_logit_processor imports dill at import time.
    "dill",
)
# compressed-tensors pulls in a GPU stack as dependencies; sglang only imports its config classes (at the
# release's pin where it has one).
SMALL_NO_DEPS = ("compressed-tensors",)
PIP_TIMEOUT_S = 600


def venv_python(version: str) -> Path:
    """The interpreter of the validation venv for ``version``."""
    return VENV_ROOT / version / "bin" / "python"


def lock_name(version: str) -> str:
    """The lock file's name (``requirements/<name>.txt``) of sglang ``version``'s venv."""
    return f"sglang-{version}"


def _pins(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        text = archive.read(metadata).decode()
    pins: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.split(":", 1)[1].strip())
        name = requirement.name.lower().replace("_", "-")
        if name in PINNED_FROM_SGLANG and requirement.marker is None:
            pins[name] = f"{requirement.name}{requirement.specifier}"
    return pins


def resolve_recipe(version: str) -> tuple[list[str], list[str]]:
    """The venv's recipe for ``make lock``: (installed ``--no-deps``, installed with their dependencies)."""
    with tempfile.TemporaryDirectory() as wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"sglang=={version}", "-d", wheels],
            check=True,
            timeout=PIP_TIMEOUT_S,
        )
        pins = _pins(next(Path(wheels).glob(f"sglang-{version}-*.whl")))
    no_deps = [f"sglang=={version}", f"sglang-router=={SGLANG_ROUTER_VERSION}"]
    no_deps += [name for name in SMALL_NO_DEPS if name not in pins]
    no_deps += [spec for name, spec in pins.items() if name in NO_DEPS_PINNED]
    with_deps = [*SMALL_DEPS, *[spec for name, spec in pins.items() if name not in NO_DEPS_PINNED]]
    return no_deps, with_deps


def add_platform_stubs(version: str, site: Path) -> None:
    """Give a release that predates sglang's own ``_platform_stubs.py`` the newest pinned release's copy."""
    if (site / "sglang" / "_platform_stubs.py").is_file():
        return
    newest = ensure_venv(SGLANG_VERSIONS[0])
    newer_site = site_packages(newest.parent.parent)
    shutil.copy(newer_site / "sglang" / "_platform_stubs.py", site / "_sglang_platform_stubs.py")


def ensure_venv(version: str) -> Path:
    """Build (once) the validation venv of sglang ``version`` from its lock; returns its interpreter."""
    venv = VENV_ROOT / version
    lock = lock_path(lock_name(version))
    if is_ready(venv, lock):
        return venv_python(version)
    site = build_from_lock(venv, lock)
    add_platform_stubs(version, site)
    mark_ready(venv, lock)
    return venv_python(version)


def main() -> int:
    """Build every pinned version's venv (``make test`` runs this first)."""
    for version in SGLANG_VERSIONS:
        print(f"sglang {version}: {ensure_venv(version)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
