"""Probe the host: GPUs, interconnect, driver/CUDA, installed engine packages -> :class:`EnvReport`.

Every parser is a pure function of recorded command output, so it is tested on real ``nvidia-smi`` text.
:func:`probe_environment` runs the commands; :func:`probe_from_dir` reads the same outputs recorded as
files (``query-gpu.csv``, ``topo.txt``, ``nvidia-smi.txt``, ``compute-apps.csv``, ``nvcc.txt``).
Package versions come from ``importlib.metadata`` so probing never imports torch.
"""

from __future__ import annotations

import csv
import importlib.metadata
import io
import logging
import platform
import re
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

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
}

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
    problems: list[Problem] = Field(default_factory=list)

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

    Returns:
        The report, with problems derived from what was (not) found.

    """
    found = list(problems or [])
    gpus: list[GpuInfo] = []
    driver: str | None = None
    if query_gpu is not None:
        try:
            gpus, driver = parse_gpu_query_csv(query_gpu)
        except ValueError as error:
            found.append(Problem(severity="error", message=f"cannot parse nvidia-smi GPU query: {error}"))
    interconnect = (
        parse_topology(topo) if topo is not None and gpus else Interconnect(kind="none", summary="none")
    )
    if gpus and topo is None:
        interconnect = Interconnect(kind="unknown", summary="topology not probed")
    processes = parse_compute_apps_csv(apps) if apps is not None else []
    if query_gpu is None and not found:
        found.append(
            Problem(
                severity="info",
                message="nvidia-smi not found: no GPUs, servers will run on the CPU",
                fix="install the NVIDIA driver (nvidia-smi) to serve on GPUs",
            )
        )
    for gpu in gpus:
        if gpu.memory_used_mib is not None and gpu.memory_used_mib > IDLE_GPU_MEMORY_MIB:
            found.append(
                Problem(
                    severity="warning",
                    message=f"GPU {gpu.index} has {gpu.memory_used_mib} MiB in use",
                    fix="halt the training job (or whatever holds the GPU) before starting servers",
                )
            )
    return EnvReport(
        hostname=hostname,
        platform=platform.platform(),
        python_version=platform.python_version(),
        packages=packages,
        gpus=gpus,
        gpu_processes=processes,
        interconnect=interconnect,
        driver_version=driver,
        cuda_driver_version=parse_cuda_driver_version(smi) if smi else None,
        nvcc_version=parse_nvcc_version(nvcc) if nvcc else None,
        problems=found,
    )


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


def probe_environment() -> EnvReport:
    """Probe this host (GPUs, topology, driver, CUDA toolkit, packages).

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
            problems.append(Problem(severity="warning", message=topo_error))
        outputs["smi"], _ = _run([smi_bin])
        outputs["apps"], _ = _run(
            [smi_bin, f"--query-compute-apps={','.join(APPS_QUERY_FIELDS)}", "--format=csv"]
        )
    nvcc_bin = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
    )
    if nvcc_bin is not None:
        outputs["nvcc"], _ = _run([nvcc_bin, "--version"])
    report = build_report(
        query_gpu=outputs["query_gpu"],
        topo=outputs["topo"],
        smi=outputs["smi"],
        apps=outputs["apps"],
        nvcc=outputs["nvcc"],
        packages=installed_versions(),
        hostname=socket.gethostname(),
        problems=problems,
    )
    logger.info(
        "probe gpus=%d interconnect=%s problems=%d",
        len(report.gpus),
        report.interconnect.kind,
        len(report.problems),
    )
    return report


def probe_from_dir(directory: str | Path, *, packages: dict[str, str | None] | None = None) -> EnvReport:
    """Build a report from recorded command outputs (see :data:`RECORDED_FILES`).

    Args:
        directory: Folder with any of ``query-gpu.csv``, ``topo.txt``, ``nvidia-smi.txt``,
            ``compute-apps.csv``, ``nvcc.txt``; a missing file means the command was absent.
        packages: Package versions to report; this interpreter's when None.

    Returns:
        The report, with the folder's name as host name.

    """
    folder = Path(directory)
    outputs: dict[str, str | None] = {}
    for key, filename in RECORDED_FILES.items():
        path = folder / filename
        outputs[key] = path.read_text(encoding="utf-8") if path.is_file() else None
    return build_report(
        query_gpu=outputs["query_gpu"],
        topo=outputs["topo"],
        smi=outputs["smi"],
        apps=outputs["apps"],
        nvcc=outputs["nvcc"],
        packages=installed_versions() if packages is None else packages,
        hostname=folder.name,
    )
