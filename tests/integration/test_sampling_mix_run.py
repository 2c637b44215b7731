"""A whole `datagen run` with a sampling mix: each prompt's setting reaches the wire, its record and the report.

The real CLI (its own Prefect API server) against an OpenAI-compatible test server: every request's body carries
the sampling of the setting its prompt id draws, every stored completion names that setting and its parameters,
and the report counts completions per setting.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import yaml

from datagen.config import load_run_config
from datagen.records import CompletionRecord
from tests.support.fault_server import FaultServer
from tests.support.run_configs import external_run_config, write_prompts

REPO = Path(__file__).resolve().parents[2]
PROMPTS = 40
CLI_TIMEOUT_S = 300
MIX = [
    {"name": "cold", "weight": 1, "temperature": 0.1, "enable_thinking": False, "max_tokens": 3},
    {"name": "hot", "weight": 1, "temperature": 0.9, "top_k": 20},
]


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


def test_a_run_samples_each_prompt_with_the_setting_its_id_draws_and_reports_the_mix(
    tmp_path: Path, tiny_model_dir: Path, prefect_api: str
) -> None:
    with FaultServer() as server:
        path = external_run_config(
            tmp_path / "run.yaml",
            server_url=server.url,
            model_dir=tiny_model_dir,
            prompts=write_prompts(tmp_path / "prompts.jsonl", PROMPTS, "Mixed question"),
            dataset="mixed",
            shard_size=16,
            in_flight=4,
            output=str(tmp_path / "out"),
            protected=str(tmp_path / "train"),
            generation={"checkpoint_interval_s": 0.2, "backoff_initial_s": 0.05},
        )
        data = yaml.safe_load(path.read_text())
        data["datasets"][0]["sampling_mix"] = MIX
        path.write_text(yaml.safe_dump(data))
        ran = _cli(tmp_path, prefect_api, "run", "--config", str(path), "--run-id", "mixed-1")
        assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
        bodies = {
            request.body["messages"][-1]["content"]: request.body
            for request in server.chat_requests()
            if request.body is not None
        }

    config = load_run_config(path)
    dataset = config.dataset("mixed")
    run_root = tmp_path / "out" / "runs" / "mixed-1"
    records = [
        CompletionRecord.model_validate_json(line)
        for file in sorted((run_root / "completions").rglob("*.jsonl"))
        for line in file.read_text().splitlines()
    ]
    assert len(records) == PROMPTS
    for record in records:
        setting, sampling = config.sampling_for_prompt(dataset, record.prompt_id)
        assert record.sampling_setting == setting
        assert record.sampling == sampling
        body = bodies[record.messages[-1].content or ""]
        assert (body["temperature"], body["max_tokens"], body.get("top_k")) == (
            sampling.temperature,
            sampling.max_tokens,
            sampling.top_k,
        )
        thinking = body.get("chat_template_kwargs", {}).get("enable_thinking")
        assert thinking == sampling.enable_thinking
    drawn = Counter(record.sampling_setting for record in records)
    assert set(drawn) == {"cold", "hot"}, "40 prompts at equal weights draw both settings"

    report = json.loads((run_root / "report.json").read_text())
    (mixed,) = [item for item in report["datasets"] if item["dataset"] == "mixed"]
    assert mixed["sampling_settings"] == dict(drawn)
    assert report["totals"]["sampling_settings"] == dict(drawn)
    markdown = (run_root / "report.md").read_text()
    assert "## Completions by sampling setting" in markdown
    assert f"- mixed / cold: {drawn['cold']}" in markdown
