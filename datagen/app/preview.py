"""The price of a run before anything is halted: prompts, output tokens, hours, GPU-hours, paused training.

Every run stops a training job, so its cost is hours of paused training. :func:`estimate_cost` prices a
resolved config from what the run would select (the mix's quotas, or the prepared prompts when known) and
from this box's own history (:mod:`datagen.app.history`): the rate measured for the model on this engine and
fleet shape, the answer lengths measured for the model on each dataset, and the measured times of halting
training, starting and stopping the fleet and restarting training. Without history it falls back to a
``datagen tune`` result, then to the planner's rough rate, and says which source each figure came from.

A prompt of an on-policy dataset (``multi_turn: on_policy``) is a conversation of one request per turn the
target answers (:func:`datagen.conversation_turns.split_conversation`, the cut the run itself sends by): the
preview reads such a dataset to price its mean turns per conversation, and measured answer lengths are per turn.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from datagen.app.history import BoxRecord, matching
from datagen.config import RunConfig
from datagen.progress import format_duration
from datagen.prompts.mix import plan_mix

# The most recent records of the box that an estimate averages: older ones describe an older setup.
RECENT_RECORDS = 5
SECONDS_PER_HOUR = 3600.0
# Without measured answers, a thinking model's answers average about two thirds of max_tokens (the nightly
# seed's answers: about 2,700 output tokens under a 4,096-token cap); the preview says it assumed this.
ASSUMED_ANSWER_SHARE_OF_MAX_TOKENS = 0.66
# The planner's rate per GPU when the box has neither history nor a tune result: the seed's 9.4K output tok/s
# of a 27B model on an 8-GPU H100 box, per GPU. A CPU server (the transformers engine) makes tens of tokens.
PLANNER_OUTPUT_TOKENS_PER_S_PER_GPU = 1175.0
PLANNER_OUTPUT_TOKENS_PER_S_PER_CPU_SERVER = 20.0
# Overheads of a run without history, each paid once per attempt while training is stopped: a training job
# checkpoints then exits (minutes), SGLang loads a large model and captures its CUDA graphs (about ten
# minutes on a 27B model), stopping servers takes seconds, the training job is started again (its own
# restart until it trains is not ours to measure).
DEFAULT_TRAINING_HALT_S = 120.0
DEFAULT_FLEET_START_S = 600.0
DEFAULT_FLEET_STOP_S = 30.0
DEFAULT_TRAINING_RESTART_S = 60.0

RateSource = Literal["measured", "tune", "planner"]
AnswerSource = Literal["measured", "assumed"]


class DatasetPreview(BaseModel):
    """One dataset's share of the run."""

    model_config = ConfigDict(extra="forbid")

    dataset: str
    prompts: int | None = Field(
        description="Prompts the run would take; None: every valid row (unknown yet)."
    )
    samples_per_prompt: int = 1
    on_policy: bool = Field(
        default=False, description="Each prompt sample is a conversation of turns (`multi_turn: on_policy`)."
    )
    turns_per_conversation: float | None = Field(
        default=1.0,
        ge=1,
        description="Requests per prompt sample: 1 unless on-policy, else the dataset's mean turns per "
        "conversation; None: on-policy and not read yet (priced as 1 turn, a lower bound).",
    )
    max_tokens: int
    mean_answer_tokens: float
    answer_source: AnswerSource

    @property
    def conversations(self) -> int:
        """Prompt samples: conversations of an on-policy dataset, requests of any other (0 while unknown)."""
        return (self.prompts or 0) * self.samples_per_prompt

    @property
    def requests(self) -> float:
        """Expected requests (turns of an on-policy dataset) of the dataset (0 while its prompts are unknown)."""
        return self.conversations * (self.turns_per_conversation or 1.0)

    @property
    def output_tokens(self) -> float:
        """Expected output tokens of the dataset (0 while its prompt count is unknown)."""
        return self.requests * self.mean_answer_tokens


class Overheads(BaseModel):
    """The times paid while training is stopped besides generating, measured (medians) or defaults."""

    model_config = ConfigDict(extra="forbid")

    training_halt_s: float = DEFAULT_TRAINING_HALT_S
    fleet_start_s: float = DEFAULT_FLEET_START_S
    fleet_stop_s: float = DEFAULT_FLEET_STOP_S
    training_restart_s: float = DEFAULT_TRAINING_RESTART_S
    other_s: float = Field(
        default=0.0,
        ge=0,
        description="The rest of the paused time besides generating: the probe, the plan, the prompts' last "
        "checks (measured: paused time minus generation and the four steps above).",
    )
    measured: bool = Field(default=False, description="At least one figure comes from the box's history.")

    @property
    def before_generation_s(self) -> float:
        """From the halt until the first request can be sent."""
        return self.training_halt_s + self.fleet_start_s + self.other_s

    @property
    def after_generation_s(self) -> float:
        """From the last answer until training runs again."""
        return self.fleet_stop_s + self.training_restart_s

    @property
    def total_s(self) -> float:
        """Every overhead of one attempt."""
        return self.before_generation_s + self.after_generation_s


