"""The run configuration: one typed model per concept, loaded from YAML, hashed for run identity.

`RunConfig` is the flow parameter (Prefect renders it as a form), the content of ``config.json`` in every
run, and what the CLI loads from ``--config FILE``. Everything is ``extra="forbid"``: a misspelt key is an
error that names the key, never a silently ignored setting. Secrets never live here (see
:mod:`datagen.settings`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import posixpath
import re
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from datagen.errors import ConfigError
from datagen.records import SamplingParams

CONFIG_SCHEMA_VERSION: Final = 1

# A run id or dataset name becomes part of an object key: keep it to characters safe everywhere.
SLUG_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,79}$"
Slug = Annotated[str, Field(pattern=SLUG_PATTERN)]

EngineKind = Literal["transformers", "sglang", "external"]
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
MultiTurnPolicy = Literal["last_turn", "every_turn"]
# The mix category of a dataset without one.
UNCATEGORISED: Final = "uncategorised"
# Shares of a mix may add up to 1 with floating-point error.
SHARE_SUM_TOLERANCE: Final = 1e-9
TrainingJobKind = Literal["none", "pidfile", "cmdline", "systemd", "prefect"]
RouterPolicy = Literal["random", "round_robin", "power_of_two", "cache_aware"]


# How the Prefect UI's form encodes the value of a free-form mapping field: its JSON text in a wrapper. The form's
# JSON mode sends such wrappers nested in the parameters, where Prefect's server does not unwrap them.
UI_JSON_KIND_KEY: Final = "__prefect_kind"


def _unwrap_ui_json(value: Any) -> Any:
    """Turn the UI's ``{"__prefect_kind": "json", "value": "<json>"}`` back into the mapping it encodes."""
    if isinstance(value, dict) and value.get(UI_JSON_KIND_KEY) == "json":
        text = value.get("value")
        if text is None or (isinstance(text, str) and not text.strip()):
            return {}
        if isinstance(text, str):
            try:
                return json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"not valid JSON: {error}") from None
        return text
    return value


# A free-form mapping field as the Prefect UI can submit it: any object in the published schema (the form's
# JSON mode nests the wrapper above, which a typed schema would reject), unwrapped and typed here.
UI_MAPPING_SCHEMA: Final = {"type": "object", "additionalProperties": True}
UNWRAP_UI_JSON: Final = BeforeValidator(_unwrap_ui_json)
UI_MAPPING: Final = WithJsonSchema(UI_MAPPING_SCHEMA)
UI_OPTIONAL_MAPPING: Final = WithJsonSchema({"anyOf": [UI_MAPPING_SCHEMA, {"type": "null"}]})


