"""A full local disk mid-run: nothing more is sent, one line names it, and the resume redoes only what was open.

Real `datagen run` processes write their output to a small tmpfs of their own (a user and mount namespace,
`unshare -Urm`: no privileges needed; skipped where the kernel refuses them). When part of the run is
answered, the test fills that tmpfs: every write then fails with ENOSPC at the filesystem, as on a full disk.
From the first failed write on, no request is sent (only those already in flight still reach the server), the
run ends with exit 1 and one line naming ENOSPC, the path and the resume command; once space is freed, the
resume answers every request exactly once, having sent again at most what was in flight or not yet stored in
the shards running at the fault.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.fault_server import FaultPlan, FaultServer
from tests.support.prefect_db import seed_prefect_home
from tests.support.run_configs import external_run_config, write_prompts

REPO = Path(__file__).resolve().parents[2]
PROMPTS = 240
SHARD_SIZE = 20
IN_FLIGHT = 4
# Several shards each a checkpoint apart: a shard that went on after another one's write failed would be seen.
RUNNING_SHARDS = 4
CHECKPOINT_EVERY = 8
FILL_AFTER = 60
# Sent again at most: the requests in flight, plus what the running shards had answered but not stored yet (at
# most a checkpoint's worth each): nothing is sent after the first failed write.
REDONE_BOUND = IN_FLIGHT + RUNNING_SHARDS * CHECKPOINT_EVERY
# The first line of the first run that names the fault, and its time (the console's local HH:MM:SS.mmm).
FAULT_LINE = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) \|.*retrying cannot fix it", re.MULTILINE)
RUN_TIMEOUT_S = 240
# The namespace's shell: mount the tmpfs, run datagen, fill the disk when asked, free it, resume.
SCRIPT = """
set -u
mount -t tmpfs -o size=16m tmpfs "$OUT_DIR"
"$PYTHON" -m flows.cli_entry run --config "$CONFIG" --run-id disk-1 >"$LOGS/first.out" 2>"$LOGS/first.err" &
run=$!
while [ ! -e "$LOGS/fill" ] && kill -0 $run 2>/dev/null; do sleep 0.02; done
dd if=/dev/zero of="$OUT_DIR/filler" bs=64k 2>/dev/null
touch "$LOGS/filled"
wait $run
echo $? >"$LOGS/first.code"
rm -f "$OUT_DIR/filler"
"$PYTHON" -m flows.cli_entry run --config "$CONFIG" --run-id disk-1 >"$LOGS/second.out" 2>"$LOGS/second.err"
echo $? >"$LOGS/second.code"
find "$OUT_DIR/runs/disk-1/completions" "$OUT_DIR/runs/disk-1/failures" -name '*.jsonl' -exec cat {} + \
  >"$LOGS/results.jsonl"
"""


def _namespaces_allowed() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


def _wall_time_of_first_fault(log: str, day_of: float) -> float:
    """The wall-clock time of the first log line naming the storage fault (the log's day is ``day_of``'s)."""
    match = FAULT_LINE.search(log)
    assert match, log[-3000:]
    day = dt.datetime.fromtimestamp(day_of).date()
    logged = dt.datetime.combine(day, dt.time.fromisoformat(match[1])).timestamp()
    return logged - 86400 if logged > day_of + 60 else logged  # a run across midnight


def test_a_full_disk_stops_new_shards_says_so_once_and_the_resume_redoes_only_the_open_work(
    tmp_path: Path, tiny_model_dir: Path, prefect_api: str
) -> None:
    if not _namespaces_allowed():
        pytest.skip("unprivileged user and mount namespaces are not allowed here (unshare -Urm)")
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS, "Disk question")
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    logs.mkdir()
    with FaultServer(FaultPlan(base_delay_s=0.1)) as server:
        config = external_run_config(
            tmp_path / "run.yaml",
            server_url=server.url,
            model_dir=tiny_model_dir,
            prompts=prompts,
            dataset="disk",
            shard_size=SHARD_SIZE,
            in_flight=IN_FLIGHT,
            output=str(out),
            protected=str(tmp_path / "train"),
            generation={
                "checkpoint_every": CHECKPOINT_EVERY,
                "checkpoint_interval_s": 2.0,
                "backoff_initial_s": 0.05,
                "max_concurrent_shards": RUNNING_SHARDS,
            },
        )
        env = {
            **os.environ,
            "OUT_DIR": str(out),
            "LOGS": str(logs),
            "CONFIG": str(config),
            "PYTHON": sys.executable,
            "DATAGEN_STATE_DIR": str(tmp_path / "state"),
            "PREFECT_HOME": str(seed_prefect_home(tmp_path / "prefect-home")),
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        env["PREFECT_API_URL"] = prefect_api
        shell = subprocess.Popen(["unshare", "-Urm", "sh", "-c", SCRIPT], env=env, cwd=REPO)
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while len(server.chat_requests()) < FILL_AFTER:
                assert shell.poll() is None and time.monotonic() < deadline, (logs / "first.err").read_text()[
                    -3000:
                ]
                time.sleep(0.02)
            (logs / "fill").touch()
            while not (logs / "filled").exists():
                assert time.monotonic() < deadline
                time.sleep(0.01)
            sent_at_fault = len(server.chat_requests())
            shell.wait(RUN_TIMEOUT_S)
        finally:
            if shell.poll() is None:
                shell.kill()
                shell.wait()
        total_sent = len(server.chat_requests())
        # The server's clock (monotonic) as wall-clock time, to compare with the run's log.
        to_wall = time.time() - time.monotonic()
        arrivals = [seen.arrived_at + to_wall for seen in server.chat_requests()]

    first_err = (logs / "first.err").read_text()
    assert (logs / "first.code").read_text().strip() == "1", first_err[-3000:]
    last = first_err.strip().splitlines()[-1]
    assert "ENOSPC" in last and str(out / "runs" / "disk-1" / "parts") in last, last
    assert last.count("resume with") == 1 and f"--config {config} --run-id disk-1" in last, last
    assert (
        sum("resume with" in line or "datagen run --run-id" in line for line in first_err.splitlines()) == 1
    )
    assert "UserWarning" not in first_err, first_err[-3000:]
    # From the first failed write on, admission is stopped: only requests already in flight still arrive.
    first_ended = (logs / "first.code").stat().st_mtime
    fault_at = _wall_time_of_first_fault(first_err, first_ended)
    after_fault = sum(fault_at < arrived <= first_ended for arrived in arrivals)
    assert after_fault <= IN_FLIGHT, (
        f"{after_fault} requests reached the server after the fault (in flight: {IN_FLIGHT})"
    )
    assert (logs / "second.code").read_text().strip() == "0", (logs / "second.err").read_text()[-3000:]
    keys = [
        f"{row['prompt_id']}/{row['sample_index']}"
        for row in map(json.loads, (logs / "results.jsonl").read_text().splitlines())
    ]
    assert len(keys) == len(set(keys)) == PROMPTS, "every request exactly once"
    redone = total_sent - PROMPTS
    assert redone <= REDONE_BOUND, (
        f"{redone} answers generated again (at most {REDONE_BOUND} were open at the fault; "
        f"{sent_at_fault} sent when the disk filled)"
    )
