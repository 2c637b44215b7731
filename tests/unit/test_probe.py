from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from datagen.errors import ProbeError
from datagen.host.cuda_env import (
    TorchInfo,
    find_cuda_toolkit,
    jit_env_fixes,
    parse_torch_probe,
    parse_torch_version_py,
    read_torch_version_file,
)
from datagen.host.env_report import EnvReport
from datagen.host.nvidia_smi import parse_compute_apps_csv, parse_gpu_query_csv, parse_topology
from datagen.host.probe import probe_environment, probe_from_dir

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "probe"
NO_PACKAGES: dict[str, str | None] = {"torch": None, "sglang": None}


def test_recorded_h200_pair_reports_gpus_driver_cuda_and_one_nvlink_island() -> None:
    report = probe_from_dir(FIXTURES / "h200x2-nvlink", packages=NO_PACKAGES)

    assert [gpu.index for gpu in report.gpus] == [0, 1]
    first = report.gpus[0]
    assert first.name == "NVIDIA H200"
    assert first.memory_total_mib == 143771
    assert first.memory_used_mib == 0
    assert first.compute_capability == "9.0"
    assert first.uuid == "GPU-114030db-b115-1cca-945c-825ea28bfdf5"
    assert report.driver_version == "580.159.04"
    assert report.cuda_driver_version == "13.0"
    assert report.nvcc_version == "13.0"
    assert report.interconnect.kind == "nvlink"
    assert report.interconnect.nvlink_islands == [[0, 1]]
    assert report.interconnect.links == {"0-1": "NV18"}
    assert report.gpu_processes == []
    assert all(problem.severity == "info" for problem in report.problems)


def test_pcie_box_has_no_nvlink_islands_and_flags_the_gpu_still_in_use() -> None:
    report = probe_from_dir(FIXTURES / "pcie-8gpu", packages=NO_PACKAGES)

    assert len(report.gpus) == 8
    assert report.interconnect.kind == "pcie"
    assert report.interconnect.nvlink_islands == [[index] for index in range(8)]
    assert report.interconnect.links["0-1"] == "NODE"
    assert report.interconnect.links["0-4"] == "SYS"
    assert len(report.interconnect.links) == 8 * 7 // 2
    assert [process.pid for process in report.gpu_processes] == [48211]
    assert report.gpu_processes[0].used_memory_mib == 61230
    warnings = [problem for problem in report.problems if problem.severity == "warning"]
    assert len(warnings) == 1
    assert "GPU 3" in warnings[0].message
    assert warnings[0].fix is not None and "halt" in warnings[0].fix


def test_nvlink_pairs_form_two_islands_and_missing_compute_cap_column_is_tolerated() -> None:
    report = probe_from_dir(FIXTURES / "nvlink-pairs-4gpu", packages=NO_PACKAGES)

    assert report.interconnect.kind == "mixed"
    assert report.interconnect.nvlink_islands == [[0, 1], [2, 3]]
    assert all(gpu.compute_capability is None for gpu in report.gpus)
    assert report.driver_version == "470.57.02"


def test_gpu_query_columns_are_read_by_name_not_position() -> None:
    reordered = (
        "memory.used [MiB], driver_version, compute_cap, name, index, memory.total [MiB], uuid\n"
        "17 MiB, 580.1, 8.9, NVIDIA L4, 1, 23034 MiB, GPU-b\n"
        "5 MiB, 580.1, 8.9, NVIDIA L4, 0, 23034 MiB, GPU-a\n"
    )

    gpus, driver = parse_gpu_query_csv(reordered)

    assert [(gpu.index, gpu.uuid, gpu.memory_used_mib) for gpu in gpus] == [(0, "GPU-a", 5), (1, "GPU-b", 17)]
    assert gpus[0].memory_total_mib == 23034
    assert gpus[0].compute_capability == "8.9"
    assert driver == "580.1"


