"""The dispatcher's own thread: one asyncio loop on a daemon thread, started once and stopped once.

Any thread may start and stop it and hand it work; every scheduling decision then runs on the loop, so the
dispatcher's state needs no lock beyond the one that guards this lifecycle (``new`` -> ``running`` ->
``closed``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from datagen.generation.http import new_event_loop

CLOSE_TIMEOUT_S = 30.0

Main = Callable[[threading.Event, asyncio.Event], Awaitable[None]]


class LoopThread:
    """An event loop on its own daemon thread.

    Args:
        owner: Named in errors (``"Dispatcher is closed: ..."``).
        thread_name: The thread's name (shown by ``py-spy`` and in logs).

    """

    def __init__(self, owner: str, thread_name: str) -> None:
        self.owner = owner
        self.thread_name = thread_name
        self.lock = threading.Lock()
        self.state = "new"
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None

    def start(self, main: Main) -> None:
        """Run ``main(started, stop)`` on a new loop; return once it set ``started``.

        ``main`` sets ``started`` when it is ready for work, then waits for ``stop`` and cleans up.

        Raises:
            RuntimeError: Already started or closed, or ``main`` did not get ready in time.

        """
        with self.lock:
            if self.state != "new":
                raise RuntimeError(f"{self.owner} cannot start: it is {self.state}")
            started = threading.Event()
            self.loop = new_event_loop()
            self._thread = threading.Thread(
                target=self._thread_main,
                args=(main, started),
                name=self.thread_name,
                daemon=True,
            )
            self._thread.start()
            if not started.wait(CLOSE_TIMEOUT_S):
                self.state = "closed"
                raise RuntimeError(f"{self.owner} loop did not start; see the log for the error")
            self.state = "running"

    def _thread_main(self, main: Main, started: threading.Event) -> None:
        assert self.loop is not None
        loop = self.loop
        asyncio.set_event_loop(loop)

        async def run() -> None:
            self._stop = asyncio.Event()
            await main(started, self._stop)

        try:
            loop.run_until_complete(run())
        finally:
            loop.close()

    def stop(self) -> bool:
        """Stop the loop and wait for its thread; False when it was not running."""
        with self.lock:
            if self.state != "running":
                self.state = "closed"
                return False
            self.state = "closed"
            assert self.loop is not None and self._stop is not None
            # Queued after every call that got the lock before us, so that work is known at shutdown.
            self.loop.call_soon_threadsafe(self._stop.set)
        assert self._thread is not None
        self._thread.join(CLOSE_TIMEOUT_S)
        return True

    @property
    def running(self) -> bool:
        """Whether the loop takes work now."""
        with self.lock:
            return self.state == "running"

    def call_soon(self, function: Callable[..., Any], *args: Any) -> None:
        """Run ``function(*args)`` on the loop.

        Raises:
            RuntimeError: The loop is not running (call start() or use the owner as a context manager).

        """
        with self.lock:
            if self.state != "running":
                raise RuntimeError(
                    f"{self.owner} is {self.state}: call start() (or use `with {self.owner}(...)`) "
                    "before submitting requests"
                )
            assert self.loop is not None
            self.loop.call_soon_threadsafe(function, *args)

    def call_now_or_soon(self, function: Callable[[], None]) -> None:
        """Run ``function`` on the loop when it runs, at once before it starts, never once it is closed."""
        with self.lock:
            if self.state == "running":
                assert self.loop is not None
                self.loop.call_soon_threadsafe(function)
                return
            if self.state == "new":
                function()
