"""A stand-in training job: a real process that "trains", checkpoints on a signal, and exits.

Used by the demo and the tests in place of a GPU trainer::

    python -m datagen.host.standin_trainer --pidfile P --checkpoint-dir D [--ignore-first-signal]

It writes its pid to ``--pidfile``, counts steps into ``<checkpoint-dir>/step.txt``, and on the stop
signal (SIGTERM unless ``--signal`` says otherwise) writes ``checkpoint-<step>.pt`` and exits 0.
``--gpu-memory-gib N`` holds N GiB on every visible GPU (as a real trainer would), so halting can be
checked to release GPU memory. ``--ignore-first-signal`` makes it stubborn: the first signal is only
acknowledged. ``--marker PATH`` writes a completion marker after the checkpoint
(``--checkpoint-delay-s`` makes the checkpoint slow). ``--events PATH`` appends one line per start and per
signal received (``start <pid>``, ``signal <name> <pid>``), so a test can count starts and stops across
restarts.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

logger = logging.getLogger("datagen.host.standin_trainer")

DEFAULT_STEP_INTERVAL_S = 0.2
STEP_FILE = "step.txt"
# Looks like a checkpoint to whoever lists the folder; the content does not matter.
CHECKPOINT_BYTES = b"datagen stand-in checkpoint\n"


class _StopRequest:
    """Signal bookkeeping shared with the handler."""

    def __init__(self, ignore_first: bool, events: Path | None = None) -> None:
        self.ignore_first = ignore_first
        self.events = events
        self.signals_seen = 0
        self.stop = False

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        self.signals_seen += 1
        record_event(self.events, f"signal {signal.Signals(signum).name} {os.getpid()}")
        if self.ignore_first and self.signals_seen == 1:
            logger.warning("received %s, ignoring the first one", signal.Signals(signum).name)
            return
        self.stop = True


def record_event(events: Path | None, line: str) -> None:
    """Append ``line`` to the events file (one short append: concurrent trainers never interleave)."""
    if events is not None:
        with events.open("a") as handle:
            handle.write(line + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pidfile", required=True, type=Path, help="Where to write this process's pid.")
    parser.add_argument("--checkpoint-dir", required=True, type=Path, help="Where checkpoints are written.")
    parser.add_argument("--ignore-first-signal", action="store_true", help="Ignore the first stop signal.")
    parser.add_argument("--step-interval-s", type=float, default=DEFAULT_STEP_INTERVAL_S)
    parser.add_argument("--signal", default="SIGTERM", help="Signal that asks for checkpoint and exit.")
    parser.add_argument("--marker", type=Path, default=None, help="File written once the checkpoint is done.")
    parser.add_argument("--checkpoint-delay-s", type=float, default=0.0, help="Time the checkpoint takes.")
    parser.add_argument(
        "--events", type=Path, default=None, help="Append a line per start and per signal received here."
    )
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=0.0,
        help="Hold this much memory on every visible GPU, like a real trainer (needs torch with CUDA).",
    )
    return parser.parse_args(argv)


def hold_gpu_memory(gib: float) -> list[object]:
    """Allocate ``gib`` GiB on every visible GPU and keep it until exit; empty when there is no GPU."""
    if gib <= 0:
        return []
    try:
        import torch
    except ImportError:
        logger.warning("torch is not installed: no GPU memory held")
        return []
    if not torch.cuda.is_available():
        logger.warning("no CUDA device: no GPU memory held")
        return []
    elements = int(gib * (1 << 30))
    held: list[object] = [
        torch.empty(elements, dtype=torch.uint8, device=f"cuda:{index}")
        for index in range(torch.cuda.device_count())
    ]
    logger.info("holding gib=%.1f on gpus=%d", gib, len(held))
    return held


def main(argv: list[str] | None = None) -> int:
    """Run the stand-in trainer until the stop signal; returns the exit code."""
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s standin-trainer %(message)s", stream=sys.stderr
    )
    stop_signal = signal.Signals[args.signal if args.signal.startswith("SIG") else f"SIG{args.signal}"]
    request = _StopRequest(ignore_first=args.ignore_first_signal, events=args.events)
    signal.signal(stop_signal, request.handle)
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    args.pidfile.parent.mkdir(parents=True, exist_ok=True)
    record_event(args.events, f"start {os.getpid()}")
    # Written after the handler is installed: once the pid is visible, a signal is handled.
    temporary = args.pidfile.with_name(args.pidfile.name + ".tmp")
    temporary.write_text(f"{os.getpid()}\n")
    temporary.replace(args.pidfile)
    held = hold_gpu_memory(args.gpu_memory_gib)
    logger.info("training pid=%d stop_signal=%s", os.getpid(), stop_signal.name)
    step = 0
    while not request.stop:
        step += 1
        (args.checkpoint_dir / STEP_FILE).write_text(f"{step}\n")
        time.sleep(args.step_interval_s)
    checkpoint = args.checkpoint_dir / f"checkpoint-{step}.pt"
    time.sleep(args.checkpoint_delay_s)
    checkpoint.write_bytes(CHECKPOINT_BYTES)
    if args.marker is not None:
        args.marker.write_text(f"{checkpoint}\n")
    held.clear()
    logger.info("checkpoint written path=%s; exiting", checkpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
