"""A run that produced nothing never says "done", and its failures can be retried on purpose.

Real `datagen run` processes (the CLI's own Prefect API server) against a fault-injecting OpenAI-compatible
server: every request is answered HTTP 400 "Server is pinned to '<another model>'", as another run's server
answers. The run exits 1 with one line naming the dominant failure and its count, publishes no dataset
version, and keeps every result stored. Then, against a good server, ``--retry-failed`` sends each failed
request once more, and every request ends with exactly one outcome that the stored files, the report and the
tokenized dataset agree on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.fault_server import FaultPlan, FaultServer
from tests.support.run_configs import external_run_config, write_prompts

REPO = Path(__file__).resolve().parents[2]
PROMPTS = 12
CLI_TIMEOUT_S = 300


def _config(tmp_path: Path, url: str, model_dir: Path) -> Path:
    return external_run_config(
        tmp_path / "run.yaml",
        server_url=url,
        model_dir=model_dir,
        prompts=write_prompts(tmp_path / "prompts.jsonl", PROMPTS, "Honest question"),
        dataset="honest",
        shard_size=6,
        in_flight=4,
        output=str(tmp_path / "out"),
        protected=str(tmp_path / "train"),
        generation={"checkpoint_interval_s": 0.2, "backoff_initial_s": 0.05},
    )


def _run(config: Path, tmp_path: Path, prefect_api: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DATAGEN_STATE_DIR": str(tmp_path / "state"),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    env["PREFECT_API_URL"] = prefect_api
    command = [
        sys.executable,
        "-m",
        "flows.cli_entry",
        "run",
        "--config",
        str(config),
        "--run-id",
        "honest-1",
    ]
    return subprocess.run(
        [*command, *extra], env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False
    )


def test_a_fleet_answering_400_to_everything_ends_failed_without_a_version_and_retry_failed_answers_all(
    tmp_path: Path, tiny_model_dir: Path, prefect_api: str
) -> None:
    with FaultServer(FaultPlan(pinned_to="someone-elses-model")) as server:
        config = _config(tmp_path, server.url, tiny_model_dir)
        failed = _run(config, tmp_path, prefect_api)
        assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr[-3000:]
        last = failed.stderr.strip().splitlines()[-1]
        assert "http_400 x12" in last and "12 of 12 requests failed" in last, last
        assert "--run-id honest-1 --retry-failed (full log:" in last, last  # the one resume that gets further
        assert last.count("resume with") == 1, last
        assert "UserWarning" not in failed.stderr, failed.stderr[-3000:]
        run_root = tmp_path / "out" / "runs" / "honest-1"
        assert not (tmp_path / "out" / "datasets").exists(), "a run that produced nothing published a version"
        assert not (run_root / "manifest.json").exists()
        stored = [
            row for file in (run_root / "failures").rglob("*.jsonl") for row in file.read_text().splitlines()
        ]
        assert len(stored) == PROMPTS, "every failure is stored"

        sent = len(server.chat_requests())

        # The fleet is fixed: --retry-failed sends every failure once more, and the run completes.
        server.plan.pinned_to = None
        retried = _run(config, tmp_path, prefect_api, "--retry-failed")
        assert retried.returncode == 0, retried.stdout[-3000:] + retried.stderr[-3000:]
        resent = [request.body["messages"][-1]["content"] for request in server.chat_requests()[sent:]]
        assert len(resent) == len(set(resent)) == PROMPTS, "each failure sent again exactly once"

    answered = [
        json.loads(line)
        for file in sorted((run_root / "completions").rglob("*.jsonl"))
        for line in file.read_text().splitlines()
    ]
    keys = [f"{row['prompt_id']}/{row['sample_index']}" for row in answered]
    assert len(keys) == len(set(keys)) == PROMPTS, "every request answered exactly once over all rounds"
    latest_failures = sorted((run_root / "failures").rglob("*.retry-0001.jsonl"))
    assert latest_failures and all(not file.read_text().strip() for file in latest_failures)
    report = json.loads((run_root / "report.json").read_text())
    assert (report["totals"]["completions"], report["totals"]["failures"]) == (PROMPTS, 0)
    assert report["totals"]["tokenized_rows"] == PROMPTS
    (version,) = (tmp_path / "out" / "datasets").rglob("v0001.json")
    assert json.loads(version.read_text())["rows"] == PROMPTS
