"""The prompt stage's config: datasets, their sampling overrides, the target mix, the existing corpus."""

from __future__ import annotations

import hashlib
from typing import Annotated, Final, Literal

from pydantic import Field, model_validator

from datagen.config.base import Share, Slug, StrictModel
from datagen.config.ui_json import UI_MAPPING, UNWRAP_UI_JSON
from datagen.records import SamplingParams

DatasetFormat = Literal[
    "infinity_instruct",
    "webinstruct",
    "codefeedback_filtered",
    "code_feedback",
    "metamath",
    "hermes_fc",
    "agentinstruct",
    "toucan",
    "sharegpt",
    "openai_messages",
]
MultiTurnPolicy = Literal["last_turn", "every_turn", "on_policy"]
# The mix category of a dataset without one.
UNCATEGORISED: Final = "uncategorised"
# Shares of a mix may add up to 1 with floating-point error.
SHARE_SUM_TOLERANCE: Final = 1e-9
# Settings one dataset's sampling mix may hold: a handful is what a mix is for (temperature and thinking cycles).
MAX_SAMPLING_SETTINGS: Final = 16
# A prompt's draw in [0, 1) comes from these many bytes of its id's SHA-256: fine enough for any weights.
DRAW_BYTES: Final = 8
# Prompts per generation shard when a dataset sets no `shard_size`. Each shard is one Prefect task run, whose
# states, events and logs cost the flow process ~20-30 ms: at 256 prompts a shard, a fleet answering thousands of
# requests a second made that work the flow's bottleneck (docs/performance.md, "Prompts per shard").
DEFAULT_SHARD_SIZE: Final = 1024
MAX_SHARD_SIZE: Final = 100_000
# The default before DEFAULT_SHARD_SIZE: what an unset `shard_size` meant, and what config hashes recorded for it.
LEGACY_SHARD_SIZE: Final = 256


class SamplingOverrides(StrictModel):
    """Per-dataset sampling changes; unset fields keep the run's defaults."""

    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, gt=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    max_tokens: int | None = Field(default=None, gt=0)
    enable_thinking: bool | None = None
    samples_per_prompt: int | None = Field(default=None, gt=0, le=64)
    seed: int | None = None

    def apply(self, base: SamplingParams) -> SamplingParams:
        """Return ``base`` with every field set here replaced."""
        changes = self.model_dump(exclude_none=True)
        return base.model_copy(update=changes)


class SamplingSetting(StrictModel):
    """One setting of a dataset's sampling mix: a name, a weight, and the sampling it changes.

    Applied over the dataset's resolved sampling (run defaults + ``datasets[].sampling``); unset fields keep
    it. Only what may differ between the prompts of one dataset is here: the number of samples per prompt and
    the seed stay the dataset's.
    """

    name: Slug = Field(
        description="Recorded on each completion it sampled and counted in the report, e.g. `cold`."
    )
    weight: float = Field(
        gt=0, description="Relative weight: the share of prompts is weight / sum of weights."
    )
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, gt=0)
    max_tokens: int | None = Field(default=None, gt=0)
    enable_thinking: bool | None = None

    def apply(self, base: SamplingParams) -> SamplingParams:
        """Return ``base`` with every sampling field set here replaced."""
        changes = self.model_dump(exclude_none=True, exclude={"name", "weight"})
        return base.model_copy(update=changes)


def choose_setting(settings: list[SamplingSetting], prompt_id: str) -> SamplingSetting | None:
    """The setting of a sampling mix one prompt is generated with, decided by its id alone.

    The draw is the prompt id's SHA-256 read as a number in [0, 1): the same prompt gets the same setting in
    every attempt (a resume, a retry round), with no state to store, and prompts spread over the settings in
    proportion to their weights.

    Args:
        settings: The dataset's mix, in config order (empty: no mix).
        prompt_id: The prompt's stable id.

    Returns:
        The chosen setting, or None when the mix is empty.

    """
    if not settings:
        return None
    digest = hashlib.sha256(f"sampling-mix/{prompt_id}".encode()).digest()
    draw = int.from_bytes(digest[:DRAW_BYTES], "big") / 2 ** (8 * DRAW_BYTES)
    point = draw * sum(setting.weight for setting in settings)
    for setting in settings:
        point -= setting.weight
        if point < 0:
            return setting
    # Floating-point error can leave the last sliver unassigned: it belongs to the last setting.
    return settings[-1]


