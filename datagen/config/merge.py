"""The merge-and-tokenize stage's config (``tokenize:``): how completions become versioned training rows."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from datagen.config.base import Slug, StrictModel


class TokenizeConfig(StrictModel):
    """How completions become training rows."""

    max_length_tokens: int | None = Field(default=None, gt=0, description="Drop longer rendered rows.")
    rows_per_part: int = Field(default=10_000, gt=0, description="Rows per Parquet part object.")
    row_group_rows: int = Field(
        default=1_000,
        gt=0,
        description="Rows per Parquet row group: ~1M tokens, a few MB, what a training reader streams at once.",
    )
    workers: int | None = Field(
        default=None,
        gt=0,
        description="Tokenizer processes; when unset, one per core this process may use, or none besides it "
        "for less than 16 MiB of completions (a worker's start-up would cost more than it saves).",
    )
    answer_render: Literal["auto", "full"] = Field(
        default="auto",
        description="auto: render each answer alone after a fixed context when the chat template passes the "
        "append probe (one prompt render per prompt); full: render every prompt+answer conversation.",
    )
    conversation_rows: Literal["per_turn", "per_conversation"] = Field(
        default="per_turn",
        description="Rows of on-policy conversations (`multi_turn: on_policy`): `per_turn`, one row per turn the "
        "target answered, loss on that answer (each answer's exact tokens, reasoning included); "
        "`per_conversation`, one row per conversation (its last kept turn, rendered whole), loss on every "
        "assistant turn the target wrote as the template renders it (the history held once: far fewer tokens, "
        "but Qwen3 templates drop earlier turns' reasoning). Other datasets' rows are the same either way "
        "(docs/tokenize.md).",
    )
    include_truncated: bool = Field(default=False, description="Keep completions that hit max_tokens.")
    dataset_name: Slug = Field(default="drafter-expansion", description="Name of the versioned dataset.")
    base_version: str | None = Field(
        default=None, description="URL of an existing dataset version manifest to extend (never rewritten)."
    )
    formats: list[Literal["parquet", "jsonl"]] = Field(
        default=["parquet"],
        description="What the dataset version is written as: `parquet` (always) and, with `jsonl`, one JSONL of "
        "input_ids/loss_mask rows of the whole version that SpecForge and speculators read as-is "
        "(docs/tokenize.md).",
    )

    @field_validator("formats")
    @classmethod
    def _parquet_always(cls, formats: list[str]) -> list[str]:
        if "parquet" not in formats:
            raise ValueError(
                "the Parquet parts are the dataset version: keep `parquet` and add `jsonl` beside it"
            )
        return sorted(set(formats), key=["parquet", "jsonl"].index)
