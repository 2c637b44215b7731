"""A dry read of a dataset for ``datagen datasets inspect``: what it would yield, and what it rejects."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from datagen.config import MultiTurnPolicy
from datagen.conversation_turns import split_conversation
from datagen.prompts.datasets.identity import prompt_id_for
from datagen.prompts.datasets.model import Rejection
from datagen.prompts.datasets.registry import get_normaliser, normalise_row
from datagen.prompts.datasets.sources import iter_rows
from datagen.prompts.datasets.tally import RejectionTally, excerpt

PROMPT_SAMPLES = 3
PREVIEW_CHARS = 200


class InspectReport(BaseModel):
    """What reading a dataset gives, without writing anything.

    Attributes:
        format: The dataset format.
        path: Where it was read from.
        rows_read: Rows read (up to ``limit``).
        prompts: Distinct prompts produced.
        turns: Requests each sample of those prompts makes, summed: with ``multi_turn: on_policy`` a prompt is a
            conversation of one request per turn the target answers; otherwise one request per prompt.
        rejections: Rejected rows or prompts, by reason (duplicates included).
        rejection_samples: A few examples per reason.
        samples: The first few prompts, as JSON data.

    """

    model_config = ConfigDict(extra="forbid")

    format: str
    path: str
    multi_turn: MultiTurnPolicy
    rows_read: int
    prompts: int
    turns: int
    rejections: dict[str, int] = Field(default_factory=dict)
    rejection_samples: list[dict[str, Any]] = Field(default_factory=list)
    samples: list[dict[str, Any]] = Field(default_factory=list)

    @property
    def mean_turns(self) -> float:
        """Requests per prompt and sample (1 unless on-policy; 1 without prompts)."""
        return self.turns / self.prompts if self.prompts else 1.0

    def to_text(self) -> str:
        """A human-readable summary for the terminal."""
        lines = [
            f"dataset {self.path} (format {self.format}, multi_turn {self.multi_turn})",
            f"  rows read: {self.rows_read}",
            f"  prompts:   {self.prompts}",
        ]
        if self.multi_turn == "on_policy":
            lines.append(
                f"  turns:     {self.turns} (requests per sample, {self.mean_turns:.2f} per conversation)"
            )
        if self.rejections:
            lines.append("  rejected:")
            lines.extend(f"    {reason}: {count}" for reason, count in self.rejections.items())
        for sample in self.samples:
            messages = sample.get("messages", [])
            roles = " > ".join(str(message.get("role")) for message in messages)
            last = messages[-1].get("content") if messages else ""
            tools = sample.get("tools") or []
            lines.append(f"  sample row {sample.get('source_index')}: {roles}; {len(tools)} tool(s)")
            lines.append(f"    {excerpt(last, PREVIEW_CHARS)}")
        for rejection in self.rejection_samples:
            lines.append(
                f"  rejected row {rejection['source_index']} ({rejection['reason']}): {rejection['detail']}"
            )
        return "\n".join(lines)


def inspect_dataset(
    format: str, path: str, limit: int | None = None, multi_turn: MultiTurnPolicy = "last_turn"
) -> InspectReport:
    """Read a dataset, normalise and deduplicate it, and report counts and samples; writes nothing.

    Args:
        format: The dataset format (a :data:`datagen.config.DatasetFormat`).
        path: A file, directory, glob or s3:// URL.
        limit: Read at most this many rows.
        multi_turn: The multi-turn policy.

    Returns:
        The report (``model_dump`` for JSON, :meth:`InspectReport.to_text` for people).

    Raises:
        DatasetError: Unknown format, or the location holds no readable dataset.

    """
    get_normaliser(format)
    tally = RejectionTally()
    seen: set[str] = set()
    samples: list[dict[str, Any]] = []
    rows_read = 0
    turns = 0
    for row in iter_rows(path, limit=limit):
        rows_read += 1
        if row.error is not None:
            tally.add("malformed", row.error, row.index)
            continue
        result = normalise_row(format, row.data, row.index, multi_turn)
        if isinstance(result, Rejection):
            tally.add(result.reason, result.detail, row.index, row.data)
            continue
        for prompt in result:
            prompt_id = prompt_id_for(prompt.messages, prompt.tools)
            if prompt_id in seen:
                tally.add("duplicate", f"same content as prompt {prompt_id}", row.index)
                continue
            seen.add(prompt_id)
            turns += split_conversation(prompt.messages).turns if multi_turn == "on_policy" else 1
            if len(samples) < PROMPT_SAMPLES:
                samples.append(prompt.model_dump(mode="json", exclude_none=True))
    return InspectReport(
        format=format,
        path=path,
        multi_turn=multi_turn,
        rows_read=rows_read,
        prompts=len(seen),
        turns=turns,
        rejections=tally.as_dict(),
        rejection_samples=tally.samples,
        samples=samples,
    )