class CostPreview(BaseModel):
    """What a run is expected to cost, and where each figure came from."""

    model_config = ConfigDict(extra="forbid")

    model: str
    engine: str
    datasets: list[DatasetPreview]
    output_tokens_per_s: float = Field(gt=0)
    rate_source: RateSource
    rate_detail: str
    gpus: int | None = Field(
        default=None, description="GPUs the fleet holds; None: not known before the probe."
    )
    overheads: Overheads

    @property
    def prompts(self) -> int:
        """Prompts of the datasets whose count is known."""
        return sum(item.prompts or 0 for item in self.datasets)

    @property
    def complete(self) -> bool:
        """Every dataset's prompt count (and turns, on-policy) is known (else the figures are a lower bound)."""
        return all(
            item.prompts is not None and item.turns_per_conversation is not None for item in self.datasets
        )

    @property
    def requests(self) -> float:
        """Expected requests of the whole run (each turn of a conversation is one)."""
        return sum(item.requests for item in self.datasets)

    @property
    def output_tokens(self) -> float:
        """Expected output tokens of the whole run."""
        return sum(item.output_tokens for item in self.datasets)

    @property
    def generation_s(self) -> float:
        """Expected generation time at the expected rate."""
        return self.output_tokens / self.output_tokens_per_s

    @property
    def training_paused_s(self) -> float:
        """Expected time training stays stopped: halt, fleet start, generation, fleet stop, restart."""
        return self.generation_s + self.overheads.total_s

    @property
    def gpu_hours(self) -> float | None:
        """GPU-hours held from halt to restart (None when the GPU count is unknown)."""
        return None if self.gpus is None else self.gpus * self.training_paused_s / SECONDS_PER_HOUR

    def lines(self) -> list[str]:
        """The preview as short lines, for the terminal and the log."""
        bound = "" if self.complete else "at least "
        gpu_hours = "unknown (GPU count unknown)" if self.gpu_hours is None else f"{self.gpu_hours:.1f}"
        lines = [
            f"prompts: {bound}{self.prompts} "
            + "("
            + ", ".join(
                f"{item.dataset}={'all valid rows' if item.prompts is None else item.prompts}"
                for item in self.datasets
            )
            + ")",
            f"requests: {bound}{self.requests:,.0f}" + _conversation_counts(self.datasets),
            f"expected output tokens: {bound}{self.output_tokens:,.0f}",
            f"expected rate: {self.output_tokens_per_s:,.0f} output tok/s ({self.rate_detail})",
            f"expected generation: {bound}{format_duration(self.generation_s)}",
            f"expected training paused: {bound}{format_duration(self.training_paused_s)} "
            f"({self.training_paused_s / SECONDS_PER_HOUR:.2f} h; overheads "
            f"{format_duration(self.overheads.total_s)}, "
            f"{'measured on this box' if self.overheads.measured else 'defaults: no history on this box'})",
            f"expected GPU-hours: {gpu_hours}",
        ]
        for item in self.datasets:
            turns = ""
            if item.on_policy:
                turns = (
                    " x turns unknown (counted as 1)"
                    if item.turns_per_conversation is None
                    else f" x {item.turns_per_conversation:.2f} turns per conversation"
                )
            lines.append(
                f"  {item.dataset}: {item.mean_answer_tokens:,.0f} output tokens per answer "
                f"({item.answer_source}; max_tokens {item.max_tokens}) x {item.samples_per_prompt} sample(s)"
                + turns
            )
        return lines

    def to_markdown(self) -> str:
        """The preview as a section of the preflight artifact."""
        return "\n".join(["## Expected cost", "", *[f"- {line.strip()}" for line in self.lines()]]) + "\n"


def _conversation_counts(datasets: Sequence[DatasetPreview]) -> str:
    """`` (chat: 16 conversations, 48 turns)`` for the on-policy datasets; empty without any."""
    counted = [
        f"{item.dataset}: {item.conversations:,} conversations, "
        + ("turns unknown" if item.turns_per_conversation is None else f"{item.requests:,.0f} turns")
        for item in datasets
        if item.on_policy
    ]
    return f" ({'; '.join(counted)})" if counted else ""


def _recent(records: Sequence[BoxRecord]) -> list[BoxRecord]:
    return list(records)[-RECENT_RECORDS:]