class StrictModel(BaseModel):
    """Base for every config model: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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


class SGLangOptions(StrictModel):
    """SGLang-only launch knobs; the planner fills what is left unset from the probed host."""

    attention_backend: str | None = Field(default=None, description="e.g. fa3, flashinfer; auto by SM.")
    mem_fraction_static: float | None = Field(default=None, gt=0, lt=1)
    max_running_requests: int | None = Field(default=None, gt=0)
    mamba_cache_strategy: Literal["auto", "no_buffer", "extra_buffer", "extra_buffer_lazy"] | None = Field(
        default=None,
        description="Hybrid models' state cache strategy; the flag name is detected from the installed sglang.",
    )
    disable_radix_cache: bool = Field(
        default=True,
        description="Unique prompts share no prefix; disabling the radix cache raises concurrency.",
    )
    reasoning_parser: str | None = Field(default="qwen3")
    tool_call_parser: str | None = Field(default=None)
    speculative: Annotated[dict[str, Any] | None, UNWRAP_UI_JSON, UI_OPTIONAL_MAPPING] = Field(
        default=None,
        description="Speculative decoding flags without leading dashes, e.g. {algorithm: EAGLE}.",
    )


class FleetConfig(StrictModel):
    """How many servers, of which engine, where, and how hard the dispatcher may drive each one."""

    engine: EngineKind = "transformers"
    num_servers: int | None = Field(
        default=None, gt=0, description="Servers to start; one per GPU when unset (cpu_servers without GPUs)."
    )
    cpu_servers: int = Field(default=2, gt=0, description="Servers to start on a host without GPUs.")
    tensor_parallel: int | None = Field(
        default=None, gt=0, description="GPUs per server; the planner decides when unset."
    )
    host: str = "127.0.0.1"
    base_port: int = Field(default=30000, gt=1023, lt=65000)
    external_urls: list[str] = Field(
        default_factory=list, description="Base URLs of servers already running (engine: external)."
    )
    max_inflight_per_server: int = Field(
        default=64, gt=0, description="Requests the dispatcher keeps in flight on each server."
    )
    ready_timeout_s: float = Field(default=900.0, gt=0)
    max_restarts_per_server: int = Field(default=3, ge=0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    extra_args: list[str] = Field(default_factory=list, description="Appended verbatim to every server argv.")
    # Mapping fields carry an explicit default (pydantic copies it per instance) so the UI's form shows one.
    env: Annotated[dict[str, str], UNWRAP_UI_JSON, UI_MAPPING] = Field(
        default={}, description="Extra environment for the servers."
    )
    sglang: SGLangOptions = Field(default_factory=SGLangOptions)
    speculative: Literal["off", "mtp"] = Field(
        default="off",
        description="Speculative decoding: `mtp` runs the model's built-in MTP layers as the drafter (sglang; "
        "the recipe of the model family, refused for models without MTP layers). Distribution-preserving at "
        "temperature > 0 (rejection sampling); keep min_p unset.",
    )
    tune_result: str | None = Field(
        default=None,
        description="A `datagen tune --output FILE` result (JSON): its best in-flight count per server (and "
        "max running requests for sglang) replace the planned ones.",
    )
    fix_jit_env: bool = Field(
        default=False,
        description="Add the CUDA include/stub paths the probe found (CPATH, LIBRARY_PATH, CUDA_HOME) to the "
        "servers' environment so JIT kernel builds find CCCL headers and libcuda stubs; never the flow's.",
    )
    router: bool = Field(
        default=False,
        description="Start sglang-router in front of the servers; the dispatcher then talks to it only.",
    )
    router_policy: RouterPolicy = Field(default="cache_aware", description="sglang-router --policy.")
    router_port: int | None = Field(
        default=None, gt=1023, lt=65536, description="Router port; the first free port after the servers'."
    )

    @model_validator(mode="after")
    def _external_needs_urls(self) -> FleetConfig:
        if self.engine == "external" and not self.external_urls:
            raise ValueError("engine 'external' needs fleet.external_urls: the base URLs of running servers")
        if self.speculative == "mtp" and self.engine != "sglang":
            raise ValueError(
                f"fleet.speculative: mtp needs engine sglang (engine is {self.engine}); set it to off or switch engine"
            )
        if self.speculative == "mtp" and self.sglang.speculative:
            raise ValueError(
                "fleet.speculative: mtp and fleet.sglang.speculative both set speculative flags: keep one"
            )
        return self


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


class DatasetConfig(StrictModel):
    """One prompt source: where it is, its layout, how many prompts to take, how to sample."""

    name: Slug = Field(description="Short name used in object keys and reports, e.g. `metamath`.")
    format: DatasetFormat
    path: str = Field(description="Local path, glob, or s3:// URL of the dataset files.")
    max_prompts: int | None = Field(
        default=None, gt=0, description="Quota: prompts taken from this dataset (a seeded sample)."
    )
    share: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Quota as a share of `mix.total_prompts` (instead of `max_prompts`), e.g. 0.3.",
    )
    shard_size: int = Field(default=256, gt=0, le=100_000, description="Prompts per generation shard.")
    sampling: SamplingOverrides = Field(default_factory=SamplingOverrides)
    multi_turn: MultiTurnPolicy = "last_turn"
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


CategoryShare = Annotated[float, Field(gt=0, le=1)]


class MixConfig(StrictModel):
    """The target mix of the new prompts: shares of a total, caps per category, what to do on shortfall.

    A dataset's quota is its ``max_prompts``, or its ``share`` of ``total_prompts``; caps then lower the
    quotas of a category that would exceed its share of the new prompts (never raising any other).
    """

    total_prompts: int | None = Field(
        default=None, gt=0, description="New prompts across the datasets that set `share`."
    )
    category_caps: Annotated[dict[str, CategoryShare], UNWRAP_UI_JSON, UI_MAPPING] = Field(
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


class GenerationConfig(StrictModel):
    """Request-level behaviour of the dispatcher."""

    request_timeout_s: float = Field(default=1800.0, gt=0)
    max_attempts: int = Field(default=5, gt=0, description="Tries per request before a failure is recorded.")
    max_internal_error_attempts: int = Field(
        default=3,
        gt=0,
        description="A request answered HTTP 500 this many times, by at least two servers, fails for good "
        "(each try redoes a whole generation); 502-504 and resets keep the full max_attempts.",
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


class TrainingJobConfig(StrictModel):
    """The training job to halt before the GPUs are taken."""

    kind: TrainingJobKind = "none"
    pidfile: str | None = Field(default=None, description="File holding the trainer's PID (kind: pidfile).")
    cmdline_pattern: str | None = Field(
        default=None,
        description="Regex searched in the command line of GPU-holding processes (kind: cmdline).",
    )
    systemd_unit: str | None = Field(default=None, description="Unit running the trainer (kind: systemd).")
    systemd_stop: Literal["stop", "kill"] = Field(
        default="stop",
        description="systemd: `stop` (the unit's KillSignal, never restarted by Restart=) or `kill` "
        "(send `signal` to the main process; only for units without Restart=).",
    )
    prefect_flow_run_id: str | None = Field(
        default=None, description="Flow run to cancel through the Prefect API (kind: prefect)."
    )
    prefect_deployment: str | None = Field(
        default=None,
        description="`flow-name/deployment-name` whose running flow runs are cancelled (kind: prefect).",
    )
    signal: str = Field(default="SIGTERM", description="Signal asking the trainer to checkpoint and exit.")
    stop_timeout_s: float = Field(default=600.0, gt=0, description="How long to wait for a graceful exit.")
    escalate: bool = Field(default=False, description="Send SIGKILL when the graceful stop times out.")
    checkpoint_glob: str | None = Field(
        default=None, description="Glob of checkpoint files; the newest is recorded as the last checkpoint."
    )
    checkpoint_marker: str | None = Field(
        default=None,
        description="File (or glob) the trainer writes once its checkpoint is complete; the halt waits for "
        "one written after the stop signal.",
    )
    restart_after_run: bool = Field(
        default=False, description="Start training again after the run (detached); off by default."
    )
    restart_command: list[str] | None = Field(
        default=None,
        description="argv that resumes training (kind systemd: `systemctl start <unit>` when unset).",
    )

    @model_validator(mode="after")
    def _kind_needs_its_target(self) -> TrainingJobConfig:
        needs = {
            "pidfile": ("pidfile", "the path of the trainer's pidfile"),
            "cmdline": ("cmdline_pattern", "a regex matching the trainer's command line"),
            "systemd": ("systemd_unit", "the unit that runs the trainer"),
        }
        if self.kind in needs:
            field, what = needs[self.kind]
            if not getattr(self, field):
                raise ValueError(f"training.kind {self.kind!r} needs training.{field}: {what}")
        if self.kind == "prefect" and not (self.prefect_flow_run_id or self.prefect_deployment):
            raise ValueError(
                "training.kind 'prefect' needs training.prefect_flow_run_id or training.prefect_deployment"
            )
        if self.cmdline_pattern is not None:
            try:
                re.compile(self.cmdline_pattern)
            except re.error as error:
                raise ValueError(f"training.cmdline_pattern is not a valid regex: {error}") from None
        if self.restart_after_run and not self.restart_command and self.kind != "systemd":
            raise ValueError(
                "training.restart_after_run needs training.restart_command (the argv that resumes training)"
            )
        return self

    @field_validator("signal")
    @classmethod
    def _known_signal(cls, value: str) -> str:
        import signal as signal_module

        name = value.upper() if value.upper().startswith("SIG") else f"SIG{value.upper()}"
        if not hasattr(signal_module, name):
            raise ValueError(f"unknown signal {value!r}; use a name such as SIGTERM, SIGINT or SIGUSR1")
        return name


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
        default=None, gt=0, description="Tokenizer processes; the cores this process may use when unset."
    )
    answer_render: Literal["auto", "full"] = Field(
        default="auto",
        description="auto: render each answer alone after a fixed context when the chat template passes the "
        "append probe (one prompt render per prompt); full: render every prompt+answer conversation.",
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


# The deployment of the host part of a multi-host run (flows/host.py), as deployments/prefect.yaml names it.
HOST_DEPLOYMENT: Final = "expand-host/expand-host"
# Fleet keys a host may not change: the run's engine and served model decide the requests every server gets,
# and the run's one dispatcher is the router over every host's servers (see docs/architecture.md).
HOST_FIXED_FLEET_KEYS: Final = frozenset({"engine", "router", "router_policy", "router_port", "speculative"})


class HostConfig(StrictModel):
    """One GPU box of a multi-host run: the Prefect work queue its worker polls, and what differs there."""

    name: Slug = Field(description="The host's name in logs, store keys and the report (e.g. `box-1`).")
    work_queue: str = Field(
        min_length=1,
        description="Work queue (in the host deployment's pool) that only this box's worker polls; the host "
        "part of the run is sent there.",
    )
    deployment: str | None = Field(
        default=None,
        description="`flow/deployment` of the host part for this box; multi_host.deployment when unset.",
    )
    fleet: Annotated[dict[str, Any], UNWRAP_UI_JSON, UI_MAPPING] = Field(
        default={},
        description="Fleet keys that differ on this box (e.g. {host: 10.0.0.5, num_servers: 4}), over the run's "
        "`fleet`; engine, router and speculative stay the run's.",
    )
    training: TrainingJobConfig | None = Field(
        default=None, description="The training job to halt on this box; the run's `training` when unset."
    )


class MultiHostConfig(StrictModel):
    """How the parent flow drives the hosts of a multi-host run (no effect without `hosts`)."""

    deployment: str = Field(
        default=HOST_DEPLOYMENT, description="`flow/deployment` of the host part (flows/host.py)."
    )
    ready_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        description="How long the parent waits for a host's preflight and then for its fleet; a host later "
        "than this is left out of the run (and reported).",
    )
    host_lost_after_s: float = Field(
        default=60.0,
        gt=0,
        description="A host whose servers all stay down this long (or whose host flow run ends) is removed: "
        "its in-flight requests go to the other hosts and the report names it.",
    )
    poll_interval_s: float = Field(
        default=1.0, gt=0, description="How often hosts and the parent look for each other's markers."
    )
    parent_lease_s: float = Field(
        default=60.0,
        ge=60,
        description="Duration of the Prefect concurrency lease the parent holds (Prefect's minimum: 60 s). "
        "Prefect renews it every 0.75 x this; a parent killed outright stops renewing it, so it runs out "
        "0.25-1 x this after the kill, the server's repossessor frees it within its loop (15 s), and the hosts "
        "stop serving: 15-75 s after the kill at 60 s.",
    )
    start_with_hosts: int = Field(
        default=1,
        gt=0,
        description="Generation starts once this many hosts serve (the others join as they come up); fewer "
        "only when the rest were lost first.",
    )


class RunConfig(StrictModel):
    """Everything that defines one data-expansion run; its hash is the run's identity."""

    schema_version: Literal[1] = CONFIG_SCHEMA_VERSION
    run_id: Slug | None = Field(default=None, description="Generated (timestamp + random) when unset.")
    model: ModelConfig
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    datasets: list[DatasetConfig] = Field(min_length=1)
    output: str = Field(description="Root URL of the output store: a local directory or s3://bucket/prefix.")
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

    @field_validator("datasets")
    @classmethod
    def _unique_dataset_names(cls, datasets: list[DatasetConfig]) -> list[DatasetConfig]:
        names = [dataset.name for dataset in datasets]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"dataset names must be unique; repeated: {', '.join(duplicates)}")
        return datasets

    @field_validator("hosts")
    @classmethod
    def _hosts_are_consistent(cls, hosts: list[HostConfig]) -> list[HostConfig]:
        names = [host.name for host in hosts]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"host names must be unique; repeated: {', '.join(duplicates)}: rename them")
        queues = [host.work_queue for host in hosts]
        shared = sorted({queue for queue in queues if queues.count(queue) > 1})
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
        for host in self.hosts:
            if host.name == name:
                return host
        known = ", ".join(host.name for host in self.hosts) or "none"
        raise ConfigError(f"no host named {name!r} in this config (hosts: {known})", name=name)

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
        """The resolved sampling parameters of one dataset (run defaults + its overrides)."""
        return dataset.sampling.apply(self.sampling)

    def dataset(self, name: str) -> DatasetConfig:
        """The dataset config called ``name``.

        Raises:
            ConfigError: No dataset has that name.
        """
        for dataset in self.datasets:
            if dataset.name == name:
                return dataset
        raise ConfigError(f"no dataset named {name!r} in this config", name=name)

    def identity_dict(self) -> dict[str, Any]:
        """The fields that define what the run produces, as JSON data.

        Everything but the run id and the guards that only refuse a run (``datasets[].min_prompts``): a
        guard changes no output, so changing it keeps the run id resumable. ``hosts`` and ``multi_host`` say
        where the run generates, not what: a run resumes on other or fewer hosts. ``series``,
        ``generation.exact_tokens`` and ``tokenize.formats`` joined the model later: each is left out while
        unset (or at its default) so the hashes of older runs stay the same.
        """
        exclude: dict[str, Any] = {
            "run_id": True,
            "datasets": {"__all__": {"min_prompts"}},
            # Where the run generates changes no output: a resume may use other (or fewer) hosts.
            "hosts": True,
            "multi_host": True,
        }
        if self.series is None:
            exclude["series"] = True
        if self.generation.exact_tokens is None:
            exclude["generation"] = {"exact_tokens"}
        if self.tokenize.formats == ["parquet"]:
            exclude["tokenize"] = {"formats"}
        return self.model_dump(mode="json", exclude=exclude)

    def config_hash(self) -> str:
        """A stable hash of :meth:`identity_dict`; two configs with equal hashes produce the same run."""
        canonical = json.dumps(self.identity_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def format_validation_error(error: ValidationError, source: str) -> str:
    """Turn a pydantic error into one line per problem: the dotted field, what is wrong, how to fix it.

    Args:
        error: The validation error.
        source: Where the config came from (file name), for the first line.

    Returns:
        A message a user can act on without reading a traceback.
    """
    lines = [f"Invalid run configuration in {source}:"]
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(top level)"
        kind = item["type"]
        if kind == "extra_forbidden":
            hint = "unknown key: remove it or check its spelling against docs/configuration.md"
        elif kind == "missing":
            hint = "required: add this key"
        else:
            hint = item["msg"]
            if item.get("input") is not None and kind != "value_error":
                hint += f" (got {item['input']!r})"
        lines.append(f"  - {field}: {hint}")
    return "\n".join(lines)


def parse_run_config(data: Any, source: str = "<config>") -> RunConfig:
    """Validate already-parsed config data.

    Args:
        data: A mapping (from YAML, JSON, or a Prefect parameter).
        source: Where the data came from, quoted in errors.

    Returns:
        The validated config.

    Raises:
        ConfigError: The data is not a valid run configuration; the message lists every problem.
    """
    if not isinstance(data, dict):
        raise ConfigError(
            f"Invalid run configuration in {source}: expected a mapping at the top level, "
            f"got {type(data).__name__}",
            source=source,
        )
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, source), source=source) from None


