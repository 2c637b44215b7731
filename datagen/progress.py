"""A run's generation progress as a person reads it, and the one definition of output throughput.

The progress artifact, the progress log line and the run report all compute output tok/s with
:func:`output_tokens_per_s` over the generation wall time (from the start of generation, not from the first
request sent), so the figure a person watches and the one the report keeps agree.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


def output_tokens_per_s(output_tokens: int, wall_s: float) -> float:
    """Output tokens over the generation wall time that produced them (0 before any time has passed)."""
    return output_tokens / wall_s if wall_s > 0 else 0.0


def format_duration(seconds: float) -> str:
    """``45 s``, ``3 min 5 s``, ``2 h 4 min``: short enough for a card, precise enough for an ETA."""
    total = round(seconds)
    if total < 60:
        return f"{total} s"
    if total < 3600:
        return f"{total // 60} min {total % 60} s"
    return f"{total // 3600} h {total % 3600 // 60} min"


class GenerationProgress(BaseModel):
    """Generation so far: what the progress artifact, its log line and the run page show."""

    answered: int = Field(description="Requests answered: completions and recorded failures.")
    total: int = Field(description="Requests of the run (prompts times samples).")
    failed: int = 0
    output_tokens: int = Field(default=0, description="Output tokens of the completions so far.")
    elapsed_s: float = Field(default=0.0, description="Generation wall time so far.")
    gpus: int = Field(default=0, ge=0, description="GPUs the fleet holds (0: none counted).")
    training_paused_s: float | None = Field(
        default=None, ge=0, description="Time since training was halted (None: not halted by this attempt)."
    )
    answered_here: int | None = Field(
        default=None,
        description="Requests this attempt answered (None: all of ``answered``). A resumed run's stored answers "
        "count in ``answered`` but took none of ``elapsed_s``: the ETA's rate leaves them out.",
    )

    @property
    def percent(self) -> float:
        """Share of requests answered, 0-100."""
        return min(100.0, 100.0 * self.answered / self.total) if self.total else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Output tok/s, defined as the report defines it (:func:`output_tokens_per_s`)."""
        return output_tokens_per_s(self.output_tokens, self.elapsed_s)

    @property
    def eta_s(self) -> float | None:
        """Seconds left at this attempt's answer rate (0 when done, None before its first answer)."""
        left = max(0, self.total - self.answered)
        if not left:
            return 0.0
        answered = self.answered if self.answered_here is None else self.answered_here
        if answered <= 0 or self.elapsed_s <= 0:
            return None
        return left / (answered / self.elapsed_s)

    @property
    def eta_text(self) -> str:
        """The ETA as a person reads it: ``3 min 5 s``, ``done``, or ``unknown`` before the first answer."""
        eta = self.eta_s
        return "done" if eta == 0 else ("unknown" if eta is None else format_duration(eta))

    def line(self) -> str:
        """One line, the essentials first (the log line): ``62.5% · 200/320 answered · ...``."""
        return (
            f"{self.percent:.1f}% · {self.answered}/{self.total} answered · "
            f"{self.tokens_per_s:.1f} output tok/s · ETA {self.eta_text} · {self.failed} failed · "
            f"{format_duration(self.elapsed_s)} elapsed"
        )

    def cost_line(self) -> str:
        """What the run has cost training so far: ``paused 1 h 2 min · 8.3 GPU-h``."""
        paused = self.training_paused_s or 0.0
        return f"paused {format_duration(paused)} · {self.gpus * paused / 3600:.1f} GPU-h"

    def card(self, detail: str = "") -> str:
        """The same figures as short Markdown lines, the essentials first, for the progress artifact's card.

        Prefect's UI draws an artifact's description on its card one line per paragraph and cuts each line off
        at the card's edge (about 40 characters at 1600 px): so one short paragraph per pair of figures,
        ``detail`` (the dispatcher's queues) last.
        """
        lines = [
            f"**{self.percent:.1f}%** · {self.answered}/{self.total} answered",
            f"{self.tokens_per_s:.1f} output tok/s · ETA {self.eta_text}",
            f"{self.failed} failed · {format_duration(self.elapsed_s)} elapsed",
            *([self.cost_line()] if self.training_paused_s is not None else []),
            *([detail] if detail else []),
        ]
        return "\n\n".join(lines)