def _rate(
    config: RunConfig, records: Sequence[BoxRecord], plan: str | None, gpus: int | None
) -> tuple[float, RateSource, str]:
    same_shape = [record for record in records if plan is not None and record.plan == plan]
    measured = _recent(same_shape or list(records))
    measured = [record for record in measured if record.output_tokens_per_s > 0]
    if measured:
        rate = statistics.median(record.output_tokens_per_s for record in measured)
        kinds = ", ".join(sorted({record.kind for record in measured}))
        return (
            rate,
            "measured",
            f"measured on this box: median of {len(measured)} {kinds}(s), {measured[-1].plan}",
        )
    if config.fleet.tune_result:
        from datagen.engines.tune_result import load_tune_result

        tuned = load_tune_result(config.fleet.tune_result)
        return tuned.best_output_tokens_per_s, "tune", f"datagen tune result {config.fleet.tune_result}"
    if not gpus:
        servers = config.fleet.num_servers or config.fleet.cpu_servers
        rate = PLANNER_OUTPUT_TOKENS_PER_S_PER_CPU_SERVER * servers
        return rate, "planner", f"planner's estimate for {servers} CPU server(s): no history on this box"
    rate = PLANNER_OUTPUT_TOKENS_PER_S_PER_GPU * gpus
    return rate, "planner", f"planner's estimate for {gpus} GPU(s): no history on this box"


def _answer_tokens(records: Sequence[BoxRecord], dataset: str, max_tokens: int) -> tuple[float, AnswerSource]:
    answered = [record.answers[dataset] for record in records if dataset in record.answers]
    answered = [item for item in answered[-RECENT_RECORDS:] if item.completions]
    if answered:
        tokens = sum(item.output_tokens for item in answered)
        count = sum(item.completions for item in answered)
        return min(float(max_tokens), tokens / count), "measured"
    return ASSUMED_ANSWER_SHARE_OF_MAX_TOKENS * max_tokens, "assumed"


def measured_overheads(records: Sequence[BoxRecord]) -> Overheads:
    """The medians of the recent records' measured overheads; a default wherever none was measured."""
    recent = _recent([record for record in records if record.kind == "run"])
    steps = ("training_halt_s", "fleet_start_s", "fleet_stop_s", "training_restart_s")
    figures: dict[str, float] = {}
    for name in steps:
        values = [value for record in recent if (value := getattr(record, name)) is not None]
        if values:
            figures[name] = statistics.median(values)
    rest = [
        record.training_paused_s
        - record.generation_wall_s
        - sum(getattr(record, name) or 0.0 for name in steps)
        for record in recent
        if record.training_paused_s is not None
    ]
    if rest:
        figures["other_s"] = max(0.0, statistics.median(rest))
    return Overheads(**figures, measured=bool(figures))


def run_overheads(config: RunConfig, records: Sequence[BoxRecord]) -> Overheads:
    """What each attempt of ``config`` pays besides generating: :func:`measured_overheads`, none for a skipped step.

    ``training.kind: none`` halts nothing, and training is started again only with
    ``training.restart_after_run``. Servers the run did not launch (``external``) load no model: their start and
    stop cost what this box measured for them (checking they answer), never the launch defaults. Reserving a
    default for a step that does not happen would overstate the paused time and end a windowed run's generation
    early for nothing.

    Args:
        config: The run's config.
        records: The box's records of the run's model and engine (:func:`datagen.app.history.matching`).
    """
    from datagen.engines import engine_class

    overheads = measured_overheads(records)
    skipped: dict[str, float] = {}
    if not engine_class(config.fleet.engine).launches_processes:
        fleet = ("fleet_start_s", "fleet_stop_s")
        skipped |= {name: 0.0 for name in fleet if name not in overheads.model_fields_set}
    if config.training.kind == "none":
        skipped["training_halt_s"] = 0.0
    if not config.training.restart_after_run:
        skipped["training_restart_s"] = 0.0
    return overheads.model_copy(update=skipped)


