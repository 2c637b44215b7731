"""The local demo: the whole flow on this machine, no GPU, no network, about a minute.

It builds the tiny model, starts a stand-in trainer (a real process that checkpoints when signalled), and
runs the `expand` flow with ``configs/demo.yaml``: preflight, halt the trainer, probe (no GPUs), plan two
CPU servers, generate for the bundled sample prompts of every dataset layout, merge and tokenize, report.
Outputs land under ``./runs/<run_id>/`` and ``./datasets/``. Start it with ``datagen demo`` (or
``make demo``): the console script passes in the flow.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from datagen.app.terminal import StartFlow

DEMO_CONFIG = Path("configs/demo.yaml")
DEMO_HOME = Path("runs/_demo")
MODEL_DIR = DEMO_HOME / "tiny-model"
TRAINER_PIDFILE = DEMO_HOME / "trainer.pid"
CHECKPOINT_DIR = DEMO_HOME / "checkpoints"
# The stand-in trainer writes its pidfile within a second or two (Python start-up).
TRAINER_START_TIMEOUT_S = 30.0
TRAINER_STOP_TIMEOUT_S = 10.0


def _start_standin_trainer() -> subprocess.Popen[bytes]:
    """Start the stand-in training job that the flow will halt; return its process."""
    TRAINER_PIDFILE.unlink(missing_ok=True)
    CHECKPOINT_DIR.mkdir(parents=True, exist_ok=True)
    # The child keeps its own copy of the descriptor; ours can close as soon as it is started.
    with open(DEMO_HOME / "trainer.log", "ab") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "datagen.host.standin_trainer",
                "--pidfile",
                str(TRAINER_PIDFILE),
                "--checkpoint-dir",
                str(CHECKPOINT_DIR),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + TRAINER_START_TIMEOUT_S
    while not TRAINER_PIDFILE.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"stand-in trainer did not start; see {DEMO_HOME / 'trainer.log'}")
        time.sleep(0.1)
    return process


def _stop_if_running(process: subprocess.Popen[bytes]) -> None:
    """Stop the demo's own trainer if the flow did not (e.g. the run was already complete)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(TRAINER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def run_demo(run_id: str, start_flow: StartFlow) -> int:
    """Run the demo and print where everything landed.

    Args:
        run_id: The run id; running again with the same id resumes (and regenerates nothing).
        start_flow: Imports the `expand` flow and returns a run of it (see :data:`datagen.app.terminal.StartFlow`).

    Returns:
        The process exit code.
    """
    from datagen.app.run_request import resolve_config_file
    from datagen.app.terminal import print_summary, run_in_terminal, run_log_path
    from datagen.app.tinymodel import build_tiny_model
    from datagen.config import check_run_id_option
    from datagen.errors import ConfigError
    from datagen.settings import get_settings

    try:
        check_run_id_option(run_id)
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2
    if not DEMO_CONFIG.is_file():
        print(f"run the demo from the repository root ({DEMO_CONFIG} not found)", file=sys.stderr)
        return 2
    DEMO_HOME.mkdir(parents=True, exist_ok=True)
    if not (MODEL_DIR / "config.json").is_file():
        print(f"building the tiny model in {MODEL_DIR} ...")
        build_tiny_model(MODEL_DIR)
    try:
        config = resolve_config_file(DEMO_CONFIG, run_id=run_id)
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2
    trainer = _start_standin_trainer()
    print(f"stand-in trainer running pid={trainer.pid} (the flow halts it before taking the 'GPUs')")
    try:
        code, summary = run_in_terminal(
            lambda: start_flow(config, None, False),
            run_id=run_id,
            resume_command=f"datagen demo --run-id {run_id}",
            log_path=run_log_path(get_settings().state_dir, run_id),
        )
    finally:
        _stop_if_running(trainer)
    if code != 0 or summary is None:
        return code
    from datagen.host.training import checkpoint_step

    latest = max(CHECKPOINT_DIR.glob("*.pt"), key=checkpoint_step, default=None)
    print()
    print_summary(summary)
    print(f"  trainer ckpt  {latest or 'none'}")
    print("Watch runs in the Prefect UI: `prefect server start`, then open http://127.0.0.1:4200")
    return 0
