"""The flow's task runner: Prefect's thread pool, except that an interrupted flow does not wait for its threads.

Prefect's :class:`~prefect.task_runners.ThreadPoolTaskRunner` shuts its pool down with ``wait=True`` when the
flow ends, whatever ended it. After SIGINT or SIGTERM that means waiting for every task thread still blocked
in I/O (a dataset read or a prompt shard write to a slow S3 answers only after minutes of retries), so the
run would not stop within seconds. Here the pool is shut down without waiting when the flow ends on an
interrupt (anything that is not an ``Exception``: ``KeyboardInterrupt``, Prefect's ``TerminationSignal``,
``SystemExit``); queued tasks are cancelled either way. Whatever such a thread would still write is
write-once and checked again by the resume.
"""

from __future__ import annotations

from typing import Any

from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner


class InterruptibleThreadPoolTaskRunner(ThreadPoolTaskRunner):  # type: ignore[type-arg]
    """A :class:`ThreadPoolTaskRunner` that does not wait for busy threads when the flow is interrupted."""

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        if exc_type is None or issubclass(exc_type, Exception):
            super().__exit__(exc_type, exc_value, traceback)
            return
        for event in self._cancel_events.values():
            event.set()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        TaskRunner.__exit__(self, exc_type, exc_value, traceback)