def estimate_cost(
    config: RunConfig,
    history: Sequence[BoxRecord],
    *,
    prompts_by_dataset: Mapping[str, int] | None = None,
    turns_by_dataset: Mapping[str, float] | None = None,
    gpus: int | None = None,
    plan: str | None = None,
) -> CostPreview:
    """Price ``config`` on this box.

    Args:
        config: The resolved run config.
        history: The box's records (:func:`datagen.app.history.read_history`).
        prompts_by_dataset: The prepared prompts per dataset when known (exact); else the mix's quotas, the
            same :func:`datagen.prompts.mix.plan_mix` the preparation samples to.
        turns_by_dataset: The mean turns per conversation of on-policy datasets, when read; an on-policy
            dataset missing here is priced as one turn per conversation, and the preview says it is a lower bound.
        gpus: GPUs the fleet will hold; else the last run of the model on this box's, else unknown.
        plan: The fleet's shape (:func:`datagen.app.history.plan_key`) when planned: rates of that shape win.

    Returns:
        The preview.
    """
    model, engine = config.model.path, config.fleet.engine
    # A run records the model's path; a tune, the name its servers answered to.
    names = {model, *([config.model.served_name] if config.model.served_name else [])}
    records = matching(history, names, engine)
    if gpus is None:
        held = [record.gpus for record in records if record.kind == "run" and record.gpus]
        gpus = held[-1] if held else None
    quotas = plan_mix(config)
    datasets = []
    for dataset in config.datasets:
        sampling = config.sampling_for(dataset)
        if prompts_by_dataset is not None and dataset.name in prompts_by_dataset:
            prompts: int | None = prompts_by_dataset[dataset.name]
        else:
            prompts = quotas.quota(dataset.name)
        # A sampling mix is priced at its largest answer: an estimate that errs long.
        max_tokens = config.max_tokens_for(dataset)
        mean, source = _answer_tokens(records, dataset.name, max_tokens)
        on_policy = dataset.multi_turn == "on_policy"
        turns = (turns_by_dataset or {}).get(dataset.name) if on_policy else 1.0
        datasets.append(
            DatasetPreview(
                dataset=dataset.name,
                prompts=prompts,
                samples_per_prompt=sampling.samples_per_prompt,
                on_policy=on_policy,
                turns_per_conversation=turns,
                max_tokens=max_tokens,
                mean_answer_tokens=mean,
                answer_source=source,
            )
        )
    rate, rate_source, detail = _rate(config, records, plan, gpus)
    return CostPreview(
        model=model,
        engine=engine,
        datasets=datasets,
        output_tokens_per_s=rate,
        rate_source=rate_source,
        rate_detail=detail,
        gpus=gpus,
        overheads=run_overheads(config, records),
    )


def fleet_gpus(config: RunConfig) -> int | None:
    """GPUs the fleet will hold, as far as is known without halting anything (None: unknown).

    The configured servers times their tensor parallelism when both are set, else every GPU nvidia-smi lists
    (the planner's default uses them all); external servers and a box without GPUs hold none.
    """
    from datagen.engines import engine_class

    if not engine_class(config.fleet.engine).launches_processes:
        return 0
    if config.fleet.num_servers and config.fleet.tensor_parallel:
        return config.fleet.num_servers * config.fleet.tensor_parallel
    from datagen.host.nvidia_smi import parse_gpu_query_csv, query_gpu_memory

    listing = query_gpu_memory()
    if listing is None:
        return 0
    gpus, _ = parse_gpu_query_csv(listing)
    return len(gpus)


def count_prompts_and_turns(config: RunConfig) -> tuple[dict[str, int], dict[str, float]]:
    """Read the datasets whose counts the config does not give: each is read once, if at all.

    The run's later filters (language, existing corpus, prompt length) may drop a few more prompts: an upper bound.

    Returns:
        The prompts of every dataset without a quota (rows that normalise, deduplicated), and the mean turns per
        conversation of every on-policy dataset (over all its prompts: a quota samples them evenly).
    """
    from datagen.prompts.datasets.inspect import inspect_dataset

    quotas = plan_mix(config)
    prompts: dict[str, int] = {}
    turns: dict[str, float] = {}
    for dataset in config.datasets:
        unbounded = quotas.quota(dataset.name) is None
        on_policy = dataset.multi_turn == "on_policy"
        if not unbounded and not on_policy:
            continue
        report = inspect_dataset(dataset.format, dataset.path, multi_turn=dataset.multi_turn)
        if unbounded:
            prompts[dataset.name] = report.prompts
        if on_policy:
            turns[dataset.name] = report.mean_turns
    return prompts, turns


def preview_on_this_box(
    config: RunConfig,
    *,
    prompts_by_dataset: Mapping[str, int] | None = None,
    count_unbounded: bool = False,
) -> CostPreview:
    """:func:`estimate_cost` of ``config`` with this box's history and GPUs (halts and starts nothing).

    Args:
        config: The resolved run config.
        prompts_by_dataset: The prepared prompts per dataset, when known.
        count_unbounded: Read the datasets without a quota to count their prompts, and the on-policy ones to
            count their turns (else those stay unknown and the figures are a lower bound): the CLI and preflight
            do, before anything is halted.
    """
    from datagen.app.history import read_history
    from datagen.settings import get_settings

    turns_by_dataset: dict[str, float] | None = None
    if count_unbounded:
        counted, turns_by_dataset = count_prompts_and_turns(config)
        prompts_by_dataset = prompts_by_dataset if prompts_by_dataset is not None else counted
    return estimate_cost(
        config,
        read_history(get_settings().state_dir),
        prompts_by_dataset=prompts_by_dataset,
        turns_by_dataset=turns_by_dataset,
        gpus=fleet_gpus(config),
    )
