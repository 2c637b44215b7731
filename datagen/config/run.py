"""The whole run (:class:`RunConfig`): every stage's section, the checks across sections, the config hash."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal, TypeVar

from pydantic import Field, ValidationError, field_validator, model_validator

from datagen.config.base import CONFIG_SCHEMA_VERSION, Slug, StrictModel
from datagen.config.choices import RunChoicesConfig
from datagen.config.fleet import FleetConfig
from datagen.config.generation import GenerationConfig
from datagen.config.merge import TokenizeConfig
from datagen.config.model import ModelConfig
from datagen.config.multihost import HOST_FIXED_FLEET_KEYS, HostConfig, MultiHostConfig
from datagen.config.prompts import (
    LEGACY_SHARD_SIZE,
    SHARE_SUM_TOLERANCE,
    DatasetConfig,
    ExistingCorpusConfig,
    MixConfig,
    choose_setting,
)
from datagen.config.training import TrainingJobConfig
from datagen.config.window import WindowConfig
from datagen.errors import ConfigError
from datagen.records import SamplingParams

Named = TypeVar("Named", HostConfig, DatasetConfig)


def _repeated(values: list[str]) -> list[str]:
    return sorted({value for value in values if values.count(value) > 1})


def _refuse_repeated(values: list[str], what: str, fix: str = "") -> None:
    repeated = _repeated(values)
    if repeated:
        raise ValueError(f"{what} must be unique; repeated: {', '.join(repeated)}{fix}")


def _named(items: list[Named], name: str, missing: str) -> Named:
    found = next((item for item in items if item.name == name), None)
    if found is None:
        raise ConfigError(missing, name=name)
    return found


class RunConfig(StrictModel):
    """Everything that defines one data-expansion run; its hash is the run's identity."""

    schema_version: Literal[1] = CONFIG_SCHEMA_VERSION
    run_id: Slug | None = Field(default=None, description="Generated (timestamp + random) when unset.")
    model: ModelConfig
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    datasets: list[DatasetConfig] = Field(min_length=1)
    output: str = Field(description="Root URL of the output store: a local directory or s3://bucket/prefix.")
    output_roots: list[str] = Field(
        default_factory=list,
        description="Further output roots a run's `output` parameter may choose (besides `output` itself): "
        "absolute paths or s3:// URLs. Only this file sets them; see docs/security.md.",
    )
    protected_prefixes: list[str] = Field(
        default_factory=list, description="Locations that must never be written (the existing training data)."
    )
    training: TrainingJobConfig = Field(default_factory=TrainingJobConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    seed: int = Field(default=0, description="Seed of every sampling and shuffling decision.")
    mix: MixConfig = Field(default_factory=MixConfig)
    existing_corpus: ExistingCorpusConfig = Field(default_factory=ExistingCorpusConfig)
    series: Slug | None = Field(
        default=None,
        description="Expansion series (e.g. `nightly`): each run takes prompts no earlier run of the series "
        "took and publishes the next dataset version on top of the series' last one. See docs/operations.md.",
    )
    hosts: list[HostConfig] = Field(
        default_factory=list,
        description="Several GPU boxes: one host part per entry, on that box's Prefect worker; every host's "
        "servers join one dispatcher. Empty: this host only. See docs/operations.md (multi-host runbook).",
    )
    multi_host: MultiHostConfig = Field(default_factory=MultiHostConfig)
    run_choices: RunChoicesConfig = Field(
        default_factory=RunChoicesConfig,
        description="Ceilings on what a deployed run may choose, and the work queues it may run on. See "
        "docs/security.md.",
    )
    window: WindowConfig = Field(
        default_factory=WindowConfig,
        description="How long training may stay stopped (`max_hours`) or until when (`until`); the run stops "
        "admitting requests in time for those in flight, the fleet's stop and training's restart to fit. See "
        "docs/operations.md.",
    )

    @field_validator("datasets")
    @classmethod
    def _unique_dataset_names(cls, datasets: list[DatasetConfig]) -> list[DatasetConfig]:
        _refuse_repeated([dataset.name for dataset in datasets], "dataset names")
        return datasets

    @field_validator("hosts")
    @classmethod
    def _hosts_are_consistent(cls, hosts: list[HostConfig]) -> list[HostConfig]:
        _refuse_repeated([host.name for host in hosts], "host names", ": rename them")
        shared = _repeated([host.work_queue for host in hosts])
        if shared:
            raise ValueError(
                f"hosts share work queue(s) {', '.join(shared)}: give each box its own queue (its worker polls "
                "only it), or one box would run two host parts"
            )
        for host in hosts:
            fixed = sorted(HOST_FIXED_FLEET_KEYS & host.fleet.keys())
            if fixed:
                raise ValueError(
                    f"host {host.name}: fleet.{', fleet.'.join(fixed)} cannot differ per host; set it in the "
                    "run's `fleet` instead"
                )
        return hosts

    @model_validator(mode="after")
    def _hosts_fit_the_fleet(self) -> RunConfig:
        if not self.hosts:
            return self
        if self.multi_host.start_with_hosts > len(self.hosts):
            raise ValueError(
                f"multi_host.start_with_hosts is {self.multi_host.start_with_hosts} but only {len(self.hosts)} "
                "host(s) are listed: lower it"
            )
        if self.fleet.router:
            raise ValueError(
                "fleet.router cannot be used with hosts: the run's dispatcher already routes over every "
                "host's servers; set fleet.router: false (docs/operations.md, multi-host runbook)"
            )
        if self.window.bounded:
            # Silently generating past the window would break the one promise a window makes.
            raise ValueError(
                "window cannot be used with hosts yet: a multi-host run does not stop its hosts' generation at "
                "the window's end; remove `window`, or run on one box (docs/operations.md, A generation window)"
            )
        for host in self.hosts:
            try:
                self.fleet_for(host.name)
            except ValidationError as error:
                problems = "; ".join(
                    f"{'.'.join(str(p) for p in item['loc']) or 'fleet'}: {item['msg']}"
                    for item in error.errors()
                )
                raise ValueError(f"host {host.name}: fleet overrides are invalid: {problems}") from None
        return self

    def host(self, name: str) -> HostConfig:
        """The host called ``name``.

        Raises:
            ConfigError: No host has that name.
        """
        known = ", ".join(host.name for host in self.hosts) or "none"
        return _named(self.hosts, name, f"no host named {name!r} in this config (hosts: {known})")

    def fleet_for(self, name: str) -> FleetConfig:
        """The fleet config of host ``name``: the run's, with the host's overrides."""
        overrides = self.host(name).fleet
        if not overrides:
            return self.fleet
        return FleetConfig.model_validate({**self.fleet.model_dump(), **overrides})

    def for_host(self, name: str) -> RunConfig:
        """The config the host part of host ``name`` runs with: its fleet and training job, no hosts."""
        host = self.host(name)
        return self.model_copy(
            update={
                "fleet": self.fleet_for(name),
                "training": host.training or self.training,
                "hosts": [],
            }
        )

    @model_validator(mode="after")
    def _mix_is_consistent(self) -> RunConfig:
        shares = [dataset.share for dataset in self.datasets if dataset.share is not None]
        if shares and self.mix.total_prompts is None:
            raise ValueError("datasets set `share` but mix.total_prompts is unset: set the total to share")
        if self.mix.total_prompts is not None and not shares:
            raise ValueError("mix.total_prompts is set but no dataset sets `share`: give datasets a share")
        if sum(shares) > 1 + SHARE_SUM_TOLERANCE:
            raise ValueError(f"dataset shares add up to {sum(shares):g}, more than 1: lower them")
        categories = {dataset.mix_category for dataset in self.datasets}
        unknown = sorted(set(self.mix.category_caps) - categories)
        if unknown:
            raise ValueError(
                f"mix.category_caps names categories no dataset has: {', '.join(unknown)} "
                f"(categories: {', '.join(sorted(categories))})"
            )
        if self.mix.category_caps:
            unlimited = [d.name for d in self.datasets if d.max_prompts is None and d.share is None]
            if unlimited:
                raise ValueError(
                    "mix.category_caps needs a quota (max_prompts or share) on every dataset, so the caps "
                    f"are known before any dataset is read; none on: {', '.join(unlimited)}"
                )
        # Whether the caps can all hold at once needs the mix plan: datagen.prompts.mix.validate_mix, called
        # by preflight and the CLI (the plan builds on this module, so it cannot be called from here).
        return self

    def sampling_for(self, dataset: DatasetConfig) -> SamplingParams:
        """The resolved sampling parameters of one dataset (run defaults + its overrides), before its mix."""
        return dataset.sampling.apply(self.sampling)

    def sampling_for_prompt(
        self, dataset: DatasetConfig, prompt_id: str
    ) -> tuple[str | None, SamplingParams]:
        """How one prompt of ``dataset`` is sampled: its mix setting's name (None without a mix) and parameters."""
        base = self.sampling_for(dataset)
        setting = choose_setting(dataset.sampling_mix, prompt_id)
        if setting is None:
            return None, base
        return setting.name, setting.apply(base)

    def max_tokens_for(self, dataset: DatasetConfig) -> int:
        """The most tokens any answer of ``dataset`` may have: its sampling's, or its mix's largest setting's."""
        base = self.sampling_for(dataset)
        return max([base.max_tokens, *(setting.apply(base).max_tokens for setting in dataset.sampling_mix)])

    def dataset(self, name: str) -> DatasetConfig:
        """The dataset config called ``name`` (a ConfigError when no dataset has that name)."""
        return _named(self.datasets, name, f"no dataset named {name!r} in this config")

    def identity_dict(self) -> dict[str, Any]:
        """The fields that define what the run produces, as JSON data.

        Everything but the run id and the guards that only refuse a run (``datasets[].min_prompts``,
        ``output_roots``, ``run_choices``): a
        guard changes no output, so changing it keeps the run id resumable. ``hosts`` and ``multi_host`` say
        where the run generates, not what: a run resumes on other or fewer hosts. ``series``,
        ``generation.exact_tokens``, ``tokenize.formats`` and ``tokenize.conversation_rows`` joined the model
        later: each is left out while unset (or at its default) so the hashes of older runs stay the same. An
        unset ``datasets[].shard_size`` is recorded as 256, its default when older runs hashed it.
        """
        exclude: dict[str, Any] = {
            "run_id": True,
            # Which outputs a run may choose changes nothing a run produces.
            "output_roots": True,
            # `sampling_mix` joined the model later: left out while empty, so older runs' hashes stay the same.
            "datasets": {
                index: {"min_prompts", "sampling_mix"} if not dataset.sampling_mix else {"min_prompts"}
                for index, dataset in enumerate(self.datasets)
            },
            # Where the run generates changes no output: a resume may use other (or fewer) hosts.
            "hosts": True,
            "multi_host": True,
            # Ceilings and allowed queues only refuse runs.
            "run_choices": True,
            # How long one attempt may generate changes no answer: the next attempt continues the rest.
            "window": True,
        }
        if self.series is None:
            exclude["series"] = True
        if self.generation.exact_tokens is None:
            exclude["generation"] = {"exact_tokens"}
        later_tokenize = {
            "formats": self.tokenize.formats == ["parquet"],
            "conversation_rows": self.tokenize.conversation_rows == "per_turn",
        }
        if any(later_tokenize.values()):
            exclude["tokenize"] = {name for name, default in later_tokenize.items() if default}
        identity = self.model_dump(mode="json", exclude=exclude)
        for dataset in identity["datasets"]:
            if dataset["shard_size"] is None:
                # Recorded as hashes always recorded an unset size: older runs' hashes stay the same. How prompts
                # are cut changes no answer, and a run's shards, once cut, are what it generates from on every
                # attempt (datagen.prompts.prepare), whatever the default now.
                dataset["shard_size"] = LEGACY_SHARD_SIZE
        return identity

    def config_hash(self) -> str:
        """A stable hash of :meth:`identity_dict`; two configs with equal hashes produce the same run."""
        canonical = json.dumps(self.identity_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]
