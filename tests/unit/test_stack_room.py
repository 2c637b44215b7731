"""datagen.stack_room: calls from its frame stop mapping a frame-stack chunk per call at a chunk boundary."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from datagen.stack_room import call_with_stack_room

# A child process that calls a function 300 times at each depth from 1 to 400 frames, and prints the most
# minor page faults one depth cost: at a depth where that call opens a new 16 KiB chunk, each call maps a
# fresh chunk and touches it (a page fault) unless the caller runs with room.
OSCILLATE = """
import json, resource, sys
from datagen.stack_room import call_with_stack_room

def leaf(z=0):  # a frame larger than at_depth's (64 values on its stack): it crosses each boundary
    return (
        z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z,
        z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z,
        z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z,
        z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z,
    )

def at_depth(depth):
    if depth:
        return at_depth(depth - 1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(300):
        leaf()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

def sweep():
    return max(at_depth(depth) for depth in range(1, 400))

print(json.dumps(call_with_stack_room(sweep) if sys.argv[1] == "room" else sweep()))
"""


def _worst_depth_faults(mode: str) -> int:
    run = subprocess.run(
        [sys.executable, "-c", OSCILLATE, mode], capture_output=True, text=True, timeout=60, check=True
    )
    return int(json.loads(run.stdout))


def test_calls_at_a_chunk_boundary_map_memory_without_room_and_not_with_it() -> None:
    plain = _worst_depth_faults("plain")
    room = _worst_depth_faults("room")

    assert plain >= 300, f"the sweep must hit a chunk boundary (one fault per call there), got {plain}"
    assert room < 30, f"with room no call maps a chunk, got {room} faults at the worst depth"


def test_it_passes_arguments_and_returns_or_raises_what_the_target_does() -> None:
    assert call_with_stack_room(divmod, 17, 5) == (3, 2)
    assert call_with_stack_room(dict, a=1) == {"a": 1}
    with pytest.raises(ZeroDivisionError):
        call_with_stack_room(divmod, 1, 0)


def test_deep_recursion_still_reaches_the_recursion_limit_inside_it() -> None:
    def depth(level: int) -> int:
        return depth(level + 1) if level < 900 else level

    assert call_with_stack_room(depth, 0) == 900
    with pytest.raises(RecursionError):
        call_with_stack_room(lambda: depth(-(10**6)))
