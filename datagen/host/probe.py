"""Probe the host and report every problem with its fix: :class:`EnvReport`.

GPUs, interconnect, driver/CUDA, torch's CUDA build, JIT prerequisites (CCCL headers, libcuda stubs),
engine packages and the flags the installed sglang accepts.

Every parser is a pure function of recorded command output, so it is tested on real ``nvidia-smi`` text.
:func:`probe_environment` runs the commands (and can record them with ``record_dir``);
:func:`probe_from_dir` reads the same outputs recorded as files (see :data:`RECORDED_FILES`), so a remote
box can be diagnosed from a bundle. Probing never imports torch or sglang in this process.
"""

from __future__ import annotations

import csv
import importlib.metadata
import io
import json
import logging
import platform
import re
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from datagen.engines.sglang import installed_server_flags
from datagen.errors import ProbeError
from datagen.host.cuda_env import (
    CudaToolkit,
    TorchInfo,
    find_cuda_toolkit,
    jit_env_fixes,
    parse_torch_probe,
    read_torch_version_file,
    run_torch_probe,
)

logger = logging.getLogger(__name__)

NVIDIA_SMI_TIMEOUT_S = 30.0
GPU_QUERY_FIELDS = ("index", "name", "uuid", "memory.total", "memory.used", "compute_cap", "driver_version")
APPS_QUERY_FIELDS = ("pid", "process_name", "used_memory", "gpu_uuid")
PACKAGES = ("torch", "transformers", "sglang", "flashinfer-python", "sglang-router")
# Memory a GPU may show as used with nothing of ours on it (driver context, monitoring agents).
IDLE_GPU_MEMORY_MIB = 1024

RECORDED_FILES = {
    "query_gpu": "query-gpu.csv",
    "topo": "topo.txt",
    "smi": "nvidia-smi.txt",
    "apps": "compute-apps.csv",
    "nvcc": "nvcc.txt",
    "torch": "torch.txt",
    "toolkit": "toolkit.json",
    "sglang_flags": "sglang-flags.txt",
}
PACKAGES_FILE = "packages.json"
# The SM whose attention kernels sglang restricts (Blackwell workstation/server PCIe cards).
SM120 = "12.0"

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
_DEVICE_NAME = re.compile(r"^(GPU\d+|NIC\d+)$")
_NVLINK = re.compile(r"^NV(\d+)$")

Severity = Literal["info", "warning", "error"]
InterconnectKind = Literal["none", "single", "nvlink", "pcie", "mixed", "unknown"]


class ReportModel(BaseModel):
    """Base of the probe's records: strict, serialisable."""

    model_config = ConfigDict(extra="forbid")


class Problem(ReportModel):
    """Something about the host worth knowing before GPUs are taken."""

    severity: Severity
    message: str
    fix: str | None = None


class GpuInfo(ReportModel):
    """One GPU as ``nvidia-smi --query-gpu`` reports it."""

    index: int
    name: str
    uuid: str | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    compute_capability: str | None = None


class GpuProcess(ReportModel):
    """A compute process holding GPU memory (``nvidia-smi --query-compute-apps``)."""

    pid: int
    process_name: str
    used_memory_mib: int | None = None
    gpu_uuid: str | None = None


class Interconnect(ReportModel):
    """How the GPUs talk to each other, from ``nvidia-smi topo -m``."""

    kind: InterconnectKind = "unknown"
    nvlink_islands: list[list[int]] = Field(
        default_factory=list, description="Groups of GPU indices joined by NVLink (singletons included)."
    )
    links: dict[str, str] = Field(
        default_factory=dict, description="'0-1' -> link type (NV18, SYS, NODE, PHB, PXB, PIX)."
    )
    summary: str = "unknown"


