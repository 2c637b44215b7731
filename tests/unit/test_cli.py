"""The `datagen` command line, run as a real subprocess: inspect counts, clear errors, a fast --help."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from datagen.prompts.datasets import FORMATS
from datagen.samples import sample_path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "datasets"
EXIT_CONFIG_ERROR = 2
# `datagen --help` must not pay for torch or Prefect; a generous bound for a loaded 2-core CI box.
HELP_MAX_S = 10.0


def load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The per-row outcomes of every hostile fixture, stated once in the format tests.
EXPECTED_ROWS: dict[str, list[int | str]] = load_module(
    REPO / "tests" / "unit" / "test_datasets_formats.py"
).EXPECTED
# Rows of the hostile fixtures that normalise fine but repeat an earlier prompt (inspect dedupes them):
# codefeedback_filtered rows 2 and 3 repeat row 0 (the same query, then with other spacing and case);
# metamath element 1 repeats element 0.
DUPLICATE_ROWS = {"codefeedback_filtered": 2, "metamath": 1}
SAMPLE_ROWS: dict[str, tuple[str, list[dict[str, Any]]]] = load_module(FIXTURES / "build_samples.py").SAMPLES


def datagen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli_entry", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def hostile_fixture(format: str) -> str:
    (path,) = sorted(FIXTURES.glob(f"{format}_hostile.*"))
    return str(path)


@pytest.mark.parametrize("format", FORMATS)
def test_inspect_json_counts_rows_prompts_and_rejections_of_each_hostile_fixture(format: str) -> None:
    expected = EXPECTED_ROWS[format]
    result = datagen("datasets", "inspect", "--format", format, hostile_fixture(format), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["rows_read"] == len(expected)
    duplicates = DUPLICATE_ROWS.get(format, 0)
    produced = sum(outcome for outcome in expected if isinstance(outcome, int))
    assert report["prompts"] == produced - duplicates
    reasons = Counter("malformed" if o == "unreadable" else o for o in expected if isinstance(o, str))
    if duplicates:
        reasons["duplicate"] = duplicates
    assert report["rejections"] == dict(reasons)


@pytest.mark.parametrize("format", FORMATS)
def test_inspect_reads_each_bundled_sample_in_its_published_file_type(format: str) -> None:
    from datagen.prompts.prepare import inspect_dataset

    result = datagen(
        "datasets", "inspect", "-f", format, sample_path(format), "--json", "--multi-turn", "every_turn"
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["rows_read"] == len(SAMPLE_ROWS[format][1])
    assert report["prompts"] >= 3
    assert report == inspect_dataset(format, sample_path(format), multi_turn="every_turn").model_dump(
        mode="json"
    )


def test_inspect_text_output_is_a_readable_summary() -> None:
    result = datagen("datasets", "inspect", "--format", "hermes_fc", sample_path("hermes_fc"))
    assert result.returncode == 0, result.stderr
    assert "rows read: 5" in result.stdout
    assert "prompts:   4" in result.stdout
    assert "unparseable_tools: 1" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--format", "metamath", "/no/such/file.json"], "No dataset files found"),
        (["--format", "alpaca", sample_path("metamath")], "Unknown dataset format 'alpaca'"),
        (["--format", "metamath", str(FIXTURES / "not_an_array.json")], "one array of rows"),
        (["--format", "metamath", str(FIXTURES / "truncated_array.json")], "not valid JSON"),
        (["--format", "metamath", sample_path("metamath"), "--multi-turn", "all"], "Unknown --multi-turn"),
    ],
)
def test_inspect_errors_exit_2_with_a_message_and_no_traceback(args: list[str], message: str) -> None:
    result = datagen("datasets", "inspect", *args)
    assert result.returncode == EXIT_CONFIG_ERROR
    assert message in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_help_answers_fast_without_importing_torch_or_prefect() -> None:
    code = (
        "import json, sys\n"
        "from flows.cli_entry import main\n"
        "sys.argv = ['datagen', '--help']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exit:\n"
        "    code = exit.code\n"
        "print(json.dumps({'code': code, 'heavy': sorted(m for m in ('torch', 'prefect', 'transformers') "
        "if m in sys.modules)}))\n"
    )
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    elapsed_s = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    *help_lines, last = result.stdout.strip().splitlines()
    assert json.loads(last) == {"code": 0, "heavy": []}
    assert "datasets" in "\n".join(help_lines)
    assert elapsed_s < HELP_MAX_S


def test_run_with_an_invalid_config_exits_2_naming_the_field(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        "model: {path: /models/m}\n"
        "fleet: {max_inflight: 4}\n"
        "datasets: [{name: m, format: metamath, path: x.json, share: 0.5}]\n"
        "output: /tmp/out\n"
    )
    result = datagen("run", "--config", str(config))
    assert result.returncode == EXIT_CONFIG_ERROR
    assert "fleet.max_inflight: unknown key" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_run_with_exact_tokens_on_an_engine_without_generate_exits_2_with_one_message(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        "model: {path: /models/m}\n"
        "fleet: {engine: transformers}\n"
        "generation: {exact_tokens: true}\n"
        "datasets: [{name: m, format: metamath, path: x.json}]\n"
        f"output: {tmp_path / 'out'}\n"
    )
    result = datagen("run", "--config", str(config))
    assert result.returncode == EXIT_CONFIG_ERROR
    assert result.stderr.count("generation.exact_tokens: true needs SGLang's /generate") == 1
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "out").exists()


def test_run_with_a_missing_config_file_exits_2(tmp_path: Path) -> None:
    result = datagen("run", "--config", str(tmp_path / "absent.yaml"))
    assert result.returncode == EXIT_CONFIG_ERROR
    assert "does not exist" in result.stderr


FIXTURES_ROOT = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.mark.parametrize(
    ("model", "mode", "gpu_groups"),
    [("qwen3-27b-shaped", "dp", [[0], [1]]), ("dense-70b-shaped", "tp", [[0, 1]])],
)
def test_probe_from_recorded_h200_pair_reports_nvlink_and_proposes_the_plan(
    model: str, mode: str, gpu_groups: list[list[int]], tmp_path: Path
) -> None:
    temp = tmp_path / "temp"
    temp.mkdir()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli_entry",
            "probe",
            "--json",
            "--from-dir",
            str(FIXTURES_ROOT / "probe" / "h200x2-nvlink"),
            "--model",
            str(FIXTURES_ROOT / "models" / model),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "TMPDIR": str(temp)},
    )
    report = json.loads(result.stdout)
    assert not list(temp.iterdir())  # the plan's log folder is not left behind
    assert len(report["gpus"]) == 2
    assert {gpu["compute_capability"] for gpu in report["gpus"]} == {"9.0"}
    assert report["interconnect"]["kind"] == "nvlink"
    assert report["plan"]["mode"] == mode
    assert [server["gpu_ids"] for server in report["plan"]["servers"]] == gpu_groups


def test_the_core_cli_without_the_flow_refuses_to_run_and_names_the_entry_point() -> None:
    code = "from datagen.app.cli import app\napp(['run', '--config', 'configs/demo.yaml'])\n"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == EXIT_CONFIG_ERROR
    assert "python -m flows.cli_entry" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_probe_with_a_missing_model_is_an_error_naming_the_flag() -> None:
    result = datagen(
        "probe", "--from-dir", str(FIXTURES_ROOT / "probe" / "h200x2-nvlink"), "--model", "/nonexistent/model"
    )
    assert result.returncode == EXIT_CONFIG_ERROR
    assert "--model /nonexistent/model does not exist" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_a_bad_run_id_names_the_flag_and_gives_an_example_not_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        "model: {path: /models/m}\ndatasets: [{name: m, format: metamath, path: x.json}]\noutput: /tmp/out\n"
    )
    result = datagen("run", "--config", str(config), "--run-id", "My Run!")
    assert result.returncode == EXIT_CONFIG_ERROR
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("--run-id 'My Run!' is not a valid run id") and "e.g. --run-id 20261201-" in line
    assert str(config) not in line and "^[a-z0-9]" not in line


def test_run_with_a_dataset_the_config_lacks_exits_2_naming_its_datasets(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        "model: {path: /models/m}\n"
        "datasets: [{name: m, format: metamath, path: x.json}, {name: h, format: hermes_fc, path: y.json}]\n"
        f"output: {tmp_path / 'out'}\n"
    )
    result = datagen("run", "--config", str(config), "--datasets", "m,code", "--max-prompts", "5")
    assert result.returncode == EXIT_CONFIG_ERROR
    assert "the config has no dataset named code; its datasets: m, h" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "out").exists()
    assert datagen("run", "--config", str(config), "--max-prompts", "0").returncode == EXIT_CONFIG_ERROR
