"""Judge an environment report: every problem it reveals, with a severity and the concrete fix.

GPU memory already in use, a driver older than torch's CUDA build, JIT prerequisites (CCCL headers,
libcuda stubs) the servers would miss, engine packages and SM-specific limits. Only what was probed is
judged: a bundle without ``torch.txt`` yields no torch problems.
"""

from __future__ import annotations

import re

from datagen.engines.sglang import SGLangEngine
from datagen.host.env_report import IDLE_GPU_MEMORY_MIB, EnvReport, Problem, Severity


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


def _hits(*checks: tuple[object, Severity, str, str]) -> list[Problem]:
    # One table row per check: (condition, severity, message, fix); the rows whose condition holds.
    return [
        Problem(severity=severity, message=message, fix=fix) for hit, severity, message, fix in checks if hit
    ]


def _torch_problems(report: EnvReport) -> list[Problem]:
    torch = report.torch
    if torch is None:
        return []
    driver_cuda = _version_tuple(report.cuda_driver_version)
    if torch.cuda is None:
        return _hits(
            (
                True,
                "error",
                f"torch {torch.version} is a CPU-only build on a host with GPUs",
                "install a CUDA build of torch, e.g. `pip install torch --index-url "
                "https://download.pytorch.org/whl/cu130` (pick the CUDA the driver supports)",
            )
        )
    torch_cuda = _version_tuple(torch.cuda)
    problems = _hits(
        (
            driver_cuda and torch_cuda and torch_cuda > driver_cuda,
            "error",
            f"torch is built for CUDA {torch.cuda} but the driver {report.driver_version} supports "
            f"CUDA {report.cuda_driver_version} at most",
            f"upgrade the NVIDIA driver, or install a torch built for CUDA <= {report.cuda_driver_version}",
        ),
        (
            torch.cuda_available is False,
            "error",
            "torch cannot use the GPUs (torch.cuda.is_available() is False)",
            "check that the driver loads (nvidia-smi), that CUDA_VISIBLE_DEVICES is not empty, and "
            "that the driver supports torch's CUDA build",
        ),
    )
    for capability in report.compute_capabilities:
        problems += _hits(
            (
                torch.supports_sm(capability) is False,
                "error",
                f"torch {torch.version} has no kernels for the GPUs' SM {capability} "
                f"(built for {' '.join(torch.arch_list)})",
                f"install a torch build that includes sm_{capability.replace('.', '')} (for SM 12.0: a CUDA "
                "12.8 or newer wheel, e.g. --index-url https://download.pytorch.org/whl/cu128)",
            )
        )
    return problems


def _toolkit_problems(report: EnvReport) -> list[Problem]:
    nvcc = _version_tuple(report.nvcc_version)
    driver_cuda = _version_tuple(report.cuda_driver_version)
    torch_cuda = _version_tuple(report.torch.cuda) if report.torch is not None else None
    toolkit = report.cuda_toolkit
    problems = _hits(
        (
            toolkit is not None and nvcc is None,
            "warning",
            "nvcc not found: kernels that sglang/flashinfer compile at first use (JIT) cannot be built",
            "install the CUDA toolkit matching torch's CUDA (or `pip install nvidia-cuda-nvcc`) and "
            "put its bin/ on PATH or set CUDA_HOME",
        ),
        (
            nvcc and driver_cuda and nvcc > driver_cuda,
            "warning",
            f"nvcc {report.nvcc_version} is newer than the driver's CUDA {report.cuda_driver_version}: "
            "JIT-compiled kernels will not load",
            f"use a CUDA toolkit <= {report.cuda_driver_version} (set CUDA_HOME) or upgrade the driver",
        ),
        (
            nvcc and torch_cuda and nvcc[0] != torch_cuda[0],
            "warning",
            f"nvcc {report.nvcc_version} and torch's CUDA {report.torch.cuda if report.torch else ''} "
            "differ in major version: JIT extensions built against torch may fail to compile or load",
            "set CUDA_HOME to a toolkit with the same major version as torch's CUDA build",
        ),
    )
    if toolkit is None:
        return problems
    cccl_found = toolkit.cccl_include_dir is not None
    libcuda_found = toolkit.libcuda_link_dir is not None
    return problems + _hits(
        (
            not cccl_found,
            "warning",
            "CCCL headers (nv/target) not found in any CUDA include folder: JIT builds of "
            "sglang/flashinfer kernels fail with 'nv/target: No such file or directory'",
            "install the toolkit's CCCL (`pip install nvidia-cuda-cccl` or the cuda-cccl package) "
            "and set CUDA_HOME to that toolkit",
        ),
        (
            cccl_found and not toolkit.cccl_on_default_path,
            "warning",
            f"CCCL headers are only in {toolkit.cccl_include_dir} (the CUDA 13 layout): JIT builds "
            "that add only the toolkit's include/ fail with 'nv/target: No such file or directory'",
            f"set fleet.fix_jit_env: true (the servers get CPATH={toolkit.cccl_include_dir}) or export "
            "CPATH yourself",
        ),
        (
            not libcuda_found,
            "warning",
            "no libcuda.so to link against (neither the driver's nor a toolkit stub): JIT builds "
            "linking -lcuda (Triton, sglang kernels) fail with 'cannot find -lcuda'",
            "install the toolkit's stubs (lib64/stubs/libcuda.so, e.g. cuda-driver-dev) and set "
            "fleet.fix_jit_env: true to put them on the servers' LIBRARY_PATH",
        ),
        (
            libcuda_found and toolkit.libcuda_is_stub,
            "info",
            f"libcuda.so for linking exists only as a stub in {toolkit.libcuda_link_dir}",
            f"set fleet.fix_jit_env: true (the servers get LIBRARY_PATH={toolkit.libcuda_link_dir})",
        ),
        (
            toolkit.cudart_dir is None,
            "warning",
            "libcudart.so not found in any CUDA toolkit or nvidia-* wheel",
            "install the CUDA runtime (`pip install nvidia-cuda-runtime` or the toolkit) and set CUDA_HOME",
        ),
    )


def _engine_problems(report: EnvReport) -> list[Problem]:
    # Engine rules live with the engine (datagen/engines); the probe only reports them.
    found = SGLangEngine().host_problems(report.packages, report.compute_capabilities)
    return [Problem(severity=severity, message=message, fix=fix) for severity, message, fix in found]