class EnvReport(ReportModel):
    """What the host offers to the planner, and what may go wrong there."""

    schema_version: Literal[1] = 1
    hostname: str
    platform: str
    python_version: str
    packages: dict[str, str | None] = Field(
        default_factory=dict, description="Installed distribution versions; None when not installed."
    )
    gpus: list[GpuInfo] = Field(default_factory=list)
    gpu_processes: list[GpuProcess] = Field(default_factory=list)
    interconnect: Interconnect = Field(default_factory=Interconnect)
    driver_version: str | None = None
    cuda_driver_version: str | None = Field(default=None, description="Highest CUDA the driver supports.")
    nvcc_version: str | None = None
    torch: TorchInfo | None = Field(default=None, description="None when torch was not probed or is absent.")
    cuda_toolkit: CudaToolkit | None = Field(default=None, description="None when not probed.")
    sglang_flags: list[str] | None = Field(
        default=None, description="Flags the installed sglang's launch_server accepts; None without sglang."
    )
    problems: list[Problem] = Field(default_factory=list)

    @property
    def compute_capabilities(self) -> list[str]:
        """Distinct SMs of the GPUs, e.g. ``['9.0']``."""
        return sorted({gpu.compute_capability for gpu in self.gpus if gpu.compute_capability})

    def jit_env(self) -> dict[str, str]:
        """Server environment that fixes the found JIT problems (empty when none or not probed)."""
        return jit_env_fixes(self.cuda_toolkit) if self.cuda_toolkit is not None else {}

    def package_version(self, name: str) -> str | None:
        """The installed version of a distribution (e.g. ``sglang``), None when absent."""
        return self.packages.get(name)

    @property
    def torch_version(self) -> str | None:
        """Installed torch version."""
        return self.packages.get("torch")

    @property
    def transformers_version(self) -> str | None:
        """Installed transformers version."""
        return self.packages.get("transformers")

    @property
    def sglang_version(self) -> str | None:
        """Installed sglang version."""
        return self.packages.get("sglang")

    @property
    def flashinfer_version(self) -> str | None:
        """Installed flashinfer version."""
        return self.packages.get("flashinfer-python")

    def to_markdown(self) -> str:
        """A human-readable report (Prefect artifact, runbook)."""
        lines = [
            f"# Environment of `{self.hostname}`",
            "",
            f"- platform: {self.platform}, python {self.python_version}",
            f"- driver: {self.driver_version or 'n/a'}, CUDA (driver): {self.cuda_driver_version or 'n/a'}, "
            f"nvcc: {self.nvcc_version or 'n/a'}",
            "- packages: "
            + ", ".join(
                f"{name} {version or 'not installed'}" for name, version in sorted(self.packages.items())
            ),
            f"- interconnect: {self.interconnect.summary}",
            f"- torch: {_torch_line(self.torch)}",
            f"- CUDA toolkit: {_toolkit_line(self.cuda_toolkit)}",
            "- sglang flags: "
            + ("n/a" if self.sglang_flags is None else f"{len(self.sglang_flags)} accepted"),
            "",
        ]
        if self.gpus:
            lines += [
                "| GPU | name | SM | memory used / total (MiB) | uuid |",
                "|---|---|---|---|---|",
            ]
            lines += [
                f"| {gpu.index} | {gpu.name} | {gpu.compute_capability or '?'} | "
                f"{_fmt(gpu.memory_used_mib)} / {_fmt(gpu.memory_total_mib)} | {gpu.uuid or ''} |"
                for gpu in self.gpus
            ]
        else:
            lines.append("No GPUs: servers run on the CPU.")
        if self.gpu_processes:
            lines += ["", "GPU processes:"]
            lines += [
                f"- pid {proc.pid} `{proc.process_name}` {_fmt(proc.used_memory_mib)} MiB on {proc.gpu_uuid}"
                for proc in self.gpu_processes
            ]
        if self.problems:
            lines += ["", "## Problems", ""]
            lines += [
                f"- **{problem.severity}**: {problem.message}"
                + (f" Fix: {problem.fix}" if problem.fix else "")
                for problem in self.problems
            ]
        return "\n".join(lines) + "\n"


def _fmt(value: int | None) -> str:
    return "?" if value is None else str(value)


def _torch_line(torch: TorchInfo | None) -> str:
    if torch is None:
        return "not probed or not installed"
    parts = [f"{torch.version or '?'} (CUDA build: {torch.cuda or 'none, CPU only'})"]
    if torch.cuda_available is not None:
        parts.append(f"CUDA usable: {torch.cuda_available}")
    if torch.arch_list:
        parts.append(f"archs: {' '.join(torch.arch_list)}")
    return ", ".join(parts)


