"""The cost preview against the measurement: two runs of one config; the second run's estimate vs its cost.

Two real `datagen run` processes (the CLI's own Prefect API server) of the same config, one after the other,
against an OpenAI-compatible test server (tests/support/fault_server.py, answering at once) and with one box
history (a fresh ``DATAGEN_STATE_DIR``). The first run's preview has no history (defaults, the planner's rate);
the second's is priced from what the first measured. Prints each run's accounting (``report.json``): the
estimated and the measured time training was paused.

    python benchmarks/bench_preview.py WORK_DIR MODEL_DIR PROMPTS     # MODEL_DIR: `datagen tiny-model` output
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.fault_server import FaultServer  # noqa: E402
from tests.support.run_configs import external_run_config, write_prompts  # noqa: E402

SHARD_SIZE = 64
IN_FLIGHT = 8


def main() -> None:
    """Run the config twice and print each run's estimated and measured paused time."""
    work, model_dir, prompts = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DATAGEN_STATE_DIR": str(work / "state"), "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    with FaultServer() as server:
        config = external_run_config(
            work / "run.yaml",
            server_url=server.url,
            model_dir=model_dir,
            prompts=write_prompts(work / "prompts.jsonl", prompts, "Rerun question"),
            dataset="rerun",
            shard_size=SHARD_SIZE,
            in_flight=IN_FLIGHT,
            output=str(work / "out"),
            protected=str(work / "train"),
            generation={"checkpoint_interval_s": 0.2, "backoff_initial_s": 0.05},
        )
        for run_id in ("rerun-1", "rerun-2"):
            command = [
                sys.executable,
                "-m",
                "flows.cli_entry",
                "run",
                "--config",
                str(config),
                "--run-id",
                run_id,
            ]
            result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO, check=False)
            if result.returncode:
                raise SystemExit(result.stderr[-2000:])
            accounting = json.loads((work / "out" / "runs" / run_id / "report.json").read_text())[
                "accounting"
            ]
            estimated, measured = accounting["estimated_training_paused_s"], accounting["training_paused_s"]
            print(
                json.dumps(
                    {
                        "run": run_id,
                        "estimated_paused_s": estimated,
                        "measured_paused_s": measured,
                        "estimate_over_measured": round(estimated / measured, 3),
                    }
                )
            )


if __name__ == "__main__":
    main()
