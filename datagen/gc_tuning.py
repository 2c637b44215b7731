"""Garbage-collector settings of datagen's own processes: the CLI, flow runs, the temporary API server, CPU servers.

Each of these processes first imports a large heap that lives as long as the process (Prefect and its pydantic
schemas, torch and transformers: a million objects and more). With CPython's default thresholds (700, 10, 10)
the cyclic collector runs every 700 allocations while it does, and each pass of the older generations walks
that heap again; at exit one or two full passes walk it once more, for objects the exit frees anyway. On a
2-core box that was a fifth to a third of the CPU of a `datagen run` (the nine signal runs of
test_run_states: 23.4-24.4 CPU-s of CLI processes with the defaults, 15.4-19.4 with these settings, in
alternating runs) and about a sixth of a ``transformers serve`` start (4.38 -> 3.62 CPU-s, medians of five).

The young generation is collected every 50,000 allocations instead (a few megabytes of cyclic garbage at most
waits that long; everything else is still freed at once by reference counting), and the heap is frozen at
exit: CPython never promised finalizers for objects still alive at exit, and datagen closes what it writes
itself.

``python -m datagen.gc_tuning MODULE [ARG...]`` runs another module's command line (``uvicorn``,
``transformers.cli.transformers``) as ``__main__`` under the same settings, exactly as
``python -m MODULE [ARG...]`` would, and with room on its main thread's frame stack
(:mod:`datagen.stack_room`).
"""

from __future__ import annotations

import atexit
import gc
import runpy
import sys

from datagen.stack_room import call_with_stack_room

# Allocations between collections of the young generation (CPython's default: 700).
YOUNG_COLLECTION_EVERY = 50_000
# Young collections per middle one, middle collections per old (full) one (defaults: 10 and 10).
MIDDLE_COLLECTION_EVERY = 20
OLD_COLLECTION_EVERY = 100
USAGE = "usage: python -m datagen.gc_tuning MODULE [ARG...]"

_tuned = False


def tune_garbage_collector() -> None:
    """Collect less often and skip the collections at exit, for the rest of this process (idempotent)."""
    global _tuned
    if _tuned:
        return
    _tuned = True
    gc.set_threshold(YOUNG_COLLECTION_EVERY, MIDDLE_COLLECTION_EVERY, OLD_COLLECTION_EVERY)
    # Registered early, so it runs after the handlers registered later (atexit runs them last-in, first-out):
    # logging's and Prefect's flushes still see a normal interpreter.
    atexit.register(gc.freeze)


def tuned_module_argv(module: str) -> list[str]:
    """The start of the command line running ``module`` as ``python -m module`` would, collector tuned."""
    return [sys.executable, "-m", "datagen.gc_tuning", module]


def run_module(argv: list[str]) -> None:
    """Run ``argv[0]`` (a module) as ``__main__`` with ``argv[1:]`` as its arguments, collector tuned.

    Args:
        argv: The module's name, then its arguments.

    Raises:
        SystemExit: 2 with the usage line when no module is named; else whatever the module exits with.
    """
    if not argv or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    tune_garbage_collector()
    # As under `python -m MODULE`: runpy puts the module's file in argv[0], the arguments follow.
    sys.argv = list(argv)
    # With room on the frame stack (datagen.stack_room): a server's event loop calls back and forth all the time.
    call_with_stack_room(runpy.run_module, argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    run_module(sys.argv[1:])