def _toolkit_line(toolkit: CudaToolkit | None) -> str:
    if toolkit is None:
        return "not probed"
    return (
        f"home {toolkit.cuda_home or 'not found'}; CCCL (nv/target) {toolkit.cccl_include_dir or 'not found'}; "
        f"libcudart {toolkit.cudart_dir or 'not found'}; libcuda.so for linking "
        f"{toolkit.libcuda_link_dir or 'not found'}{' (stub)' if toolkit.libcuda_is_stub else ''}"
    )


# --- pure parsers -------------------------------------------------------------------------------


def _csv_rows(text: str) -> list[dict[str, str]]:
    """Rows of ``nvidia-smi --format=csv`` output keyed by bare field name (units dropped from headers)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    reader = csv.reader(io.StringIO("\n".join(lines)), skipinitialspace=True)
    header, *rows = list(reader)
    # "memory.total [MiB]" -> "memory.total"; the unit is stripped from values below.
    names = [re.sub(r"\s*\[.*\]\s*$", "", column).strip() for column in header]
    return [dict(zip(names, (value.strip() for value in row), strict=False)) for row in rows]


def _value(row: dict[str, str], *names: str) -> str | None:
    for name in names:
        raw = row.get(name)
        if raw is None:
            continue
        if raw in {"", "[N/A]", "N/A", "[Not Supported]", "[Insufficient Permissions]"}:
            return None
        return raw
    return None


def _mib(raw: str | None) -> int | None:
    if raw is None:
        return None
    match = re.match(r"^\s*(\d+)", raw)
    return int(match.group(1)) if match else None


def parse_gpu_query_csv(text: str) -> tuple[list[GpuInfo], str | None]:
    """Parse ``nvidia-smi --query-gpu=... --format=csv`` by column name.

    Args:
        text: The command's output with its header line (units may be in headers and values).

    Returns:
        The GPUs in index order, and the driver version (None when not queried).

    Raises:
        ValueError: The text has no ``index`` column (not query-gpu CSV output).

    """
    rows = _csv_rows(text)
    header = text.strip().splitlines()[0] if text.strip() else ""
    if header and "index" not in [re.sub(r"\s*\[.*\]$", "", column.strip()) for column in header.split(",")]:
        raise ValueError(f"not nvidia-smi query-gpu CSV (no 'index' column): {header!r}")
    gpus: list[GpuInfo] = []
    driver: str | None = None
    for row in rows:
        index = _value(row, "index")
        if index is None:
            continue
        gpus.append(
            GpuInfo(
                index=int(index),
                name=_value(row, "name") or "unknown",
                uuid=_value(row, "uuid"),
                memory_total_mib=_mib(_value(row, "memory.total")),
                memory_used_mib=_mib(_value(row, "memory.used")),
                compute_capability=_value(row, "compute_cap"),
            )
        )
        driver = driver or _value(row, "driver_version")
    return sorted(gpus, key=lambda gpu: gpu.index), driver


def parse_compute_apps_csv(text: str) -> list[GpuProcess]:
    """Parse ``nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv``.

    Args:
        text: The command's output with its header line.

    Returns:
        One entry per compute process (empty when none run).

    """
    processes: list[GpuProcess] = []
    for row in _csv_rows(text):
        pid = _value(row, "pid")
        if pid is None or not pid.isdigit():
            continue
        processes.append(
            GpuProcess(
                pid=int(pid),
                process_name=_value(row, "process_name") or "",
                used_memory_mib=_mib(_value(row, "used_gpu_memory", "used_memory")),
                gpu_uuid=_value(row, "gpu_uuid"),
            )
        )
    return processes


def parse_topology(text: str) -> Interconnect:
    """Parse the matrix of ``nvidia-smi topo -m`` into links and NVLink islands.

    Columns are found by name (``GPU0``, ``NIC0``, ...) in the header, so extra columns (CPU/NUMA
    affinity, NICs) and the terminal escape codes nvidia-smi adds are tolerated.

    Args:
        text: The command's output.

    Returns:
        The interconnect; ``kind`` is ``nvlink`` when every GPU pair is NVLinked, ``pcie`` when none is,
        ``mixed`` otherwise, ``single`` for one GPU.

    """
    lines = [_ANSI_ESCAPE.sub("", line) for line in text.splitlines()]
    columns: list[str] = []
    gpu_ids: list[int] = []
    links: dict[str, str] = {}
    for line in lines:
        if line.strip().startswith("Legend"):
            break
        tokens = line.split()
        if not tokens:
            continue
        if not columns:
            # The header is the first line naming devices; row lines start with their own name at column 0.
            header = [token for token in re.split(r"\t+|\s{2,}", line.strip()) if _DEVICE_NAME.match(token)]
            if header and (line[:1].isspace() or not _is_link(tokens[1] if len(tokens) > 1 else "")):
                columns = header
            continue
        if not columns or not tokens[0].startswith("GPU"):
            continue
        row_gpu = int(tokens[0][3:])
        gpu_ids.append(row_gpu)
        for column, link in zip(columns, tokens[1 : 1 + len(columns)], strict=False):
            if column.startswith("GPU"):
                other = int(column[3:])
                if other != row_gpu:
                    links[f"{min(row_gpu, other)}-{max(row_gpu, other)}"] = link
    if not gpu_ids:
        return Interconnect(kind="unknown", summary="no GPU rows in topology output")
    islands = _nvlink_islands(gpu_ids, links)
    nvlinked = [pair for pair, link in links.items() if _NVLINK.match(link)]
    if len(gpu_ids) == 1:
        kind: InterconnectKind = "single"
    elif len(nvlinked) == len(links):
        kind = "nvlink"
    elif not nvlinked:
        kind = "pcie"
    else:
        kind = "mixed"
    link_types = sorted(set(links.values()))
    summary = (
        f"{len(gpu_ids)} GPU(s), {kind}; NVLink islands: "
        + " ".join("[" + ",".join(str(gpu) for gpu in island) + "]" for island in islands)
        + (f"; link types: {', '.join(link_types)}" if link_types else "")
    )
    return Interconnect(kind=kind, nvlink_islands=islands, links=links, summary=summary)


def _is_link(token: str) -> bool:
    return token in {"X", "SYS", "NODE", "PHB", "PXB", "PIX", "SOC"} or _NVLINK.match(token) is not None


def _nvlink_islands(gpu_ids: list[int], links: dict[str, str]) -> list[list[int]]:
    parent = {gpu: gpu for gpu in gpu_ids}

    def root(gpu: int) -> int:
        while parent[gpu] != gpu:
            gpu = parent[gpu]
        return gpu

    for pair, link in links.items():
        if _NVLINK.match(link):
            first, second = (int(part) for part in pair.split("-"))
            if first in parent and second in parent:
                parent[root(first)] = root(second)
    groups: dict[int, list[int]] = {}
    for gpu in sorted(gpu_ids):
        groups.setdefault(root(gpu), []).append(gpu)
    return sorted(groups.values())


def parse_cuda_driver_version(nvidia_smi_text: str) -> str | None:
    """The ``CUDA Version`` in the banner of plain ``nvidia-smi`` output."""
    match = re.search(r"CUDA Version:\s*([\d.]+)", nvidia_smi_text)
    return match.group(1) if match else None


def parse_nvcc_version(text: str) -> str | None:
    """The release in ``nvcc --version`` output (e.g. ``13.0``)."""
    match = re.search(r"release\s+([\d.]+)", text)
    return match.group(1) if match else None


# --- assembling the report ----------------------------------------------------------------------


def installed_versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Distribution versions from package metadata (nothing is imported)."""
    versions: dict[str, str | None] = {}
    for name in packages:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def build_report(
    *,
    query_gpu: str | None,
    topo: str | None,
    smi: str | None,
    apps: str | None,
    nvcc: str | None,
    packages: dict[str, str | None],
    hostname: str,
    problems: list[Problem] | None = None,
    torch: TorchInfo | None = None,
    cuda_toolkit: CudaToolkit | None = None,
    sglang_flags: list[str] | None = None,
) -> EnvReport:
    """Assemble an :class:`EnvReport` from command outputs (None: command absent or failed).

    Args:
        query_gpu: ``nvidia-smi --query-gpu`` CSV.
        topo: ``nvidia-smi topo -m``.
        smi: Plain ``nvidia-smi``.
        apps: ``nvidia-smi --query-compute-apps`` CSV.
        nvcc: ``nvcc --version``.
        packages: Installed versions.
        hostname: Host name.
        problems: Problems already found while collecting the outputs.
        torch: torch's version and CUDA build (None: not probed).
        cuda_toolkit: Where CUDA headers and libraries were found (None: not probed).
        sglang_flags: Flags the installed sglang accepts (None: no sglang).

    Returns:
        The report, with problems derived from what was (not) found (:func:`diagnose`).

    """
    found = list(problems or [])
    gpus: list[GpuInfo] = []
    driver: str | None = None
    if query_gpu is not None:
        try:
            gpus, driver = parse_gpu_query_csv(query_gpu)
        except ValueError as error:
            found.append(
                Problem(
                    severity="error",
                    message=f"cannot parse nvidia-smi GPU query: {error}",
                    fix="run `nvidia-smi` by hand; reinstall the NVIDIA driver if it fails",
                )
            )
    interconnect = (
        parse_topology(topo) if topo is not None and gpus else Interconnect(kind="none", summary="none")
    )
    if gpus and topo is None:
        interconnect = Interconnect(kind="unknown", summary="topology not probed")
    report = EnvReport(
        hostname=hostname,
        platform=platform.platform(),
        python_version=platform.python_version(),
        packages=packages,
        gpus=gpus,
        gpu_processes=parse_compute_apps_csv(apps) if apps is not None else [],
        interconnect=interconnect,
        driver_version=driver,
        cuda_driver_version=parse_cuda_driver_version(smi) if smi else None,
        nvcc_version=parse_nvcc_version(nvcc) if nvcc else None,
        torch=torch,
        cuda_toolkit=cuda_toolkit,
        sglang_flags=sglang_flags,
    )
    report.problems = found + diagnose(report, nvidia_smi_found=query_gpu is not None or bool(found))
    return report