def test_not_applicable_values_become_none() -> None:
    gpus, _ = parse_gpu_query_csv(
        "index, name, uuid, memory.total [MiB], memory.used [MiB], compute_cap\n"
        "0, GPU X, [N/A], [N/A], [N/A], 9.0\n"
    )

    assert gpus[0].uuid is None
    assert gpus[0].memory_total_mib is None


def test_gpu_query_parser_rejects_text_without_index_column() -> None:
    with pytest.raises(ValueError, match="index"):
        parse_gpu_query_csv('Field "bogus_field" is not a valid field to query.\n')


def test_compute_apps_with_only_a_header_means_no_processes() -> None:
    assert parse_compute_apps_csv("pid, process_name, used_gpu_memory [MiB], gpu_uuid\n") == []


def test_topology_without_gpu_rows_is_unknown() -> None:
    assert parse_topology("No devices were found\n").kind == "unknown"


def test_an_empty_or_missing_folder_is_an_error_not_a_host_without_gpus(tmp_path: Path) -> None:
    with pytest.raises(ProbeError, match="no recorded probe outputs"):
        probe_from_dir(tmp_path / "missing")
    with pytest.raises(ProbeError, match="datagen probe --record"):
        probe_from_dir(tmp_path)


def test_bundle_of_a_host_without_nvidia_smi_means_no_gpus_and_an_info_problem(tmp_path: Path) -> None:
    (tmp_path / "packages.json").write_text("{}")
    report = probe_from_dir(tmp_path, packages=NO_PACKAGES)

    assert report.gpus == []
    assert report.interconnect.kind == "none"
    assert [problem.severity for problem in report.problems] == ["info"]
    assert "nvidia-smi" in report.problems[0].message


def test_markdown_lists_every_gpu_and_the_interconnect() -> None:
    markdown = probe_from_dir(FIXTURES / "pcie-8gpu", packages=NO_PACKAGES).to_markdown()

    assert markdown.count("| NVIDIA RTX PRO 6000") == 8
    assert "pcie" in markdown
    assert "**warning**: GPU 3" in markdown


def test_markdown_puts_each_problems_fix_on_a_line_of_its_own() -> None:
    report = probe_from_dir(FIXTURES / "pcie-8gpu", packages=NO_PACKAGES)
    fixed = [problem for problem in report.problems if problem.fix]
    assert fixed, "the fixture has a problem with a fix"

    lines = report.to_markdown().splitlines()

    for problem in fixed:
        at = lines.index(f"- **{problem.severity}**: {problem.message}")
        assert lines[at + 1] == f"  - Fix: {problem.fix}"


def test_report_round_trips_through_json() -> None:
    report = probe_from_dir(FIXTURES / "h200x2-nvlink", packages=NO_PACKAGES)

    assert EnvReport.model_validate_json(report.model_dump_json()) == report


def test_probe_of_this_host_matches_whether_nvidia_smi_exists() -> None:
    report = probe_environment()

    assert report.hostname
    assert report.packages.get("transformers") is not None
    if shutil.which("nvidia-smi") is None:
        assert report.gpus == []
        assert any(problem.severity == "info" for problem in report.problems)
    else:
        assert report.gpus or report.problems


def test_h200_pair_recording_has_only_informational_notes_with_fixes() -> None:
    # Recorded on the real 2xH200 test host: a working CUDA 13 stack without sglang, and libcuda for
    # linking only as a stub (what JIT builds link against; fleet.fix_jit_env puts it on LIBRARY_PATH).
    report = probe_from_dir(FIXTURES / "h200x2-nvlink", packages=NO_PACKAGES)

    assert {problem.severity for problem in report.problems} == {"info"}
    messages = " | ".join(problem.message for problem in report.problems)
    assert "sglang is not installed" in messages
    assert "stub" in messages
    assert all(problem.fix for problem in report.problems)
    assert report.torch is not None and report.torch.cuda == "13.0"


