"""What every task shares: the transient-only retry rule, cache keys, artifact helpers."""

from __future__ import annotations

import hashlib
from typing import Any

from prefect import Task
from prefect.client.schemas.objects import State, TaskRun

import datagen.errors

# Retry schedule for transient errors (storage hiccups, a server restarting): seconds before each retry.
TRANSIENT_RETRY_DELAYS_S: list[float] = [2.0, 10.0, 30.0]


def retry_only_transient(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Prefect retry condition: retry when the failure is transient, never on a fatal error."""
    try:
        state.result(raise_on_failure=True)
    except BaseException as error:  # the state's exception, re-raised to be classified
        return datagen.errors.is_transient(error)
    return False


def stage_cache_key(stage: str, *parts: object) -> str:
    """A cache key over the stage name and its identifying inputs (run id, incarnation, config hash...)."""
    text = "|".join([stage, *(str(part) for part in parts)])
    return f"{stage}-{hashlib.sha256(text.encode()).hexdigest()[:24]}"


# The retry policy of every task whose work is idempotent: transient errors only, on the schedule above.
TRANSIENT_RETRIES: dict[str, Any] = {
    "retries": len(TRANSIENT_RETRY_DELAYS_S),
    "retry_delay_seconds": TRANSIENT_RETRY_DELAYS_S,
    "retry_condition_fn": retry_only_transient,
}