def _version_tuple(version: str | None) -> tuple[int, ...] | None:
    if not version:
        return None
    match = re.match(r"(\d+)(?:\.(\d+))?", version)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2) or 0)


def diagnose(report: EnvReport, *, nvidia_smi_found: bool = True) -> list[Problem]:
    """Every problem the report reveals, each with a severity and the concrete fix.

    Only what was probed is judged: a bundle without ``torch.txt`` yields no torch problems.

    Args:
        report: The report (its ``problems`` are ignored).
        nvidia_smi_found: False when nvidia-smi was absent (then the host is a CPU host).

    Returns:
        The problems, most severe kinds first within each topic.

    """
    problems: list[Problem] = []
    if not report.gpus:
        if not nvidia_smi_found:
            problems.append(
                Problem(
                    severity="info",
                    message="nvidia-smi not found: no GPUs, servers will run on the CPU",
                    fix="install the NVIDIA driver (nvidia-smi) to serve on GPUs",
                )
            )
        return problems
    for gpu in report.gpus:
        if gpu.memory_used_mib is not None and gpu.memory_used_mib > IDLE_GPU_MEMORY_MIB:
            problems.append(
                Problem(
                    severity="warning",
                    message=f"GPU {gpu.index} has {gpu.memory_used_mib} MiB in use",
                    fix="halt the training job (or whatever holds the GPU) before starting servers",
                )
            )
    problems += _torch_problems(report)
    problems += _toolkit_problems(report)
    problems += _engine_problems(report)
    return problems


