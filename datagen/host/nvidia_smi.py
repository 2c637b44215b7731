"""``nvidia-smi`` and ``nvcc``: run them under a timeout, and parse what they print.

Every parser is a pure function of the command's output, so it is tested on real recorded text
(``tests/fixtures/probe``). Used by the probe and by the training halt (which GPU processes hold memory).
"""

from __future__ import annotations

import csv
import io
import re
import shutil
import subprocess

from datagen.host.env_report import GpuInfo, GpuProcess, Interconnect, InterconnectKind

NVIDIA_SMI_TIMEOUT_S = 30.0
GPU_QUERY_FIELDS = ("index", "name", "uuid", "memory.total", "memory.used", "compute_cap", "driver_version")
APPS_QUERY_FIELDS = ("pid", "process_name", "used_memory", "gpu_uuid")

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
_DEVICE_NAME = re.compile(r"^(GPU\d+|NIC\d+)$")
_NVLINK = re.compile(r"^NV(\d+)$")


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


def run_command(argv: list[str]) -> tuple[str | None, str | None]:
    """Run a probe command under :data:`NVIDIA_SMI_TIMEOUT_S`: (stdout, None), or (None, the reason)."""
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
    output, _ = run_command([smi, f"--query-compute-apps={','.join(APPS_QUERY_FIELDS)}", "--format=csv"])
    return output


def query_gpu_memory() -> str | None:
    """``nvidia-smi --query-gpu=index,name,memory.used,memory.total`` CSV; None without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    output, _ = run_command([smi, "--query-gpu=index,name,memory.used,memory.total", "--format=csv"])
    return output
