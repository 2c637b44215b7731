"""What a deployed run may choose, bounded by the box's operator (``run_choices:``).

A run started through the Prefect API picks a config by name and sets a few choices (see
:mod:`datagen.app.run_request`); this section is where the config's operator caps those choices and names the
work queues a run of the config may be sent to. Every field is a guard: it refuses a run, it never changes what a
run produces, so it is not part of the run's identity.
"""

from __future__ import annotations

from pydantic import Field

from datagen.config.base import StrictModel


class RunChoicesConfig(StrictModel):
    """Ceilings on a deployed run's choices, and where a run of this config may run."""

    work_queues: list[str] = Field(
        default_factory=list,
        description="Work queues (of the deployment's pool) a run of this config may be sent to. Empty: only the "
        "queue the deployment itself names (a caller's `work_queue_name` is refused otherwise). A multi-host "
        "run's host parts run on their `hosts[].work_queue`.",
    )
    max_samples_per_prompt: int | None = Field(
        default=None,
        gt=0,
        description="Highest `sampling.samples_per_prompt` a run may choose. Unset: the config's own "
        "`sampling.samples_per_prompt` (a run may lower it, never raise it).",
    )
    max_prompts: int | None = Field(
        default=None,
        gt=0,
        description="A run's budget: the most prompts it may plan (the sum of its datasets' quotas, or "
        "`mix.total_prompts`); a dataset without a quota counts as unbounded. A run over it is refused unless "
        "its `max_prompts` choice brings it under. Unset: no budget beyond the config's own quotas.",
    )
    max_tokens: int | None = Field(
        default=None,
        gt=0,
        description="Highest `sampling.max_tokens` a run may choose. Unset: the planned context "
        "(`model.max_model_len_tokens`, else the model's `max_position_embeddings`), else the config's own "
        "`sampling.max_tokens`.",
    )