# --- relative paths -----------------------------------------------------------------------------
# A config is written once and run from anywhere: by the CLI in some shell, by a Prefect worker in its
# checkout, from an s3:// URL. So a relative location in a config file means "next to this file", never
# "next to whoever runs it".

# Fields holding a location that is always a path (never a hub id or a store key).
_TOP_LEVEL_PATHS = ("output",)
_TRAINING_PATHS = ("pidfile", "checkpoint_glob", "checkpoint_marker")
# Model locations may also be hub ids (``Qwen/Qwen3-8B``): only rewritten when that path exists.
_MODEL_PATHS = ("path", "tokenizer_path")


def _is_relative(value: object) -> bool:
    return isinstance(value, str) and bool(value) and "://" not in value and not value.startswith(("/", "~"))


def _join(base: str, value: str) -> str:
    if "://" in base:
        scheme, _, rest = base.partition("://")
        return f"{scheme}://{posixpath.normpath(posixpath.join(rest, value))}"
    return os.path.normpath(os.path.join(base, value))


def config_folder(location: str | Path) -> str:
    """The folder relative paths of the config at ``location`` (a local path or URL) resolve against."""
    text = str(location)
    if "://" in text and not text.startswith("file://"):
        return text.rstrip("/").rpartition("/")[0]
    return str(Path(text.removeprefix("file://")).expanduser().resolve().parent)