def test_sm120_workstation_reports_each_jit_trap_with_its_fix() -> None:
    report = probe_from_dir(FIXTURES / "sm120-workstation")

    assert report.compute_capabilities == ["12.0"]
    assert report.interconnect.kind == "single"
    assert report.torch is not None and report.torch.cuda == "12.6"
    assert report.packages.get("sglang") == "0.5.23"
    assert report.sglang_flags is not None and "--mamba-radix-cache-strategy" in report.sglang_flags
    by_topic = {problem.message.split(" ")[0]: problem for problem in report.problems}
    sm_problem = next(problem for problem in report.problems if "no kernels" in problem.message)
    assert sm_problem.severity == "error"
    assert sm_problem.fix is not None and "sm_120" in sm_problem.fix
    cccl = next(problem for problem in report.problems if "CCCL" in problem.message)
    assert cccl.severity == "warning"
    assert cccl.fix is not None and "CPATH=/usr/local/cuda-13.0/include/cccl" in cccl.fix
    assert any("differ in major version" in problem.message for problem in report.problems)
    assert any("stub" in problem.message for problem in report.problems)
    assert all(problem.fix for problem in report.problems), by_topic


def test_jit_fixes_prepend_the_found_folders_and_leave_the_rest_alone() -> None:
    report = probe_from_dir(FIXTURES / "sm120-workstation")
    assert report.cuda_toolkit is not None

    fixes = jit_env_fixes(report.cuda_toolkit, {"CPATH": "/opt/include", "CUDA_HOME": "/opt/cuda"})

    assert fixes == {
        "CPATH": "/usr/local/cuda-13.0/include/cccl:/opt/include",
        "LIBRARY_PATH": "/usr/local/cuda-13.0/lib64/stubs",
    }


