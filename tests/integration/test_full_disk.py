"""A full local disk mid-run: no new shard starts, one line names it, and the resume redoes only what was open.

Real `datagen run` processes write their output to a small tmpfs of their own (a user and mount namespace,
`unshare -Urm`: no privileges needed; skipped where the kernel refuses them). When part of the run is
answered, the test fills that tmpfs: every write then fails with ENOSPC at the filesystem, as on a full disk.
The run stops starting shards, ends with exit 1 and one line naming ENOSPC, the path and the resume
command; once space is freed, the resume answers every request exactly once, having sent again at most
what was in flight or not yet stored in the shards running at the fault.
"""

from __future__ import annotations

import json
import os
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
PROMPTS = 200
SHARD_SIZE = 10
IN_FLIGHT = 4
RUNNING_SHARDS = 2
CHECKPOINT_EVERY = 4
FILL_AFTER = 50
# Sent again at most: the requests in flight, plus what the running shards had not stored yet (a checkpoint's
# worth each, and what arrived while its write failed).
REDONE_BOUND = IN_FLIGHT + RUNNING_SHARDS * 2 * CHECKPOINT_EVERY
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


def test_a_full_disk_stops_new_shards_says_so_once_and_the_resume_redoes_only_the_open_work(
    tmp_path: Path, tiny_model_dir: Path
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
                "checkpoint_interval_s": 0.2,
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
        env.pop("PREFECT_API_URL", None)
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

    first_err = (logs / "first.err").read_text()
    assert (logs / "first.code").read_text().strip() == "1", first_err[-3000:]
    last = first_err.strip().splitlines()[-1]
    assert "ENOSPC" in last and str(out / "runs" / "disk-1" / "parts") in last, last
    assert last.count("resume with") == 1 and f"--config {config} --run-id disk-1" in last, last
    assert (
        sum("resume with" in line or "datagen run --run-id" in line for line in first_err.splitlines()) == 1
    )
    assert "UserWarning" not in first_err, first_err[-3000:]
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
