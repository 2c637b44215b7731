"""A finished run leaves its measurements in the box's history, and the next preview prices from them.

A real `datagen run` (the CLI's own Prefect API server) against an OpenAI-compatible test server, then a real
`datagen plan` of the same config with the same state dir: the first preview (in the run's preflight record)
had no history and said so; the run's report accounts for the paused time beside that estimate; the second
preview takes its rate, answer lengths and overheads from what the run measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.fault_server import FaultServer
from tests.support.run_configs import external_run_config, write_prompts

REPO = Path(__file__).resolve().parents[2]
PROMPTS = 12
CLI_TIMEOUT_S = 300


def _cli(tmp_path: Path, prefect_api: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DATAGEN_STATE_DIR": str(tmp_path / "state"),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    env["PREFECT_API_URL"] = prefect_api
    return subprocess.run(
        [sys.executable, "-m", "flows.cli_entry", *arguments],
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )


def test_a_run_appends_the_box_history_and_the_next_plan_prices_from_it(
    tmp_path: Path, tiny_model_dir: Path, prefect_api: str
) -> None:
    with FaultServer() as server:
        config = external_run_config(
            tmp_path / "run.yaml",
            server_url=server.url,
            model_dir=tiny_model_dir,
            prompts=write_prompts(tmp_path / "prompts.jsonl", PROMPTS, "Costly question"),
            dataset="costly",
            shard_size=6,
            in_flight=4,
            output=str(tmp_path / "out"),
            protected=str(tmp_path / "train"),
            generation={"checkpoint_interval_s": 0.2, "backoff_initial_s": 0.05},
        )
        first = _cli(tmp_path, prefect_api, "plan", "--config", str(config), "--json")
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        ran = _cli(tmp_path, prefect_api, "run", "--config", str(config), "--run-id", "costly-1")
        assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
        second = _cli(tmp_path, prefect_api, "plan", "--config", str(config), "--json")
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]

    before, after = json.loads(first.stdout), json.loads(second.stdout)
    assert before["rate_source"] == "planner" and not before["overheads"]["measured"]
    assert before["datasets"][0]["prompts"] == PROMPTS
    assert before["datasets"][0]["answer_source"] == "assumed"

    run_root = tmp_path / "out" / "runs" / "costly-1"
    report = json.loads((run_root / "report.json").read_text())
    accounting = report["accounting"]
    assert accounting["training_paused_s"] >= accounting["generation_wall_s"] > 0
    assert 0 < accounting["generating_share"] <= 1
    assert accounting["estimated_training_paused_s"] is not None, "the preflight's preview stands beside"
    (history,) = (tmp_path / "state" / "history").glob("*-run-*.json")
    record = json.loads(history.read_text())
    assert record["run_id"] == "costly-1"
    assert record["answers"]["costly"]["completions"] == PROMPTS

    assert after["rate_source"] == "measured"
    assert after["output_tokens_per_s"] == record["output_tokens_per_s"]
    (dataset,) = after["datasets"]
    assert dataset["answer_source"] == "measured"
    assert dataset["mean_answer_tokens"] == record["answers"]["costly"]["output_tokens"] / PROMPTS
    assert after["overheads"]["measured"]
    assert after["overheads"]["fleet_start_s"] == record["fleet_start_s"]
