"""What JIT kernel builds on a GPU host need, found without importing torch or sglang.

- :class:`TorchInfo`: torch's version and CUDA build, read from ``torch/version.py`` (no import), and on
  GPU hosts whether CUDA works and which SMs the build has (a short ``python -c`` in a subprocess).
- :class:`CudaToolkit`: where CUDA headers and libraries are: the CCCL headers (``nv/target``; CUDA 13
  moved them to ``include/cccl``), ``libcudart`` and the ``libcuda.so`` link stub that JIT builds
  (flashinfer, Triton, sglang kernels) need.
- :func:`jit_env_fixes`: the environment that makes the found headers and stubs visible to a server.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

TORCH_PROBE_TIMEOUT_S = 120.0
# Printed by a subprocess so the orchestrator never imports torch (seconds, and CUDA initialisation).
# Its output is what a recorded bundle keeps as ``torch.txt``.
TORCH_PROBE_CODE = (
    "import torch\n"
    "print('torch_version=' + torch.__version__)\n"
    "print('cuda=' + str(torch.version.cuda))\n"
    "available = torch.cuda.is_available()\n"
    "print('cuda_available=' + str(available))\n"
    "print('device_count=' + str(torch.cuda.device_count() if available else 0))\n"
    "print('arch_list=' + ' '.join(torch.cuda.get_arch_list() if available else []))\n"
)
DRIVER_LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib/wsl/lib",
)


class TorchInfo(BaseModel):
    """torch as installed for the servers' interpreter."""

    model_config = ConfigDict(extra="forbid")

    version: str | None = None
    cuda: str | None = Field(default=None, description="CUDA version torch was built with; None: CPU build.")
    cuda_available: bool | None = Field(default=None, description="None when not checked (no GPUs).")
    device_count: int | None = None
    arch_list: list[str] = Field(default_factory=list, description="SMs compiled in, e.g. sm_90, sm_120.")

    def supports_sm(self, compute_capability: str) -> bool | None:
        """Whether the build has kernels for ``compute_capability`` (e.g. ``12.0``); None if unknown.

        PTX (``compute_XY``) for a lower or equal SM of the same major also runs, JIT-compiled by the driver.
        """
        if not self.arch_list:
            return None
        major, _, minor = compute_capability.partition(".")
        wanted = int(major) * 10 + int(minor or 0)
        for arch in self.arch_list:
            kind, _, number = arch.partition("_")
            digits = re.match(r"\d+", number)
            if digits is None:
                continue
            value = int(digits.group())
            if kind == "sm" and value == wanted:
                return True
            if kind == "compute" and value <= wanted and value // 10 == wanted // 10:
                return True
        return False


class CudaToolkit(BaseModel):
    """Where the CUDA pieces a JIT build needs were found (None: not found)."""

    model_config = ConfigDict(extra="forbid")

    cuda_home: str | None = Field(
        default=None, description="Toolkit root (CUDA_HOME, nvcc's, /usr/local/cuda)."
    )
    include_dir: str | None = Field(default=None, description="Folder with cuda_runtime.h.")
    cccl_include_dir: str | None = Field(default=None, description="Folder containing nv/target.")
    cccl_on_default_path: bool = Field(
        default=False, description="nv/target sits directly in include_dir (found with -I include only)."
    )
    cudart_dir: str | None = Field(default=None, description="Folder with libcudart.so*.")
    libcuda_link_dir: str | None = Field(
        default=None, description="Folder with an unversioned libcuda.so (driver or stub) for -lcuda."
    )
    libcuda_is_stub: bool = False
    searched: list[str] = Field(default_factory=list, description="Roots searched, in order.")


# --- torch ---------------------------------------------------------------------------------------


def read_torch_version_file() -> TorchInfo | None:
    """Version and CUDA build from the installed ``torch/version.py`` (torch is not imported).

    Returns:
        None when torch is not installed.

    """
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "version.py"
        if path.is_file():
            return parse_torch_version_py(path.read_text(encoding="utf-8"))
    return TorchInfo()


def parse_torch_version_py(text: str) -> TorchInfo:
    """Parse ``__version__ = '2.11.0+cu130'`` and ``cuda: Optional[str] = '13.0'`` lines."""

    def value(name: str) -> str | None:
        match = re.search(rf"^{name}\s*(?::[^=]*)?=\s*['\"]([^'\"]*)['\"]", text, re.MULTILINE)
        return match.group(1) if match else None

    return TorchInfo(version=value("__version__"), cuda=value("cuda"))


def parse_torch_probe(text: str) -> TorchInfo:
    """Parse the ``key=value`` lines :data:`TORCH_PROBE_CODE` prints (a bundle's ``torch.txt``)."""
    values = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    cuda = values.get("cuda", "").strip()
    available = values.get("cuda_available", "").strip()
    count = values.get("device_count", "").strip()
    return TorchInfo(
        version=values.get("torch_version", "").strip() or None,
        cuda=None if cuda in {"", "None"} else cuda,
        cuda_available=None if available == "" else available == "True",
        device_count=int(count) if count.isdigit() else None,
        arch_list=values.get("arch_list", "").split(),
    )


def run_torch_probe(python: str = sys.executable) -> tuple[str | None, str | None]:
    """Run :data:`TORCH_PROBE_CODE` in a subprocess: (output, None) or (None, why it failed)."""
    try:
        result = subprocess.run(
            [python, "-c", TORCH_PROBE_CODE],
            capture_output=True,
            text=True,
            timeout=TORCH_PROBE_TIMEOUT_S,
            check=False,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"torch probe failed: {error}"
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        return None, f"`import torch` failed: {lines[-1] if lines else result.returncode}"
    return result.stdout, None


# --- CUDA toolkit --------------------------------------------------------------------------------


def _site_packages() -> list[Path]:
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    return [Path(path) for path in sorted(paths) if Path(path).is_dir()]


def system_cuda_roots() -> list[str]:
    """``/usr/local/cuda`` and every ``/usr/local/cuda-*``, newest name first."""
    return ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]