def resolve_relative_paths(data: dict[str, Any], base: str) -> dict[str, Any]:
    """Return a copy of raw config data whose relative locations are joined to ``base``.

    Rewritten: ``output``, ``protected_prefixes``, ``datasets[].path``,
    ``existing_corpus.dedupe_against[].path``, ``training.pidfile`` / ``checkpoint_glob`` /
    ``checkpoint_marker``, and ``model.path`` / ``model.tokenizer_path`` when they start with ``./`` or
    ``../`` or the joined local path exists (otherwise they are hub ids such as ``Qwen/Qwen3-8B``).
    Left alone: absolute paths, URLs, and ``tokenize.base_version`` (a key in the output store when
    relative).

    Args:
        data: Parsed config data (not validated yet; unknown shapes are left for validation to report).
        base: The config file's folder: a local directory or an ``s3://`` URL.

    Returns:
        The rewritten copy.
    """
    result = copy.deepcopy(data)

    def rewrite(holder: Any, key: str, must_exist: bool = False) -> None:
        if not isinstance(holder, dict) or not _is_relative(holder.get(key)):
            return
        joined = _join(base, holder[key])
        explicit = holder[key].startswith(("./", "../"))
        if must_exist and not explicit and ("://" in joined or not Path(joined).exists()):
            return
        holder[key] = joined

    for key in _TOP_LEVEL_PATHS:
        rewrite(result, key)
    prefixes = result.get("protected_prefixes")
    if isinstance(prefixes, list):
        result["protected_prefixes"] = [_join(base, p) if _is_relative(p) else p for p in prefixes]
    for dataset in result.get("datasets") or []:
        rewrite(dataset, "path")
    corpus = result.get("existing_corpus")
    if isinstance(corpus, dict):
        for source in corpus.get("dedupe_against") or []:
            rewrite(source, "path")
    for key in _TRAINING_PATHS:
        rewrite(result.get("training"), key)
    for key in _MODEL_PATHS:
        rewrite(result.get("model"), key, must_exist=True)
    return result


