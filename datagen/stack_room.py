"""Room on CPython's frame stack, so that calls stop mapping and unmapping memory.

Since CPython 3.11 each thread keeps its Python frames on a data stack made of chunks: 16 KiB, mapped with
``mmap`` when a call does not fit in the current chunk, unmapped again as soon as the frame that opened the
chunk returns. A loop whose calls go back and forth over a chunk boundary (an event loop serving requests,
a test polling a run, a pydantic schema build while importing) maps and unmaps a chunk on every such call.
On the 2-core test box that was 8-22 microseconds of kernel time each: importing Prefect's server did it
12,193 times, one signal test's pytest process 49,703 times, a `datagen run` 7,715 times, the temporary
API server that run reported to 21,890 times (strace, every call deterministic).

:func:`call_with_stack_room` calls a function from a frame that reserves half a megabyte of stack slots:
CPython gives that frame a 1 MiB chunk of its own, and every frame called from it (the whole program, when
it wraps ``main``) fits in the rest of that chunk, which is never unmapped while the call lasts. The slots
are only reserved: pages nobody writes are never backed by memory. Other threads keep their own stacks.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

# Stack slots (8 bytes each) the calling frame reserves: 512 KiB. Frames called from it have the rest of its
# 1 MiB chunk, a few thousand frames deep, past Python's default recursion limit of 1,000 frames.
RESERVED_STACK_SLOTS = 1 << 16


def _call(target: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    return target(*args, **kwargs)


# The same function with a larger stack declared: its frame's size is what decides the size of the chunk.
_call_from_own_chunk: Callable[..., object] = types.FunctionType(
    _call.__code__.replace(co_stacksize=RESERVED_STACK_SLOTS), {}, "call_with_stack_room"
)


def call_with_stack_room(target: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Call ``target(*args, **kwargs)`` with room on this thread's frame stack for everything it calls.

    Args:
        target: What to call (a command's ``main``, a worker's loop).
        *args: Its positional arguments.
        **kwargs: Its keyword arguments.

    Returns:
        What ``target`` returns; what it raises propagates unchanged.
    """
    return _call_from_own_chunk(target, *args, **kwargs)  # type: ignore[return-value]
