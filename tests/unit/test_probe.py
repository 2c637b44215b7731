from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from datagen.probe import (
    EnvReport,
    parse_compute_apps_csv,
    parse_gpu_query_csv,
    parse_topology,
    probe_environment,
    probe_from_dir,
)

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
    assert report.problems == []


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


def test_folder_without_recordings_means_no_gpus_and_an_info_problem(tmp_path: Path) -> None:
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


def test_report_round_trips_through_json() -> None:
    report = probe_from_dir(FIXTURES / "h200x2-nvlink", packages=NO_PACKAGES)

    assert EnvReport.model_validate_json(report.model_dump_json()) == report


def test_probe_of_this_host_matches_whether_nvidia_smi_exists() -> None:
    report = probe_environment()

    assert report.hostname
    assert report.package_version("transformers") is not None
    if shutil.which("nvidia-smi") is None:
        assert report.gpus == []
        assert any(problem.severity == "info" for problem in report.problems)
    else:
        assert report.gpus or report.problems