def _torch_problems(report: EnvReport) -> list[Problem]:
    torch = report.torch
    if torch is None:
        return []
    driver_cuda = _version_tuple(report.cuda_driver_version)
    if torch.cuda is None:
        return [
            Problem(
                severity="error",
                message=f"torch {torch.version} is a CPU-only build on a host with GPUs",
                fix="install a CUDA build of torch, e.g. `pip install torch --index-url "
                "https://download.pytorch.org/whl/cu130` (pick the CUDA the driver supports)",
            )
        ]
    problems: list[Problem] = []
    torch_cuda = _version_tuple(torch.cuda)
    if driver_cuda and torch_cuda and torch_cuda > driver_cuda:
        problems.append(
            Problem(
                severity="error",
                message=f"torch is built for CUDA {torch.cuda} but the driver {report.driver_version} supports "
                f"CUDA {report.cuda_driver_version} at most",
                fix=f"upgrade the NVIDIA driver, or install a torch built for CUDA <= {report.cuda_driver_version}",
            )
        )
    if torch.cuda_available is False:
        problems.append(
            Problem(
                severity="error",
                message="torch cannot use the GPUs (torch.cuda.is_available() is False)",
                fix="check that the driver loads (nvidia-smi), that CUDA_VISIBLE_DEVICES is not empty, and "
                "that the driver supports torch's CUDA build",
            )
        )
    for capability in report.compute_capabilities:
        if torch.supports_sm(capability) is False:
            sm = capability.replace(".", "")
            problems.append(
                Problem(
                    severity="error",
                    message=f"torch {torch.version} has no kernels for the GPUs' SM {capability} "
                    f"(built for {' '.join(torch.arch_list)})",
                    fix=f"install a torch build that includes sm_{sm} (for SM 12.0: a CUDA 12.8 or newer wheel, "
                    "e.g. --index-url https://download.pytorch.org/whl/cu128)",
                )
            )
    return problems