class DatasetConfig(StrictModel):
    """One prompt source: where it is, its layout, how many prompts to take, how to sample."""

    name: Slug = Field(description="Short name used in object keys and reports, e.g. `metamath`.")
    format: DatasetFormat
    path: str = Field(
        description="Local path, directory, glob, or s3:// URL of the dataset files; or a Hugging Face Hub "
        "dataset (`owner/name[:config]` or `hf://datasets/owner/name`), streamed through the `hub` extra "
        "where the Hub is reachable."
    )
    max_prompts: int | None = Field(
        default=None, gt=0, description="Quota: prompts taken from this dataset (a seeded sample)."
    )
    share: Share | None = Field(
        default=None,
        description="Quota as a share of `mix.total_prompts` (instead of `max_prompts`), e.g. 0.3.",
    )
    shard_size: int | None = Field(
        default=None,
        gt=0,
        le=MAX_SHARD_SIZE,
        description=f"Prompts per generation shard, each one Prefect task run; unset: {DEFAULT_SHARD_SIZE}. Smaller "
        "shards publish sooner at a window's end; each costs the flow process ~20-30 ms of Prefect's work.",
    )
    sampling: SamplingOverrides = Field(default_factory=SamplingOverrides)
    sampling_mix: list[SamplingSetting] = Field(
        default_factory=list,
        max_length=MAX_SAMPLING_SETTINGS,
        description="Weighted sampling settings, applied over `sampling`: each prompt gets one, chosen from its "
        "id (the same in every attempt), recorded on its completions as `sampling_setting`. Empty: every "
        "prompt samples with `sampling`.",
    )
    multi_turn: MultiTurnPolicy = Field(
        default="last_turn",
        description="Multi-turn rows: `last_turn` answers the last turn after the dataset's own history; "
        "`every_turn` one prompt per assistant turn, each after the dataset's history; `on_policy` answers every "
        "user turn in order after the target's own earlier answers, the dataset's recorded tool results spliced "
        "in after the target's equal calls (one record per turn; in exact-token mode each turn is rendered from "
        "its history as it is sent, and its output ids kept). Drafters train best on `on_policy` data.",
    )
    max_prompt_tokens: int | None = Field(
        default=None, gt=0, description="Drop longer prompts (tools included)."
    )
    languages: list[str] | None = Field(default=None, description="Keep rows whose language is listed.")
    category: str | None = Field(default=None, description="Mix category, e.g. code, math, chat, tools.")
    min_prompts: int = Field(
        default=1,
        ge=1,
        description="Fewest prompts this dataset must yield, or the run is refused before training is "
        "halted (a wrong path, layout or format yields none).",
    )

    @model_validator(mode="after")
    def _unique_setting_names(self) -> DatasetConfig:
        names = [setting.name for setting in self.sampling_mix]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(
                f"dataset {self.name!r} names sampling_mix settings more than once: {', '.join(repeated)}; "
                "give each setting its own name (the report counts completions by it)"
            )
        return self

    @model_validator(mode="after")
    def _one_quota(self) -> DatasetConfig:
        if self.share is not None and self.max_prompts is not None:
            raise ValueError(
                f"dataset {self.name!r} sets both max_prompts and share: keep one (a count, or a share "
                "of mix.total_prompts)"
            )
        return self

    @property
    def mix_category(self) -> str:
        """The category the mix counts this dataset in (``uncategorised`` when unset)."""
        return self.category or UNCATEGORISED

    @property
    def prompts_per_shard(self) -> int:
        """How many prompts a new shard of this dataset takes: ``shard_size``, or :data:`DEFAULT_SHARD_SIZE`."""
        return DEFAULT_SHARD_SIZE if self.shard_size is None else self.shard_size


class MixConfig(StrictModel):
    """The target mix of the new prompts: shares of a total, caps per category, what to do on shortfall.

    A dataset's quota is its ``max_prompts``, or its ``share`` of ``total_prompts``; caps then lower the
    quotas of a category that would exceed its share of the new prompts (never raising any other).
    """

    total_prompts: int | None = Field(
        default=None, gt=0, description="New prompts across the datasets that set `share`."
    )
    category_caps: Annotated[dict[str, Share], UNWRAP_UI_JSON, UI_MAPPING] = Field(
        default={},  # explicit (not a factory) so the UI's form has a value: see FleetConfig.env
        description="Most a category may be of the new prompts, e.g. {code: 0.2}; needs a quota on every "
        "dataset. Lowers that category's quotas, never raises others'.",
    )
    rebalance: bool = Field(
        default=False,
        description="Give a dataset's shortfall (fewer valid prompts than its quota) to the next datasets "
        "of its category, in config order. Off: the shortfall is only reported.",
    )


CorpusKind = Literal["prompt_ids", "prompts", "run", "dataset_version"]


class CorpusSource(StrictModel):
    """Prompts already in the training data, kept out of the new data (rejected as `in_existing_corpus`)."""

    kind: CorpusKind = Field(
        description="prompt_ids: text file(s), one prompt id or SHA-256 per line; prompts: dataset files "
        "in `format`, hashed like new prompts; run: a previous run's folder (its prompt shards); "
        "dataset_version: a dataset version manifest (the prompt_id column of its Parquet shards)."
    )
    path: str = Field(description="Local path, glob, or s3:// URL.")
    format: DatasetFormat | None = Field(default=None, description="Layout of the files (kind: prompts).")
    multi_turn: MultiTurnPolicy = Field(
        default="every_turn",
        description="kind prompts: which turns of a conversation count as already in the corpus.",
    )

    @model_validator(mode="after")
    def _prompts_need_format(self) -> CorpusSource:
        if self.kind == "prompts" and self.format is None:
            raise ValueError("existing_corpus source of kind 'prompts' needs `format`: the files' layout")
        return self


class ExistingCorpusConfig(StrictModel):
    """The training data the new prompts are added to: what to dedupe against, what it holds."""

    dedupe_against: list[CorpusSource] = Field(
        default_factory=list, description="Prompts never to take again (streamed; memory is the id set)."
    )
    category_counts: Annotated[dict[str, Annotated[int, Field(ge=0)]], UNWRAP_UI_JSON, UI_MAPPING] = Field(
        default={},  # explicit (not a factory) so the UI's form has a value: see FleetConfig.env
        description="Training rows per category already in the corpus, for the mix report, e.g. "
        "{code: 694540, math: 90000}.",
    )