def cuda_roots(
    env: Mapping[str, str] | None = None,
    site_dirs: list[Path] | None = None,
    system_roots: list[str] | None = None,
) -> list[Path]:
    """Candidate toolkit roots, most specific first.

    CUDA_HOME, CUDA_PATH, nvcc's toolkit, /usr/local/cuda*, then the ``nvidia/*`` wheels in site-packages
    (``nvidia/cu13``, ``nvidia/cuda_runtime``, ...).
    """
    environ = os.environ if env is None else env
    roots: list[Path] = []
    for name in ("CUDA_HOME", "CUDA_PATH"):
        if environ.get(name):
            roots.append(Path(environ[name]))
    nvcc = shutil.which("nvcc", path=environ.get("PATH"))
    if nvcc is not None:
        roots.append(Path(nvcc).resolve().parent.parent)
    roots += [Path(path) for path in (system_cuda_roots() if system_roots is None else system_roots)]
    for site in _site_packages() if site_dirs is None else site_dirs:
        roots += sorted(path for path in (site / "nvidia").glob("*") if path.is_dir())
    unique: list[Path] = []
    for root in roots:
        if root.is_dir() and root not in unique:
            unique.append(root)
    return unique


def _include_dirs(root: Path) -> list[Path]:
    return [path for path in [root / "include", *sorted(root.glob("targets/*/include"))] if path.is_dir()]


def _lib_dirs(root: Path) -> list[Path]:
    names = ["lib64", "lib", *[str(path.relative_to(root)) for path in sorted(root.glob("targets/*/lib"))]]
    return [root / name for name in names if (root / name).is_dir()]


def find_cuda_toolkit(
    env: Mapping[str, str] | None = None,
    site_dirs: list[Path] | None = None,
    driver_lib_dirs: tuple[str, ...] = DRIVER_LIB_DIRS,
    system_roots: list[str] | None = None,
) -> CudaToolkit:
    """Search the toolkit roots (:func:`cuda_roots`) for headers, CCCL, libcudart and a libcuda.so to link.

    Args:
        env: Environment to read CUDA_HOME/CUDA_PATH/PATH from; this process's when None.
        site_dirs: site-packages folders holding ``nvidia/*`` wheels; this interpreter's when None.
        driver_lib_dirs: Where the driver installs ``libcuda.so``.
        system_roots: Fixed toolkit locations; :func:`system_cuda_roots` when None.

    Returns:
        What was found; fields stay None when nothing matched.

    """
    roots = cuda_roots(env, site_dirs, system_roots)
    found = CudaToolkit(searched=[str(root) for root in roots])
    for root in roots:
        for include in _include_dirs(root):
            if found.include_dir is None and (include / "cuda_runtime.h").is_file():
                found.include_dir = str(include)
                found.cuda_home = found.cuda_home or str(root)
            for candidate in (include, include / "cccl"):
                if found.cccl_include_dir is None and (candidate / "nv" / "target").is_file():
                    found.cccl_include_dir = str(candidate)
                    found.cccl_on_default_path = candidate == include
        for lib in _lib_dirs(root):
            if found.cudart_dir is None and any(lib.glob("libcudart.so*")):
                found.cudart_dir = str(lib)
            if found.libcuda_link_dir is None and (lib / "stubs" / "libcuda.so").is_file():
                found.libcuda_link_dir = str(lib / "stubs")
                found.libcuda_is_stub = True
    for directory in driver_lib_dirs:
        # The driver's own unversioned libcuda.so beats a stub for linking.
        if (Path(directory) / "libcuda.so").exists():
            found.libcuda_link_dir = directory
            found.libcuda_is_stub = False
            break
    return found


# --- remediation ---------------------------------------------------------------------------------


def jit_env_fixes(toolkit: CudaToolkit, parent_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables that make the found CCCL headers and libcuda stub visible to JIT builds.

    Meant for the servers' environment only (``LaunchCommand.env``), never the orchestrator's.

    Args:
        toolkit: What :func:`find_cuda_toolkit` found.
        parent_env: The environment the servers inherit (values are extended, not replaced).

    Returns:
        ``CUDA_HOME`` (when unset), ``CPATH`` with the CCCL folder (when it is not on the default include
        path), ``LIBRARY_PATH`` with the folder holding ``libcuda.so``; empty when nothing is needed.

    """
    environ = os.environ if parent_env is None else parent_env
    fixes: dict[str, str] = {}
    if toolkit.cuda_home and not environ.get("CUDA_HOME"):
        fixes["CUDA_HOME"] = toolkit.cuda_home
    if toolkit.cccl_include_dir and not toolkit.cccl_on_default_path:
        fixes["CPATH"] = _prepend(toolkit.cccl_include_dir, environ.get("CPATH"))
    if toolkit.libcuda_link_dir and toolkit.libcuda_is_stub:
        # The driver's own folder is on the linker's default path already; a stub folder is not.
        fixes["LIBRARY_PATH"] = _prepend(toolkit.libcuda_link_dir, environ.get("LIBRARY_PATH"))
    return fixes


def _prepend(directory: str, existing: str | None) -> str:
    parts = [part for part in (existing or "").split(os.pathsep) if part]
    return os.pathsep.join([directory, *[part for part in parts if part != directory]])