def _toolkit_problems(report: EnvReport) -> list[Problem]:
    problems: list[Problem] = []
    nvcc = _version_tuple(report.nvcc_version)
    driver_cuda = _version_tuple(report.cuda_driver_version)
    torch_cuda = _version_tuple(report.torch.cuda) if report.torch is not None else None
    toolkit = report.cuda_toolkit
    if toolkit is not None and nvcc is None:
        problems.append(
            Problem(
                severity="warning",
                message="nvcc not found: kernels that sglang/flashinfer compile at first use (JIT) cannot be built",
                fix="install the CUDA toolkit matching torch's CUDA (or `pip install nvidia-cuda-nvcc`) and "
                "put its bin/ on PATH or set CUDA_HOME",
            )
        )
    if nvcc and driver_cuda and nvcc > driver_cuda:
        problems.append(
            Problem(
                severity="warning",
                message=f"nvcc {report.nvcc_version} is newer than the driver's CUDA {report.cuda_driver_version}: "
                "JIT-compiled kernels will not load",
                fix=f"use a CUDA toolkit <= {report.cuda_driver_version} (set CUDA_HOME) or upgrade the driver",
            )
        )
    if nvcc and torch_cuda and nvcc[0] != torch_cuda[0]:
        problems.append(
            Problem(
                severity="warning",
                message=f"nvcc {report.nvcc_version} and torch's CUDA {report.torch.cuda if report.torch else ''} "
                "differ in major version: JIT extensions built against torch may fail to compile or load",
                fix="set CUDA_HOME to a toolkit with the same major version as torch's CUDA build",
            )
        )
    if toolkit is None:
        return problems
    if toolkit.cccl_include_dir is None:
        problems.append(
            Problem(
                severity="warning",
                message="CCCL headers (nv/target) not found in any CUDA include folder: JIT builds of "
                "sglang/flashinfer kernels fail with 'nv/target: No such file or directory'",
                fix="install the toolkit's CCCL (`pip install nvidia-cuda-cccl` or the cuda-cccl package) "
                "and set CUDA_HOME to that toolkit",
            )
        )
    elif not toolkit.cccl_on_default_path:
        problems.append(
            Problem(
                severity="warning",
                message=f"CCCL headers are only in {toolkit.cccl_include_dir} (the CUDA 13 layout): JIT builds "
                "that add only the toolkit's include/ fail with 'nv/target: No such file or directory'",
                fix=f"set fleet.fix_jit_env: true (the servers get CPATH={toolkit.cccl_include_dir}) or export "
                "CPATH yourself",
            )
        )
    if toolkit.libcuda_link_dir is None:
        problems.append(
            Problem(
                severity="warning",
                message="no libcuda.so to link against (neither the driver's nor a toolkit stub): JIT builds "
                "linking -lcuda (Triton, sglang kernels) fail with 'cannot find -lcuda'",
                fix="install the toolkit's stubs (lib64/stubs/libcuda.so, e.g. cuda-driver-dev) and set "
                "fleet.fix_jit_env: true to put them on the servers' LIBRARY_PATH",
            )
        )
    elif toolkit.libcuda_is_stub:
        problems.append(
            Problem(
                severity="info",
                message=f"libcuda.so for linking exists only as a stub in {toolkit.libcuda_link_dir}",
                fix=f"set fleet.fix_jit_env: true (the servers get LIBRARY_PATH={toolkit.libcuda_link_dir})",
            )
        )
    if toolkit.cudart_dir is None:
        problems.append(
            Problem(
                severity="warning",
                message="libcudart.so not found in any CUDA toolkit or nvidia-* wheel",
                fix="install the CUDA runtime (`pip install nvidia-cuda-runtime` or the toolkit) and set CUDA_HOME",
            )
        )
    return problems