def _touch(path: Path, text: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_toolkit_search_finds_cccl_under_include_cccl_and_the_libcuda_stub(tmp_path: Path) -> None:
    cuda = tmp_path / "cuda-13.0"
    _touch(cuda / "include" / "cuda_runtime.h")
    _touch(cuda / "include" / "cccl" / "nv" / "target")
    _touch(cuda / "lib64" / "libcudart.so.13")
    _touch(cuda / "lib64" / "stubs" / "libcuda.so")
    empty_path = str(tmp_path / "no-bin")

    found = find_cuda_toolkit(
        {"CUDA_HOME": str(cuda), "PATH": empty_path}, site_dirs=[], driver_lib_dirs=(), system_roots=[]
    )

    assert found.cuda_home == str(cuda)
    assert found.include_dir == str(cuda / "include")
    assert found.cccl_include_dir == str(cuda / "include" / "cccl")
    assert not found.cccl_on_default_path
    assert found.cudart_dir == str(cuda / "lib64")
    assert found.libcuda_link_dir == str(cuda / "lib64" / "stubs") and found.libcuda_is_stub


def test_toolkit_search_reads_nvidia_wheels_in_site_packages(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    _touch(site / "nvidia" / "cu13" / "include" / "cuda_runtime.h")
    _touch(site / "nvidia" / "cu13" / "include" / "nv" / "target")
    _touch(site / "nvidia" / "cu13" / "lib" / "libcudart.so.13")

    found = find_cuda_toolkit({"PATH": str(tmp_path)}, site_dirs=[site], driver_lib_dirs=(), system_roots=[])

    assert found.cccl_include_dir == str(site / "nvidia" / "cu13" / "include")
    assert found.cccl_on_default_path
    assert found.cudart_dir == str(site / "nvidia" / "cu13" / "lib")
    assert found.libcuda_link_dir is None


def test_torch_version_file_and_probe_output_are_parsed_without_importing_torch() -> None:
    info = parse_torch_version_py("__version__ = '2.11.0+cu130'\ncuda: Optional[str] = '13.0'\n")
    cpu = parse_torch_version_py("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\n")
    probed = parse_torch_probe(
        "torch_version=2.11.0+cu130\ncuda=13.0\ncuda_available=True\ndevice_count=2\n"
        "arch_list=sm_80 sm_90 sm_100 sm_120 compute_120\n"
    )

    assert (info.version, info.cuda) == ("2.11.0+cu130", "13.0")
    assert cpu.cuda is None
    assert probed.device_count == 2 and probed.cuda_available
    assert probed.supports_sm("9.0") and probed.supports_sm("12.0")
    assert probed.supports_sm("8.6") is False
    assert TorchInfo().supports_sm("9.0") is None


def test_this_hosts_torch_build_is_read_from_its_version_file() -> None:
    info = read_torch_version_file()
    installed = Version(importlib.metadata.version("torch"))

    assert info is not None and info.version is not None
    read = Version(info.version)
    # Only the version file names PyPI's Linux build: its distribution is 2.13.0, its module 2.13.0+cu130
    # (the CPU index's wheel says +cpu in both).
    assert read.public == installed.public
    assert installed.local is None or read.local == installed.local
    assert (info.cuda is None) == (read.local in (None, "cpu"))


def test_cpu_only_torch_on_a_gpu_host_is_an_error_with_the_install_command(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(FIXTURES / "h200x2-nvlink", bundle)
    (bundle / "torch.txt").write_text("torch_version=2.13.0+cpu\ncuda=None\ncuda_available=False\n")

    report = probe_from_dir(bundle, packages=NO_PACKAGES)

    errors = [problem for problem in report.problems if problem.severity == "error"]
    assert len(errors) == 1
    assert "CPU-only" in errors[0].message
    assert errors[0].fix is not None and "download.pytorch.org/whl/cu" in errors[0].fix


def test_recorded_bundle_reads_back_as_the_same_report(tmp_path: Path) -> None:
    live = probe_environment(record_dir=tmp_path / "bundle")

    again = probe_from_dir(tmp_path / "bundle")

    assert again.gpus == live.gpus
    assert again.cuda_toolkit == live.cuda_toolkit
    assert again.packages == live.packages
    assert again.nvcc_version == live.nvcc_version
    assert [problem.message for problem in again.problems] == [problem.message for problem in live.problems]


def test_cli_probe_from_dir_prints_json_with_two_nvlinked_sm90_gpus() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli_entry",
            "probe",
            "--json",
            "--from-dir",
            str(FIXTURES / "h200x2-nvlink"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )

    report = EnvReport.model_validate_json(result.stdout)
    assert [gpu.compute_capability for gpu in report.gpus] == ["9.0", "9.0"]
    assert report.interconnect.nvlink_islands == [[0, 1]]


def test_single_h200_recording_is_one_sm90_gpu_without_links() -> None:
    # Recorded with `datagen probe --record` on the real one-GPU H200 test host.
    report = probe_from_dir(FIXTURES / "h200x1", packages=NO_PACKAGES)

    assert [(gpu.name, gpu.compute_capability, gpu.memory_total_mib) for gpu in report.gpus] == [
        ("NVIDIA H200", "9.0", 143771)
    ]
    assert report.interconnect.kind == "single"
    assert {problem.severity for problem in report.problems} == {"info"}


@pytest.mark.parametrize("version", ["0.5.23", "0.5.14"])
def test_cli_probe_with_model_plans_on_bundles_recorded_with_each_supported_sglang(version: str) -> None:
    model = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen3.6-27b-shaped"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli_entry",
            "probe",
            "--json",
            "--from-dir",
            str(FIXTURES / f"pcie-8x-sm120-sglang-{version}"),
            "--model",
            str(model),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )

    data = json.loads(result.stdout)
    assert data["packages"]["sglang"] == version
    plan = data["plan"]
    assert len(plan["servers"]) == 8
    argv = plan["servers"][0]["launch"]["argv"]
    assert argv[argv.index("--attention-backend") + 1] == "flashinfer"
    assert "--disable-radix-cache" in argv
