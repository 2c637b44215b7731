"""The environment report: what a host offers the planner, and what may go wrong there.

:class:`EnvReport` is the output of :mod:`datagen.host.probe` (from live commands or a recorded bundle),
an artifact of every run (``attempts/<id>/env.json``) and the input of :mod:`datagen.host.plan`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from datagen.engines import engine_class
from datagen.escape import markdown_code
from datagen.host.cuda_env import CudaToolkit, TorchInfo, jit_env_fixes

# Memory a GPU may show as used with nothing of ours on it (driver context, monitoring agents).
IDLE_GPU_MEMORY_MIB = 1024

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

    def engine_flags(self, engine: str) -> list[str] | None:
        """Launch flags the probe found ``engine``'s install accepts; None when its flags do not vary (not probed)."""
        return self.sglang_flags if engine_class(engine).launch_flags_vary else None

    def jit_env(self) -> dict[str, str]:
        """Server environment that fixes the found JIT problems (empty when none or not probed)."""
        return jit_env_fixes(self.cuda_toolkit) if self.cuda_toolkit is not None else {}

    def to_markdown(self) -> str:
        """A human-readable report (Prefect artifact, runbook)."""
        lines = [
            f"# Environment of {markdown_code(self.hostname)}",
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
            # The fix is a list item of its own under its problem: a markdown continuation line would run the
            # two sentences together.
            for problem in self.problems:
                lines.append(f"- **{problem.severity}**: {problem.message}")
                if problem.fix:
                    lines.append(f"  - Fix: {problem.fix}")
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