def _engine_problems(report: EnvReport) -> list[Problem]:
    problems: list[Problem] = []
    if report.packages and report.sglang_version is None:
        problems.append(
            Problem(
                severity="info",
                message="sglang is not installed: only the transformers engine can serve here",
                fix="`pip install 'datagen[gpu]'` on this host to use fleet.engine: sglang",
            )
        )
    if SM120 in report.compute_capabilities and report.sglang_version is not None:
        problems.append(
            Problem(
                severity="info",
                message="SM 12.0 GPUs: sglang rejects the fa3/fa4 attention backends here",
                fix="nothing to do: the planner passes --attention-backend flashinfer on SM 12.0",
            )
        )
    if report.sglang_version is not None and report.flashinfer_version is None:
        problems.append(
            Problem(
                severity="warning",
                message="sglang is installed without flashinfer-python",
                fix="`pip install flashinfer-python` at the version sglang pins",
            )
        )
    return problems


def _run(argv: list[str]) -> tuple[str | None, str | None]:
    """Run a probe command: (stdout, None) on success, (None, reason) otherwise."""
    try:
        result = subprocess.run(
            argv, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"{argv[0]} failed: {error}"
    if result.returncode != 0:
        detail = (result.stdout + result.stderr).strip().splitlines()
        return None, f"`{' '.join(argv)}` exited {result.returncode}: {detail[-1] if detail else ''}"
    return result.stdout, None


def query_compute_apps() -> str | None:
    """``nvidia-smi --query-compute-apps`` CSV now; None without nvidia-smi or when it fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    output, _ = _run([smi, f"--query-compute-apps={','.join(APPS_QUERY_FIELDS)}", "--format=csv"])
    return output


def query_gpu_memory() -> str | None:
    """``nvidia-smi --query-gpu=index,name,memory.used,memory.total`` CSV; None without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    output, _ = _run([smi, "--query-gpu=index,name,memory.used,memory.total", "--format=csv"])
    return output


def probe_environment(record_dir: str | Path | None = None) -> EnvReport:
    """Probe this host (GPUs, topology, driver, CUDA toolkit, torch, packages, sglang flags).

    Args:
        record_dir: When given, the raw outputs are written there (:data:`RECORDED_FILES`), a bundle
            that :func:`probe_from_dir` reads back on another machine.

    Returns:
        The report. A host without ``nvidia-smi`` yields no GPUs and an ``info`` problem; probe commands
        that fail become problems rather than exceptions.

    """
    problems: list[Problem] = []
    outputs: dict[str, str | None] = dict.fromkeys(RECORDED_FILES)
    smi_bin = shutil.which("nvidia-smi")
    if smi_bin is not None:
        fields = list(GPU_QUERY_FIELDS)
        outputs["query_gpu"], error = _run([smi_bin, f"--query-gpu={','.join(fields)}", "--format=csv"])
        if outputs["query_gpu"] is None and error and "compute_cap" in error:
            # Drivers older than 510 do not know the compute_cap field: ask again without it.
            fields.remove("compute_cap")
            outputs["query_gpu"], error = _run([smi_bin, f"--query-gpu={','.join(fields)}", "--format=csv"])
        if error:
            problems.append(
                Problem(severity="error", message=error, fix="check the NVIDIA driver (nvidia-smi)")
            )
        outputs["topo"], topo_error = _run([smi_bin, "topo", "-m"])
        if topo_error:
            problems.append(
                Problem(
                    severity="warning",
                    message=topo_error,
                    fix="tensor parallelism is planned without NVLink knowledge; set fleet.tensor_parallel "
                    "only if you know the topology",
                )
            )
        outputs["smi"], _ = _run([smi_bin])
        outputs["apps"] = query_compute_apps()
    nvcc_bin = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
    )
    if nvcc_bin is not None:
        outputs["nvcc"], _ = _run([nvcc_bin, "--version"])
    torch = read_torch_version_file()
    if torch is not None and outputs["query_gpu"]:
        # Only a GPU host needs to know whether CUDA works in torch (importing it costs seconds).
        outputs["torch"], torch_error = run_torch_probe()
        if outputs["torch"] is not None:
            torch = parse_torch_probe(outputs["torch"])
        elif torch_error:
            problems.append(
                Problem(
                    severity="error",
                    message=torch_error,
                    fix="reinstall torch for this interpreter (`pip install 'datagen[gpu]'`)",
                )
            )
    toolkit = find_cuda_toolkit()
    flags = installed_server_flags()
    packages = installed_versions()
    if record_dir is not None:
        _record(Path(record_dir), outputs, toolkit, flags, packages)
    report = build_report(
        query_gpu=outputs["query_gpu"],
        topo=outputs["topo"],
        smi=outputs["smi"],
        apps=outputs["apps"],
        nvcc=outputs["nvcc"],
        packages=packages,
        hostname=socket.gethostname(),
        problems=problems,
        torch=torch,
        cuda_toolkit=toolkit,
        sglang_flags=flags,
    )
    logger.info(
        "probe gpus=%d interconnect=%s problems=%d",
        len(report.gpus),
        report.interconnect.kind,
        len(report.problems),
    )
    return report


