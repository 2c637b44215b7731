"""Prefect's API is not on the generation path: with the API frozen 60 s mid-generation, answers keep coming.

The issue's figure: the Prefect API down for :data:`OUTAGE_S` (60 s) mid-generation, throughput within 20% of a
run without the outage. A real `datagen run` (with its own temporary Prefect API server) sends to a
fault-injecting OpenAI-compatible server whose fixed answer time caps the rate (:data:`IN_FLIGHT` answers per
:data:`ANSWER_S`), so a run's rate is steady: the run's own rate in the :data:`BASELINE_S` before the outage is
the rate without it (one run, not two). The API server is then frozen (SIGSTOP: every API call hangs, worse than
a refused connection) for 60 s and thawed. The answer rate during the outage stays within 20% of the rate
before it (the old scheduler updated the progress artifact itself and started no shard while Prefect's client
waited: 703 answers in such a minute instead of ~5,700), generation outlasts the outage (so the whole minute is
measured), and the run still ends Completed, every request answered exactly once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.fault_server import FaultPlan, FaultServer
from tests.support.prefect_db import seed_prefect_home
from tests.support.run_configs import external_run_config, write_prompts

REPO = Path(__file__).resolve().parents[2]
SHARD_SIZE = 10
IN_FLIGHT = 4
ANSWER_S = 0.1
RUNNING_SHARDS = 3
# Answers before the baseline starts: generation under way at its steady rate.
WARMUP_ANSWERS = 50
BASELINE_S = 10.0
OUTAGE_S = 60.0
# Enough prompts that generation at the capped rate outlasts the baseline and the outage (by ~10 s).
PROMPTS = WARMUP_ANSWERS + int(IN_FLIGHT / ANSWER_S * (BASELINE_S + OUTAGE_S + 10.0))
RUN_TIMEOUT_S = 400
API_SERVER_ARGV = b"prefect.server.api.server:create_app"


def _api_server(parent: int) -> int | None:
    """The temporary API server the `datagen run` process ``parent`` started (its child)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            status = (proc / "status").read_text()
            argv = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if f"\nPPid:\t{parent}\n" in status and API_SERVER_ARGV in argv:
            return int(proc.name)
    return None


def _answered_between(server: FaultServer, start: float, end: float) -> int:
    return sum(start <= request.arrived_at < end for request in server.chat_requests())


def test_generation_goes_on_at_full_speed_while_the_prefect_api_is_frozen(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS, "Outage question")
    with FaultServer(FaultPlan(base_delay_s=ANSWER_S)) as server:
        config = external_run_config(
            tmp_path / "run.yaml",
            server_url=server.url,
            model_dir=tiny_model_dir,
            prompts=prompts,
            dataset="outage",
            shard_size=SHARD_SIZE,
            in_flight=IN_FLIGHT,
            output=str(tmp_path / "out"),
            protected=str(tmp_path / "train"),
            # Few shards at once: new ones must keep starting for the fleet to stay busy.
            generation={
                "checkpoint_interval_s": 0.5,
                "backoff_initial_s": 0.05,
                "max_concurrent_shards": RUNNING_SHARDS,
            },
        )
        env = {
            **os.environ,
            "DATAGEN_STATE_DIR": str(tmp_path / "state"),
            "PREFECT_HOME": str(seed_prefect_home(tmp_path / "prefect-home")),
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        env.pop("PREFECT_API_URL", None)
        run = subprocess.Popen(
            [sys.executable, "-m", "flows.cli_entry", "run", "--config", str(config), "--run-id", "outage-1"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "run.err", "w"),  # noqa: SIM115 - closed with the process
            start_new_session=True,
        )
        api: int | None = None
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while len(server.chat_requests()) < WARMUP_ANSWERS:
                assert run.poll() is None and time.monotonic() < deadline, (tmp_path / "run.err").read_text()
                time.sleep(0.05)
            time.sleep(BASELINE_S)
            api = _api_server(run.pid)
            assert api is not None, "the run's temporary API server was not found"
            frozen = time.monotonic()
            os.kill(api, signal.SIGSTOP)
            time.sleep(OUTAGE_S)
            os.kill(api, signal.SIGCONT)
            thawed = time.monotonic()
            code = run.wait(RUN_TIMEOUT_S)
        finally:
            if api is not None:
                with contextlib.suppress(ProcessLookupError):  # ended with the run
                    os.kill(api, signal.SIGCONT)
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
        baseline = _answered_between(server, frozen - BASELINE_S, frozen) / BASELINE_S
        during = _answered_between(server, frozen, thawed) / (thawed - frozen)
        after = _answered_between(server, thawed, float("inf"))
        keys = [request.body["messages"][-1]["content"] for request in server.chat_requests() if request.body]
    err = (tmp_path / "run.err").read_text()
    assert code == 0, err[-3000:]
    assert after > 0, "generation ended before the API came back: the outage was not measured whole"
    assert during >= 0.8 * baseline, f"{during:.1f} answers/s while the API was away, {baseline:.1f} before"
    assert len(keys) == len(set(keys)) == PROMPTS, "every request exactly once"