def load_run_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Load a run configuration from a YAML (or JSON) file.

    Relative locations in the file resolve against the file's folder (:func:`resolve_relative_paths`);
    override values are taken as given.

    Args:
        path: The file.
        overrides: Top-level keys replacing those in the file (e.g. ``run_id``, ``output`` from the CLI).

    Returns:
        The validated config.

    Raises:
        ConfigError: The file is missing, is not YAML, or does not validate.
    """
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"Config file {file} does not exist; pass an existing YAML file to --config.")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"Config file {file} is not valid YAML: {error}") from None
    if isinstance(data, dict):
        data = resolve_relative_paths(data, config_folder(file))
    if isinstance(data, dict) and overrides:
        data = {**data, **{key: value for key, value in overrides.items() if value is not None}}
    return parse_run_config(data, source=str(file))


RUN_ID_EXAMPLE: Final = "20261201-nightly-1"


def check_run_id_option(run_id: str | None, flag: str = "--run-id") -> None:
    """Refuse a run id given on the command line that cannot be one, naming the flag (not the config file).

    Args:
        run_id: The value given, or None when the flag was not.
        flag: The option's name, for the message.

    Raises:
        ConfigError: The value is not a valid run id; the message gives the rule and an example.
    """
    if run_id is not None and not is_valid_slug(run_id):
        raise ConfigError(
            f"{flag} {run_id!r} is not a valid run id: use 1-80 lowercase letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit, e.g. {flag} {RUN_ID_EXAMPLE}",
            run_id=run_id,
        )


def is_valid_slug(value: str) -> bool:
    """Tell whether ``value`` may be used as a run id or dataset name."""
    return re.match(SLUG_PATTERN, value) is not None
