"""The generation stage's config (``generation:``): request timeouts, retries, checkpoints, exact tokens."""

from __future__ import annotations

from pydantic import Field

from datagen.config.base import StrictModel


class GenerationConfig(StrictModel):
    """Request-level behaviour of the dispatcher."""

    request_timeout_s: float = Field(default=1800.0, gt=0)
    max_attempts: int = Field(default=5, gt=0, description="Tries per request before a failure is recorded.")
    max_internal_error_attempts: int = Field(
        default=3,
        gt=0,
        description="A request whose tries ended in HTTP 500 or a connection reset this many times, on at "
        "least two servers, fails for good (each try redoes a whole generation); 502-504 keep the full "
        "max_attempts.",
    )
    max_failed_share: float = Field(
        default=0.01,
        ge=0,
        le=1,
        description="Share of a run's requests that may end as failures before the run ends Failed (exit 1) "
        "without publishing a dataset version (everything stays stored; resume or retry the failures). A healthy "
        "fleet fails about 1 in 13,000 (the seed run: 15 of 193,010, 0.008%); 1% is over a hundred times that, "
        "so only a broken fleet, model or server setup crosses it. A dataset whose every request failed ends "
        "the run Failed whatever this share. Turns an on-policy conversation never sent because it ended "
        "earlier (an answer cut at max_tokens, other tool calls than the dataset's) are not counted.",
    )
    backoff_initial_s: float = Field(default=0.5, ge=0)
    backoff_max_s: float = Field(default=30.0, ge=0)
    # A crash loses only what is in flight or not yet flushed: flush small parts often (a PUT a second is
    # nothing next to minutes of GPU time per request).
    checkpoint_every: int = Field(
        default=32, gt=0, description="Results per write-once part object inside a shard (flushed at once)."
    )
    checkpoint_interval_s: float = Field(
        default=2.0, gt=0, description="A finished result waits at most this long before it is stored."
    )
    max_concurrent_shards: int | None = Field(
        default=None,
        gt=0,
        description="Shard tasks running at once; enough to keep every slot busy if unset.",
    )
    stall_min_s: float = Field(
        default=300.0,
        gt=0,
        description="A server holding requests that answers none for the larger of this and 3x the slowest "
        "completion seen is stalled: marked down (whatever its /health says) and its requests sent elsewhere.",
    )
    no_live_server_timeout_s: float = Field(
        default=300.0, gt=0, description="How long requests wait for a server to come back before failing."
    )
    exact_tokens: bool | None = Field(
        default=None,
        description="Exact-token mode: render prompts with the target's chat template here, send token ids to "
        "SGLang's /generate and train on the returned output_ids verbatim (no re-tokenization). Unset: on for "
        "engines that serve /generate (sglang), off otherwise; true is refused for an engine without it "
        "(transformers). See docs/engines.md.",
    )
