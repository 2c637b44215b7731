"""The retry policy of generation requests, in one place: what a retry can cure, how often, how long to wait.

- Which answers are transient: connection errors, resets, timeouts, an empty or unusable body, and the HTTP
  statuses of :func:`datagen.errors.is_transient_http_status` (the rule S3 shares); other 4xx answers are
  final (:mod:`datagen.generation.dispatch_attempt` classifies each try with it).
- How many tries: ``GenerationConfig.max_attempts``; a request whose tries ended in HTTP 500 (an internal
  error, unlike 502-504) or a connection reset (the server died under it) ``max_internal_error_attempts``
  times, on at least two servers, fails early: every try redoes the whole generation for an answer the
  servers cannot give, and a request that crashes every server it reaches takes their other requests down too.
- How long to wait: exponential backoff from ``backoff_initial_s`` up to ``backoff_max_s``, with jitter;
  a try the dispatcher itself cut short (its server went away) is retried at once, and when the server was
  removed on purpose (a host leaving the run) the try is not counted.
"""

from __future__ import annotations

import random
from typing import NamedTuple

from datagen.config import GenerationConfig
from datagen.errors import HTTP_SERVER_ERROR
from datagen.generation.dispatch_state import Job, Transient
from datagen.generation.failures import FailureKind, error_type

# Backoff delays are drawn from [JITTER_FLOOR * delay, delay] so retries of a burst spread out.
JITTER_FLOOR = 0.5
HTTP_INTERNAL_ERROR = HTTP_SERVER_ERROR


class Retry(NamedTuple):
    """Try the request again after ``delay_s`` (on another server where there is one)."""

    delay_s: float


class GiveUp(NamedTuple):
    """The request fails with ``reason``, of ``kind``."""

    reason: str
    kind: FailureKind

    @property
    def error_type(self) -> str:
        """The failure's stored ``error_type``."""
        return error_type(self.kind)


class RetryPolicy:
    """Decide what happens to a request after a transient failure (see the module docstring).

    Args:
        generation: ``max_attempts``, ``max_internal_error_attempts`` and the backoff bounds.

    """

    def __init__(self, generation: GenerationConfig) -> None:
        self.generation = generation

    def after(self, job: Job, outcome: Transient, server_url: str, fleet_size: int) -> Retry | GiveUp:
        """The next step for ``job`` after ``outcome`` on ``server_url`` (``job.attempts`` counts that try).

        Args:
            job: The request; its HTTP 500 answers are recorded on it.
            outcome: The transient failure of its last try.
            server_url: The server of that try.
            fleet_size: Servers the dispatcher knows (a single server cannot be told apart from the request).

        Returns:
            A retry with its delay, or the failure to record.

        """
        generation = self.generation
        if outcome.status == HTTP_INTERNAL_ERROR or outcome.reset:
            job.internal_error_servers.append(server_url)
            repeated = len(job.internal_error_servers) >= generation.max_internal_error_attempts
            distinct = len(set(job.internal_error_servers))
            cut_short = job.attempts < generation.max_attempts
            if repeated and cut_short and distinct >= min(2, fleet_size):
                return GiveUp(
                    f"HTTP 500 or a connection reset from {distinct} server(s) on each of "
                    f"{len(job.internal_error_servers)} attempts; last error: {outcome.reason}",
                    FailureKind.REPEATED_INTERNAL_ERROR,
                )
        if job.attempts >= generation.max_attempts:
            return GiveUp(
                f"retries exhausted after {job.attempts} attempts; last error: {outcome.reason}",
                FailureKind.RETRIES_EXHAUSTED,
            )
        return Retry(0.0 if outcome.interrupted else self.backoff_s(job.attempts))

    def backoff_s(self, attempts: int) -> float:
        """The delay before the try after ``attempts`` tries: exponential, capped, with jitter."""
        ceiling = min(self.generation.backoff_max_s, self.generation.backoff_initial_s * 2 ** (attempts - 1))
        return random.uniform(JITTER_FLOOR * ceiling, ceiling)

    @staticmethod
    def interrupted(job: Job) -> Transient:
        """The outcome of a try the dispatcher cut short (``job.interrupted`` says why); a refund un-counts it."""
        outcome = Transient(reason=job.interrupted or "interrupted", interrupted=True)
        if job.refund:
            job.attempts -= 1
        job.interrupted = None
        job.refund = False
        return outcome
