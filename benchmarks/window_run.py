"""A whole windowed `datagen run` on simulated servers with realistic answer lengths, then its continuation.

The window-ended attempt and the attempt that sends the rest, as a user runs them (``python -m flows.cli_entry
run``, the CLI's own Prefect API server), against benchmarks/simulator.py: lognormal answers (mean ~300 tokens,
sigma 0.8, cut at max_tokens), so the requests in flight at the window's end are of every length. What it checks
and prints (exit 1 when a check fails):

* the first attempt exits 4 and hands the GPUs back before its window ends (its recorded serving times);
* it published a version with exactly the answers of the shards it finished;
* the second attempt (the window taken out: it is no part of the run's identity) exits 0 and publishes the
  next version on top of the first;
* every prompt is answered and stored exactly once over both attempts, and each answer is in one version's own
  parts.

    python benchmarks/window_run.py                     # a 240 s window on ~150 s of generation
    python benchmarks/window_run.py --window-s 300 --prompts 1200 --work /tmp/win

With no history on the box, the window keeps the preview's defaults for stopping the fleet and restarting training
(30 + 60 s) and admission stops a 99th-percentile answer (max_tokens at an assumed 20 tokens/s: 51 s here) before
generation must end: a 240 s window admits for about 100 s.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

try:  # run as `python benchmarks/window_run.py` (benchmarks/ is on the path) or imported as a module
    from bench import REPO, Scenario, Simulator, build_tokenizer, datagen_config, write_prompts
except ImportError:
    from benchmarks.bench import REPO, Scenario, Simulator, build_tokenizer, datagen_config, write_prompts

# 2 servers x 16 slots, answers of ~300 tokens at 20 ms a step: ~6 s a request, ~150 s for 800 prompts.
SCENARIO = Scenario("window", 2, 16, 300, 0.8, 20.0, 0.0, 800, 1024, 2)
RUN_ID = "window-sim"


def _run(config: Path, env: dict[str, str]) -> tuple[int, str]:
    command = [sys.executable, "-m", "flows.cli_entry", "run", "--config", str(config), "--run-id", RUN_ID]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    return done.returncode, (done.stdout + done.stderr).strip().splitlines()[-1]


def _answers(run_root: Path) -> list[str]:
    return [
        f"{row['prompt_id']}/{row['sample_index']}"
        for file in sorted((run_root / "completions").rglob("*.jsonl"))
        for row in map(json.loads, file.read_text().splitlines())
    ]


def _own_rows(version: dict[str, object]) -> list[str]:
    shards = version["shards"]
    assert isinstance(shards, list)
    return [
        f"{row['prompt_id']}/{row['sample_index']}"
        for shard in shards
        if shard["source"] == version["run_id"]
        for row in pq.read_table(shard["url"], columns=["prompt_id", "sample_index"]).to_pylist()
    ]


def main() -> int:
    """Run both attempts and print each check; 0 when all hold."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--window-s", type=float, default=240.0)
    parser.add_argument("--prompts", type=int, default=SCENARIO.prompts)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="datagen-window-"))
    work.mkdir(parents=True, exist_ok=True)
    prompts, output = work / "prompts.jsonl", work / "out"
    write_prompts(prompts, args.prompts, seed=7)
    tokenizer = build_tokenizer(work / "tokenizer")
    env = {**os.environ, "DATAGEN_STATE_DIR": str(work / "state"), "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    checks: list[tuple[str, bool]] = []
    with Simulator(SCENARIO, work / "simulator.log") as simulator:
        plain = Path(datagen_config(SCENARIO, simulator.urls, prompts, tokenizer, output))
        config = json.loads(plain.read_text())
        config["run_id"] = RUN_ID
        config["datasets"][0]["shard_size"] = 25
        config["tokenize"] = {"include_truncated": True}
        plain.write_text(json.dumps(config))
        windowed = work / "windowed.yaml"
        windowed.write_text(json.dumps({**config, "window": {"max_hours": args.window_s / 3600}}))

        code, last = _run(windowed, env)
        print(f"first attempt: exit {code}: {last}")
        checks.append(("the window ended the first attempt (exit 4)", code == 4))
        run_root = output / "runs" / RUN_ID
        (times_file,) = (run_root / "attempts").rglob("serving-times.json")
        times = json.loads(times_file.read_text())
        halted = dt.datetime.fromisoformat(times["halted_at"])
        handed_back = dt.datetime.fromisoformat(times["handed_back_at"])
        held_s = (handed_back - halted).total_seconds()
        print(f"  GPUs held {held_s:.1f} s of a {args.window_s:.0f} s window")
        checks.append(("the GPUs were handed back inside the window", held_s <= args.window_s))
        first = _answers(run_root)
        done = sum(
            json.loads(marker.read_text())["completions"] for marker in (run_root / "done").rglob("*.json")
        )
        versions = output / "datasets" / "drafter-expansion"
        v1 = json.loads((versions / "v0001.json").read_text()) if (versions / "v0001.json").exists() else None
        print(f"  answers stored {len(first)}, of finished shards {done}, v0001 rows {v1 and v1['rows']}")
        checks.append(
            ("v0001 holds exactly the finished shards' answers", v1 is not None and v1["rows"] == done)
        )

        code, last = _run(plain, env)
        print(f"second attempt: exit {code}: {last}")
        checks.append(("the second attempt finished (exit 0)", code == 0))
    answers = _answers(run_root)
    chain = [json.loads(path.read_text()) for path in sorted(versions.glob("v*.json"))]
    own = sorted(row for version in chain for row in _own_rows(version))
    print(f"answers {len(answers)} ({len(set(answers))} distinct) of {args.prompts}; versions {len(chain)}")
    checks.append(
        ("every prompt answered and stored once", len(answers) == len(set(answers)) == args.prompts)
    )
    checks.append(("each answer in one version's own parts", own == sorted(answers)))
    checks.append(
        (
            "v0002 builds on v0001",
            len(chain) == 2 and chain[1]["base_version"] == str(versions / "v0001.json"),
        )
    )
    for what, held in checks:
        print(f"{'ok  ' if held else 'FAIL'} {what}")
    return 0 if all(held for _, held in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