def _record(
    folder: Path,
    outputs: dict[str, str | None],
    toolkit: CudaToolkit,
    flags: list[str] | None,
    packages: dict[str, str | None],
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for key, text in outputs.items():
        if text is not None and key not in {"toolkit", "sglang_flags"}:
            (folder / RECORDED_FILES[key]).write_text(text, encoding="utf-8")
    (folder / RECORDED_FILES["toolkit"]).write_text(toolkit.model_dump_json(indent=2), encoding="utf-8")
    if flags is not None:
        (folder / RECORDED_FILES["sglang_flags"]).write_text("\n".join(flags) + "\n", encoding="utf-8")
    (folder / PACKAGES_FILE).write_text(json.dumps(packages, indent=2), encoding="utf-8")


def probe_from_dir(directory: str | Path, *, packages: dict[str, str | None] | None = None) -> EnvReport:
    """Build a report from recorded command outputs (see :data:`RECORDED_FILES`).

    Args:
        directory: Folder with any of ``query-gpu.csv``, ``topo.txt``, ``nvidia-smi.txt``,
            ``compute-apps.csv``, ``nvcc.txt``, ``torch.txt``, ``toolkit.json``, ``sglang-flags.txt``,
            ``packages.json``; a missing file means the command was absent (or not recorded).
        packages: Package versions to report; ``packages.json`` of the bundle, else this interpreter's.

    Returns:
        The report, with the folder's name as host name.

    Raises:
        ProbeError: The folder does not exist or holds none of the recorded files.

    """
    folder = Path(directory)
    if not folder.is_dir() or not any(
        (folder / name).is_file() for name in [*RECORDED_FILES.values(), PACKAGES_FILE]
    ):
        raise ProbeError(
            f"{folder} holds no recorded probe outputs; make a bundle on the host with "
            "`datagen probe --record DIR` and copy that folder here"
        )
    outputs: dict[str, str | None] = {}
    for key, filename in RECORDED_FILES.items():
        path = folder / filename
        outputs[key] = path.read_text(encoding="utf-8") if path.is_file() else None
    if packages is None:
        recorded = folder / PACKAGES_FILE
        packages = (
            json.loads(recorded.read_text(encoding="utf-8")) if recorded.is_file() else installed_versions()
        )
    return build_report(
        query_gpu=outputs["query_gpu"],
        topo=outputs["topo"],
        smi=outputs["smi"],
        apps=outputs["apps"],
        nvcc=outputs["nvcc"],
        packages=packages,
        hostname=folder.name,
        torch=parse_torch_probe(outputs["torch"]) if outputs["torch"] else None,
        cuda_toolkit=CudaToolkit.model_validate_json(outputs["toolkit"]) if outputs["toolkit"] else None,
        sglang_flags=outputs["sglang_flags"].split() if outputs["sglang_flags"] is not None else None,
    )
