"""Probe the host: run (or read back) the commands that describe it, and build its :class:`EnvReport`.

GPUs, interconnect, driver/CUDA, torch's CUDA build, JIT prerequisites (CCCL headers, libcuda stubs),
engine packages and the flags the installed sglang accepts.

:func:`probe_environment` runs the commands (and can record them with ``record_dir``);
:func:`probe_from_dir` reads the same outputs recorded as files (see :data:`RECORDED_FILES`), so a remote
box can be diagnosed from a bundle. The parsers are in :mod:`datagen.host.nvidia_smi`, the report model in
:mod:`datagen.host.env_report`, the judgement in :mod:`datagen.host.diagnose`. Probing never imports torch
or sglang in this process.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import platform
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

from datagen.engines import engine_packages
from datagen.engines.sglang_flags import SGLangIntrospectionError, sglang_flags
from datagen.errors import ProbeError
from datagen.host.cuda_env import (
    CudaToolkit,
    TorchInfo,
    find_cuda_toolkit,
    parse_torch_probe,
    read_torch_version_file,
    run_torch_probe,
)
from datagen.host.diagnose import diagnose
from datagen.host.env_report import EnvReport, GpuInfo, Interconnect, Problem
from datagen.host.nvidia_smi import (
    GPU_QUERY_FIELDS,
    parse_compute_apps_csv,
    parse_cuda_driver_version,
    parse_gpu_query_csv,
    parse_nvcc_version,
    parse_topology,
    query_compute_apps,
    run_command,
)

logger = logging.getLogger(__name__)

# torch for the GPUs' CUDA build; the engines name their own (and the router's).
PACKAGES = ("torch", *engine_packages())

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
        outputs["query_gpu"], error = run_command(
            [smi_bin, f"--query-gpu={','.join(fields)}", "--format=csv"]
        )
        if outputs["query_gpu"] is None and error and "compute_cap" in error:
            # Drivers older than 510 do not know the compute_cap field: ask again without it.
            fields.remove("compute_cap")
            outputs["query_gpu"], error = run_command(
                [smi_bin, f"--query-gpu={','.join(fields)}", "--format=csv"]
            )
        if error:
            problems.append(
                Problem(severity="error", message=error, fix="check the NVIDIA driver (nvidia-smi)")
            )
        outputs["topo"], topo_error = run_command([smi_bin, "topo", "-m"])
        if topo_error:
            problems.append(
                Problem(
                    severity="warning",
                    message=topo_error,
                    fix="tensor parallelism is planned without NVLink knowledge; set fleet.tensor_parallel "
                    "only if you know the topology",
                )
            )
        outputs["smi"], _ = run_command([smi_bin])
        outputs["apps"] = query_compute_apps()
    nvcc_bin = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
    )
    if nvcc_bin is not None:
        outputs["nvcc"], _ = run_command([nvcc_bin, "--version"])
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
    try:
        # sglang's own parser, asked in this interpreter (the one the servers run in).
        flags = sglang_flags()
    except (SGLangIntrospectionError, OSError, subprocess.TimeoutExpired) as error:
        flags = None
        problems.append(
            Problem(
                severity="warning",
                message=f"cannot read the flags the installed sglang accepts: {error}",
                fix="check that `python -m sglang.launch_server --help` runs in this interpreter",
            )
        )
    packages = installed_versions()
    if record_dir is not None:
        _record(Path(record_dir), outputs, toolkit, flags, packages)
    report = _report_from_outputs(
        outputs,
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
    return _report_from_outputs(
        outputs,
        packages=packages,
        hostname=folder.name,
        torch=parse_torch_probe(outputs["torch"]) if outputs["torch"] else None,
        cuda_toolkit=CudaToolkit.model_validate_json(outputs["toolkit"]) if outputs["toolkit"] else None,
        sglang_flags=outputs["sglang_flags"].split() if outputs["sglang_flags"] is not None else None,
    )


def _report_from_outputs(outputs: dict[str, str | None], **rest: Any) -> EnvReport:
    """:func:`build_report` over the raw ``nvidia-smi``/``nvcc`` outputs (run now or recorded) and ``rest``."""
    return build_report(
        query_gpu=outputs["query_gpu"],
        topo=outputs["topo"],
        smi=outputs["smi"],
        apps=outputs["apps"],
        nvcc=outputs["nvcc"],
        **rest,
    )
