"""Small per-version sglang environments for validating our argv and request bodies on a CPU-only box.

``.venv-sglang/<version>/`` is a venv holding the sglang wheel (installed ``--no-deps``), sglang-router, the
few pure-Python packages that ``sglang.srt.server_args``, the OpenAI protocol models and ``io_struct``
import, and the exact ``transformers``/``xgrammar``/``apache-tvm-ffi`` versions that sglang release pins. Everything
else (torch, numpy, pydantic, fastapi, ...) comes from the interpreter running the tests, through a
``.pth`` file that appends its site-packages. GPU-only packages (triton, torchvision, sgl-kernel,
flashinfer) are stubbed by :mod:`datagen.engines.sglang_introspect`; releases without sglang's own
``_platform_stubs.py`` get a copy of the newest pinned release's.

Built once (about a minute each, from PyPI) and reused while ``.venv-sglang/<version>/.ready`` exists:
``python -m tests.support.sglang_venv`` (what ``make test`` runs) or on first use by the test fixture.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_ROOT = REPO_ROOT / ".venv-sglang"
# The sglang releases we support and validate against: the current release, and an older one still in use.
SGLANG_VERSIONS = ("0.5.23", "0.5.14")
SGLANG_ROUTER_VERSION = "0.3.2"
READY_MARKER = ".ready"
# Installed at the version the sglang release pins (its import-time behaviour depends on them).
PINNED_FROM_SGLANG = ("transformers", "xgrammar", "apache-tvm-ffi")
# Installed with --no-deps: their own dependencies are GPU stacks or already in the test interpreter.
NO_DEPS_PINNED = frozenset({"xgrammar", "apache-tvm-ffi"})
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
    # custom_logit_processor imports dill at import time (seen missing on a fresh clone; the dev venv had it
    # only through the `datasets` package).
    "dill",
)
# compressed-tensors pulls in a GPU stack as dependencies; sglang only imports its config classes.
SMALL_NO_DEPS = ("compressed-tensors",)
PIP_TIMEOUT_S = 600


def venv_python(version: str) -> Path:
    """The interpreter of the validation venv for ``version``."""
    return VENV_ROOT / version / "bin" / "python"


def _pip(venv: Path, *args: str) -> None:
    command = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", *args]
    subprocess.run(command, check=True, timeout=PIP_TIMEOUT_S)


def _download_wheel(version: str, into: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"sglang=={version}", "-d", str(into)],
        check=True,
        timeout=PIP_TIMEOUT_S,
    )
    return next(into.glob(f"sglang-{version}-*.whl"))


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


def ensure_venv(version: str) -> Path:
    """Build (once) the validation venv of sglang ``version``; returns its interpreter."""
    venv = VENV_ROOT / version
    if (venv / READY_MARKER).is_file():
        return venv_python(version)
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(
        subprocess.run(
            [str(venv_python(version)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # After the venv's own packages: the test interpreter's torch, numpy, pydantic, fastapi, ...
    (site / "zz_test_interpreter.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheels = venv / "wheels"
    wheels.mkdir()
    wheel = _download_wheel(version, wheels)
    pins = _pins(wheel)
    no_deps = [str(wheel), f"sglang-router=={SGLANG_ROUTER_VERSION}", *SMALL_NO_DEPS]
    no_deps += [spec for name, spec in pins.items() if name in NO_DEPS_PINNED]
    _pip(venv, "--no-deps", *no_deps)
    _pip(venv, *SMALL_DEPS, *[spec for name, spec in pins.items() if name not in NO_DEPS_PINNED])
    shutil.rmtree(wheels)
    if not (site / "sglang" / "_platform_stubs.py").is_file():
        # Older releases have no triton stand-in; the newest pinned release's works for them.
        newest = ensure_venv(SGLANG_VERSIONS[0])
        newer_site = newest.parent.parent / site.relative_to(venv)
        shutil.copy(newer_site / "sglang" / "_platform_stubs.py", site / "_sglang_platform_stubs.py")
    (venv / READY_MARKER).write_text(version + "\n")
    return venv_python(version)


def main() -> int:
    """Build every pinned version's venv (``make test`` runs this first)."""
    for version in SGLANG_VERSIONS:
        print(f"sglang {version}: {ensure_venv(version)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
