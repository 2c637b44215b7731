"""Handing the GPUs back to training as soon as the fleet is down, exactly once per halt.

After the training job is halted the flow records it here (``<state_dir>/training-halted.json``, on the
host). Whoever stops the fleet first (the flow's ``finally`` after success or failure, or the
cancellation/crash hook that runs in the worker process) calls :func:`hand_back_gpus`: it claims the
record by renaming it (atomic, so a restart happens once) and restarts training when
``training.restart_after_run`` is on. No record means preflight refused to halt, or nothing was halted:
nothing is restarted.
"""

from __future__ import annotations

import logging
from pathlib import Path

from datagen.config import TrainingJobConfig
from datagen.host.training import RestartRecord, restart_training

logger = logging.getLogger(__name__)

HALT_RECORD = "training-halted.json"
CLAIMED_SUFFIX = ".handed-back"
RESTART_LOG = "training-restart.log"


def record_halt(state_dir: Path, training: TrainingJobConfig) -> Path:
    """Remember (on this host) that training was halted and how to restart it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / HALT_RECORD
    path.write_text(training.model_dump_json())
    return path


def hand_back_gpus(state_dir: Path) -> RestartRecord | None:
    """Restart training if this run halted it and ``restart_after_run`` is on; at most once per halt.

    Args:
        state_dir: The run's host-local folder (where :func:`record_halt` wrote).

    Returns:
        The restart record; None when nothing was halted, someone else handed back first, or restarting
        is off.

    Raises:
        TrainingHaltError: The restart command could not be started.
    """
    record = state_dir / HALT_RECORD
    claimed = record.with_name(record.name + CLAIMED_SUFFIX)
    try:
        record.rename(claimed)
    except FileNotFoundError:
        return None
    training = TrainingJobConfig.model_validate_json(claimed.read_text())
    restarted = restart_training(training, state_dir / RESTART_LOG)
    if restarted is None:
        logger.info("training restart is off (training.restart_after_run): the GPUs stay idle")
    else:
        logger.info("training restarted pid=%d argv=%s", restarted.pid, restarted.argv)
    return restarted
