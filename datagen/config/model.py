"""The target model: served by the fleet, its chat template renders the training data (``model:``)."""

from __future__ import annotations

from pydantic import Field

from datagen.config.base import StrictModel


class ModelConfig(StrictModel):
    """The target model served by the fleet and whose chat template renders the training data."""

    path: str = Field(description="Local directory or hub id of the target model, as the engine loads it.")
    tokenizer_path: str | None = Field(
        default=None, description="Tokenizer to render and tokenize with; defaults to `path`."
    )
    served_name: str | None = Field(
        default=None, description="Model name sent in API requests; defaults to what the engine reports."
    )
    max_model_len_tokens: int | None = Field(
        default=None, gt=0, description="Context length for the servers; the engine default when unset."
    )

    @property
    def tokenizer(self) -> str:
        """The tokenizer location (``tokenizer_path`` or ``path``)."""
        return self.tokenizer_path or self.path
