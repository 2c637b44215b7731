"""The run report: per-dataset counts, tokens, throughput, failures and the resulting mix.

Built from the small summaries the stages return (never by re-reading the data), rendered as JSON and
markdown into the run folder and, by the flow, as Prefect artifacts.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import textwrap
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from datagen.config import RunConfig
from datagen.errors import OutputExistsError
from datagen.escape import markdown_block, markdown_code, markdown_location, markdown_text
from datagen.output.layout import RunLayout
from datagen.output.store import Store
from datagen.progress import output_tokens_per_s
from datagen.records import DatasetMix, GenerationCounts, MixRow, PreparedDataset, ShardSummary, utc_now

# The widest line of a command block in the report: Prefect's UI cuts a longer line of a code block off (its
# artifact page's column is about this wide at 1600 px), so commands wrap an option per line, comments by word.
COMMAND_BLOCK_CHARS = 72
# How a command line of ``training`` carries a remark: ``command   # remark`` (what the CLI prints).
_REMARK = "   # "


def command_block_lines(line: str) -> list[str]:
    """One shell line as the report's code block shows it: narrow, and still pasting as the same command.

    A remark (``# ...`` alone, or after the command) becomes comment lines above it, wrapped by word. A
    command longer than :data:`COMMAND_BLOCK_CHARS` gets one option (``--flag value`` or ``key=value``) per
    line, joined by backslash continuations; a line still too long (a long path) is folded after a ``/``
    with a backslash-newline, which the shell removes, so the path pastes whole.
    """
    command, _, remark = line.partition(_REMARK) if not line.startswith("#") else ("", "", line[1:])
    lines = textwrap.wrap(
        remark.strip(), COMMAND_BLOCK_CHARS - 2, initial_indent="# ", subsequent_indent="# "
    )
    command = command.strip()
    if not command:
        return lines
    if len(command) <= COMMAND_BLOCK_CHARS:
        return [*lines, command]
    groups: list[list[str]] = []
    for word in command.split():
        if not groups or word.startswith("-") or ("=" in word and not groups[-1][-1].startswith("-")):
            groups.append([word])
        else:
            groups[-1].append(word)
    rendered = [("    " if index else "") + " ".join(group) for index, group in enumerate(groups)]
    for index, text in enumerate(rendered):
        last = index == len(rendered) - 1
        lines += _folded(text if last else f"{text} \\")
    return lines


def _folded(text: str) -> list[str]:
    """``text`` cut into lines of at most :data:`COMMAND_BLOCK_CHARS`, each cut a backslash-newline.

    Cuts go after the last ``/`` (else space) that fits, never inside the indentation; the pieces after a cut
    start at the first column, since the shell joins them to the word before (a space would split it).
    """
    pieces: list[str] = []
    indent = len(text) - len(text.lstrip(" "))
    while len(text) > COMMAND_BLOCK_CHARS:
        room = COMMAND_BLOCK_CHARS - 1  # the backslash
        cut = max(text.rfind("/", indent, room) + 1, text.rfind(" ", indent, room) + 1)
        if cut <= indent:
            cut = room
        pieces.append(text[:cut] + "\\")
        text, indent = text[cut:], 0
    return [*pieces, text]


class DatasetReport(GenerationCounts):
    """Counts of one dataset through every stage (generation's summed over its shards)."""

    dataset: str
    category: str | None = None
    rows_read: int = 0
    prompts: int = 0
    quota: int | None = Field(default=None, description="Prompts the mix asked of this dataset.")
    shortfall: int = Field(default=0, description="Quota minus prompts, when the dataset had too few.")
    rejections: dict[str, int] = Field(default_factory=dict)
    shards: int = 0
    tokenized_rows: int = 0


class RunAccounting(BaseModel):
    """What the run cost the training job, measured, beside what the preview expected.

    Computed from the attempts' records (:mod:`datagen.app.accounting`); every figure sums all attempts.
    """

    model_config = ConfigDict(extra="forbid")

    gpus: int = Field(default=0, ge=0, description="GPUs the fleet held (the largest of any attempt).")
    gpu_hours: float = Field(default=0.0, ge=0, description="GPUs held from halt to restart, in hours.")
    training_paused_s: float = Field(default=0.0, ge=0, description="Halt to restart of training, summed.")
    generation_wall_s: float = Field(default=0.0, ge=0, description="Of which the GPUs generated.")
    generating_share: float | None = Field(
        default=None, ge=0, description="Generation wall time over the paused time (None: nothing paused)."
    )
    output_tokens_per_gpu_hour: float | None = Field(default=None, ge=0)
    estimated_training_paused_s: float | None = Field(
        default=None, ge=0, description="The preview's estimate before the first halt."
    )
    estimated_gpu_hours: float | None = Field(default=None, ge=0)
    estimated_output_tokens_per_s: float | None = Field(default=None, ge=0)

    def lines(self) -> list[str]:
        """The accounting as short lines: measured first, the estimate beside it."""
        estimate = (
            f" (estimated {self.estimated_training_paused_s / 3600:.2f} h)"
            if self.estimated_training_paused_s is not None
            else ""
        )
        gpu_estimate = (
            f" (estimated {self.estimated_gpu_hours:.2f})" if self.estimated_gpu_hours is not None else ""
        )
        share = "-" if self.generating_share is None else f"{self.generating_share:.1%}"
        per_gpu_hour = (
            "-" if self.output_tokens_per_gpu_hour is None else f"{self.output_tokens_per_gpu_hour:,.0f}"
        )
        return [
            f"training paused: {self.training_paused_s / 3600:.2f} h{estimate}",
            f"GPU-hours: {self.gpu_hours:.2f} on {self.gpus} GPU(s){gpu_estimate}",
            f"GPUs generating: {share} of the paused time",
            f"output tokens per GPU-hour: {per_gpu_hour}",
        ]


class RunReport(BaseModel):
    """The whole run in numbers."""

    model_config = ConfigDict(extra="forbid")

    run_id: str
    config_hash: str
    created_at: dt.datetime = Field(default_factory=utc_now)
    engine: str
    servers: int
    generation_wall_s: float = Field(description="Generation wall time summed over every attempt of the run.")
    generation_attempts: int = Field(default=1, description="Attempts that generated (interrupted ones too).")
    output_tokens_per_s: float = Field(
        description="Output tokens of every completion over the generation wall time of every attempt."
    )
    datasets: list[DatasetReport]
    totals: DatasetReport
    tokenize: dict[str, Any] = Field(default_factory=dict)
    mix: dict[str, float] = Field(default_factory=dict, description="Share of tokenized rows per dataset.")
    mix_by_category: list[MixRow] = Field(
        default_factory=list, description="Target, new, existing and combined mix per category."
    )
    rejection_samples: dict[str, list[dict[str, Any]]] = Field(default_factory=dict)
    hosts: list[str] = Field(default_factory=list, description="Multi-host runs: the hosts that served.")
    lost_hosts: dict[str, str] = Field(
        default_factory=dict,
        description="Multi-host runs: hosts lost mid-run, and why (their requests went on).",
    )
    training: list[str] = Field(
        default_factory=list,
        description="The commands that train SpecForge and speculators on this run's dataset version.",
    )
    training_job: list[str] = Field(
        default_factory=list,
        description="What the halts and restarts of the training job could not do or check, over every attempt.",
    )
    accounting: RunAccounting | None = Field(
        default=None,
        description="GPU-hours, paused training and the preview's estimate (None: not measured).",
    )

    def table_rows(self) -> list[dict[str, Any]]:
        """One flat row per dataset plus a total row, for a table artifact."""
        rows = []
        for item in [*self.datasets, self.totals]:
            rows.append(
                {
                    "dataset": item.dataset,
                    "prompts": item.prompts,
                    "rejected": sum(item.rejections.values()),
                    "requests": item.requests,
                    "completions": item.completions,
                    "failures": item.failures,
                    "output_tokens": item.completion_tokens,
                    "tokenized_rows": item.tokenized_rows,
                    "resent": item.resent_requests,
                    "retries": item.retried_attempts,
                }
            )
        return rows

    def to_markdown(self, locations: RunLocations | None = None) -> str:
        """A readable report: where it landed (when given), headline figures, the table, failures, rejections."""
        lines = [
            f"# datagen run {markdown_code(self.run_id)}",
            "",
            *(locations.markdown() if locations else []),
            f"- engine: **{markdown_text(self.engine)}**, servers: **{self.servers}**",
            f"- generation wall time: **{self.generation_wall_s:.1f} s** over {self.generation_attempts} "
            "attempt(s), "
            f"throughput: **{self.output_tokens_per_s:.1f} output tok/s**",
            f"- completions: **{self.totals.completions}** of {self.totals.requests} requests, "
            f"failures: **{self.totals.failures}**, re-sent after interruption: {self.totals.resent_requests}",
            *(
                [
                    f"- on-policy conversations: **{self.totals.conversations}** (their turns are requests above), "
                    f"every turn answered: **{self.totals.conversations_completed}**"
                ]
                if self.totals.conversations
                else []
            ),
            *([f"- hosts: {', '.join(markdown_text(host) for host in self.hosts)}"] if self.hosts else []),
            *[
                f"- **host lost: {markdown_text(name)}** ({markdown_text(reason)})"
                for name, reason in sorted(self.lost_hosts.items())
            ],
            f"- tokenized rows: **{self.totals.tokenized_rows}**"
            + (f", loss tokens: {self.tokenize.get('loss_tokens')}" if "loss_tokens" in self.tokenize else "")
            + (
                f" (one row per on-policy conversation: {self.tokenize['turns_in_conversation_rows']} earlier "
                "turns are inside their conversation's row)"
                if self.tokenize.get("turns_in_conversation_rows")
                else ""
            ),
            "",
            "| dataset | prompts | rejected | requests | completions | failures | output tokens | rows | mix |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for item in self.datasets:
            share = self.mix.get(item.dataset, 0.0)
            lines.append(
                f"| {markdown_text(item.dataset)} | {item.prompts} | {sum(item.rejections.values())} | {item.requests} | "
                f"{item.completions} | {item.failures} | {item.completion_tokens} | {item.tokenized_rows} | "
                f"{share:.1%} |"
            )
        total = self.totals
        lines.append(
            f"| **total** | {total.prompts} | {sum(total.rejections.values())} | {total.requests} | "
            f"{total.completions} | {total.failures} | {total.completion_tokens} | {total.tokenized_rows} | "
            "100% |"
        )
        lines += self._mix_markdown()
        if total.failure_reasons:
            lines += ["", "## Failures by reason", ""]
            lines += [_count_line(reason, count) for reason, count in sorted(total.failure_reasons.items())]
        if total.rejections:
            lines += ["", "## Rejected dataset rows by reason", ""]
            lines += [_count_line(reason, count) for reason, count in sorted(total.rejections.items())]
        if total.finish_reasons:
            lines += ["", "## Finish reasons", ""]
            lines += [_count_line(reason, count) for reason, count in sorted(total.finish_reasons.items())]
        if total.sampling_settings:
            # Setting names belong to their dataset (two datasets may both have a `cold`): listed per dataset.
            lines += ["", "## Completions by sampling setting", ""]
            lines += [
                _count_line(f"{item.dataset} / {name}", count)
                for item in self.datasets
                for name, count in sorted(item.sampling_settings.items())
            ]
        dropped = self.tokenize.get("dropped_by_reason") or {}
        if dropped:
            lines += ["", "## Completions not tokenized, by reason", ""]
            lines += [_count_line(reason, count) for reason, count in sorted(dropped.items())]
        if self.accounting is not None:
            lines += ["", "## Cost", ""]
            lines += [f"- {markdown_text(line)}" for line in self.accounting.lines()]
        if self.training_job:
            lines += ["", "## Training job", ""]
            lines += [f"- {markdown_text(note)}" for note in self.training_job]
        if self.training:
            block = [wrapped for line in self.training for wrapped in command_block_lines(line)]
            lines += ["", "## Training on this version", "", *markdown_block(block, "bash")]
        return "\n".join(lines) + "\n"

    def _mix_markdown(self) -> list[str]:
        if not self.mix_by_category:
            return []

        def share(value: float | None) -> str:
            return "-" if value is None else f"{value:.1%}"

        lines = [
            "",
            "## Mix by category",
            "",
            "Prompts against the configured target; training rows of the new data, the existing corpus, "
            "and both together.",
            "",
            "| category | target prompts | target share | new prompts | new share | shortfall | new rows "
            "| new row share | existing rows | combined rows | combined share |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in self.mix_by_category:
            target = "-" if row.target_prompts is None else str(row.target_prompts)
            lines.append(
                f"| {markdown_text(row.category)} | {target} | {share(row.target_share)} | {row.prompts} | "
                f"{share(row.prompt_share)} | {row.shortfall} | {row.rows} | {share(row.row_share)} | "
                f"{row.existing_rows} | {row.combined_rows} | {share(row.combined_share)} |"
            )
        short = [item for item in self.datasets if item.shortfall]
        if short:
            lines += ["", "Datasets short of their quota (not enough valid prompts):", ""]
            lines += [
                f"- {markdown_text(item.dataset)}: {item.prompts} of {item.quota} (short by {item.shortfall})"
                for item in short
            ]
        return lines


def _add_counts(target: dict[str, int], source: dict[str, int]) -> None:
    for key, value in source.items():
        target[key] = target.get(key, 0) + value


def build_report(
    *,
    run_id: str,
    config: RunConfig,
    prepared: list[PreparedDataset],
    shards: list[ShardSummary],
    tokenize_summary: dict[str, Any] | None,
    servers: int,
    generation_wall_s: float,
    dataset_mix: Sequence[DatasetMix],
    mix_by_category: Sequence[MixRow],
    generation_attempts: int = 1,
    hosts: Sequence[str] = (),
    lost_hosts: Mapping[str, str] | None = None,
    training_job: Sequence[str] = (),
) -> RunReport:
    """Assemble the report from the stages' summaries.

    Args:
        run_id: The run.
        config: The run's config (engine, dataset categories).
        prepared: One summary per dataset from prepare_prompts.
        shards: Every shard summary from generate_shard.
        tokenize_summary: The merge-and-tokenize summary as a dict (``rows_by_dataset`` is used when present).
        servers: How many servers generated.
        generation_wall_s: Wall time from the first request to the last result, summed over every attempt
            of the run (:func:`generation_time_over_attempts`): the completions counted are every attempt's.
        generation_attempts: How many attempts that time adds up.
        dataset_mix: Each dataset's quota and shortfall (:func:`datagen.prompts.mix.dataset_mix`).
        mix_by_category: The mix table (:func:`datagen.prompts.mix.mix_table`); the mix is computed by the
            prompts stage, the report only shows it.
        hosts: Multi-host runs: the hosts that served (any attempt).
        lost_hosts: Multi-host runs: hosts lost mid-run -> why.
        training_job: What the training job's halts and restarts could not do or check (their notes).
    """
    by_name = {
        dataset.name: DatasetReport(dataset=dataset.name, category=dataset.category)
        for dataset in config.datasets
    }
    samples: dict[str, list[dict[str, Any]]] = {}
    for item in prepared:
        report = by_name[item.dataset]
        report.rows_read = item.rows_read
        report.prompts = item.prompts
        report.rejections = dict(item.rejections)
        report.shards = len(item.shards)
        if item.rejection_samples:
            samples[item.dataset] = item.rejection_samples
    for entry in dataset_mix:
        by_name[entry.dataset].quota = entry.quota
        by_name[entry.dataset].shortfall = entry.shortfall
    for shard in shards:
        by_name[shard.dataset].add(shard)
    rows_by_dataset: dict[str, int] = dict((tokenize_summary or {}).get("rows_by_dataset") or {})
    for name, rows in rows_by_dataset.items():
        if name in by_name:
            by_name[name].tokenized_rows = rows
    totals = DatasetReport(dataset="total")
    for report in by_name.values():
        totals.add(report)
        for field in ("rows_read", "prompts", "shards", "tokenized_rows"):
            setattr(totals, field, getattr(totals, field) + getattr(report, field))
        _add_counts(totals.rejections, report.rejections)
    from datagen.dataset.export import summary_training_lines

    training = summary_training_lines(tokenize_summary or {}, config.model.tokenizer)
    mix_counts = Counter({name: report.tokenized_rows for name, report in by_name.items()})
    total_rows = sum(mix_counts.values())
    mix = {name: (count / total_rows if total_rows else 0.0) for name, count in mix_counts.items()}
    return RunReport(
        run_id=run_id,
        config_hash=config.config_hash(),
        engine=config.fleet.engine,
        servers=servers,
        generation_wall_s=generation_wall_s,
        generation_attempts=generation_attempts,
        output_tokens_per_s=output_tokens_per_s(totals.completion_tokens, generation_wall_s),
        datasets=list(by_name.values()),
        totals=totals,
        tokenize=dict(tokenize_summary or {}),
        mix=mix,
        mix_by_category=list(mix_by_category),
        rejection_samples=samples,
        hosts=list(hosts),
        lost_hosts=dict(lost_hosts or {}),
        training=training,
        training_job=list(training_job),
    )


def _count_line(reason: str, count: int) -> str:
    """One ``- reason: count`` bullet; a reason may be a server's or a dataset's text, so it is shown as text."""
    return f"- {markdown_text(reason)}: {count}"


class RunLocations(BaseModel):
    """Where a run's outputs landed, for the report artifact and the run's final state message."""

    model_config = ConfigDict(extra="forbid")

    run_folder: str
    report_md: str
    manifest: str
    dataset_version: str | None = Field(default=None, description="The version record's key in the store.")
    dataset_version_url: str | None = Field(default=None, description="The version's JSON record.")

    @property
    def export_command(self) -> str | None:
        """The command that writes the JSONL both trainers read (None before a version exists)."""
        return f"datagen export {self.dataset_version_url}" if self.dataset_version_url else None

    def markdown(self) -> list[str]:
        """The report's "where it landed" bullets (its first lines, before the headline figures)."""
        lines = [
            f"- run folder: {markdown_location(self.run_folder)}",
            f"- report: {markdown_location(self.report_md)}",
            f"- manifest: {markdown_location(self.manifest)}",
        ]
        if self.dataset_version_url:
            lines.append(f"- dataset version: {markdown_location(self.dataset_version_url)}")
        if self.export_command:
            lines.append(f"- export: {markdown_code(self.export_command)}")
        return lines

    def message(self) -> str:
        """One line for the run's final state message."""
        parts = [f"run folder {self.run_folder}", f"report {self.report_md}", f"manifest {self.manifest}"]
        if self.dataset_version_url:
            parts.append(f"dataset version {self.dataset_version_url}")
        if self.export_command:
            parts.append(f"export: {self.export_command}")
        return "; ".join(parts)


def run_locations(store: Store, layout: RunLayout, report: RunReport) -> RunLocations:
    """Where ``report``'s run landed in ``store``: its folder, report, manifest and dataset version."""
    return RunLocations(
        run_folder=store.url(layout.root),
        report_md=store.url(layout.report_md),
        manifest=store.url(layout.manifest),
        dataset_version=report.tokenize.get("dataset_version"),
        dataset_version_url=report.tokenize.get("dataset_version_url"),
    )


class RunSummary(BaseModel):
    """What the `expand` flow returns (and the CLI prints): where the run landed and its headline counts."""

    model_config = ConfigDict(extra="forbid")

    run_id: str
    run_url: str
    already_complete: bool
    prompts: int
    requests: int
    completions: int
    failures: int
    tokenized_rows: int
    output_tokens_per_s: float
    dataset_version: str | None
    report_url: str
    manifest_url: str
    dataset_version_url: str | None = None
    training: list[str] = Field(
        default_factory=list, description="The trainers' commands on the dataset version (from the report)."
    )
    training_job: list[str] = Field(
        default_factory=list, description="What the halt and restart of training could not do or check."
    )
    accounting: RunAccounting | None = Field(
        default=None,
        description="GPU-hours and paused training, with the preview's estimate (from the report).",
    )

    @classmethod
    def of_report(
        cls, report: RunReport, store: Store, layout: RunLayout, *, already_complete: bool
    ) -> RunSummary:
        """The summary of a run whose report is ``report``, its locations in ``store``."""
        return cls(
            run_id=layout.run_id,
            run_url=store.url(layout.root),
            already_complete=already_complete,
            prompts=report.totals.prompts,
            requests=report.totals.requests,
            completions=report.totals.completions,
            failures=report.totals.failures,
            tokenized_rows=report.totals.tokenized_rows,
            output_tokens_per_s=report.output_tokens_per_s,
            dataset_version=report.tokenize.get("dataset_version"),
            report_url=store.url(layout.report_md),
            manifest_url=store.url(layout.manifest),
            dataset_version_url=report.tokenize.get("dataset_version_url"),
            training=report.training,
            training_job=report.training_job,
            accounting=report.accounting,
        )

    def locations(self) -> RunLocations:
        """Where the run landed."""
        return RunLocations(
            run_folder=self.run_url,
            report_md=self.report_url,
            manifest=self.manifest_url,
            dataset_version=self.dataset_version,
            dataset_version_url=self.dataset_version_url,
        )

    def state_message(self) -> str:
        """The run's final state message: its headline counts, then where everything landed."""
        head = (
            "already complete, nothing regenerated"
            if self.already_complete
            else f"{self.completions} completions of {self.requests} requests ({self.failures} failed), "
            f"{self.tokenized_rows} training rows, {self.output_tokens_per_s:.1f} output tok/s"
        )
        if self.accounting is not None and not self.already_complete:
            head += "; " + ", ".join(self.accounting.lines())
        return f"{head}; {self.locations().message()}"


GENERATION_RECORD = "generation.json"


class GenerationWindow(BaseModel):
    """How long one flow attempt generated (``attempts/<attempt>/generation.json``)."""

    model_config = ConfigDict(extra="forbid")

    attempt_id: str
    wall_s: float = Field(ge=0)
    servers: int = 0
    interrupted: bool = Field(default=False, description="The attempt ended early (signal, crash, failure).")
    hosts: list[str] = Field(default_factory=list, description="Multi-host runs: the hosts that served.")
    lost_hosts: dict[str, str] = Field(
        default_factory=dict, description="Multi-host runs: hosts lost during this attempt, and why."
    )


def record_generation_window(store: Store, layout: RunLayout, window: GenerationWindow) -> None:
    """Store how long this attempt generated, once (a rerun of the same attempt keeps the first record)."""
    with contextlib.suppress(OutputExistsError):
        store.write_json(layout.attempt_object(window.attempt_id, GENERATION_RECORD), window)


def _generation_windows(store: Store, layout: RunLayout) -> list[GenerationWindow]:
    """The generation record of every attempt folder of the run (one level: attempts/<attempt>/)."""
    keys = (f"{folder}/{GENERATION_RECORD}" for folder in store.list_level(layout.attempts_prefix).folders)
    return [GenerationWindow.model_validate(store.read_json(key)) for key in keys if store.exists(key)]


def hosts_over_attempts(store: Store, layout: RunLayout) -> tuple[list[str], dict[str, str]]:
    """Multi-host runs: every host that served in any attempt, and every host lost (with why), by name."""
    served: set[str] = set()
    lost: dict[str, str] = {}
    for window in _generation_windows(store, layout):
        served.update(window.hosts)
        lost.update(
            {name: f"{reason} (attempt {window.attempt_id})" for name, reason in window.lost_hosts.items()}
        )
    return sorted(served), lost


def generation_time_over_attempts(store: Store, layout: RunLayout) -> tuple[float, int]:
    """The generation wall time of every attempt of the run, summed, and how many attempts generated.

    A resumed run's completions come from several attempts; its throughput is their tokens over this sum,
    not over the last attempt's time (which may be zero when only the merge was left).
    """
    windows = _generation_windows(store, layout)
    return sum(window.wall_s for window in windows), len(windows)
