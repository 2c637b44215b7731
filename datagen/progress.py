"""A run's progress as a person reads it: the stage it is in, generation so far, and output throughput.

The progress artifact, the progress log line and the run report all compute output tok/s with
:func:`output_tokens_per_s` over the generation wall time (from the start of generation, not from the first
request sent), so the figure a person watches and the one the report keeps agree.

A run announces where it is here, and nowhere else: :func:`enter_stage` logs the ``stage=<name>`` line (the run
log, Prefect's log, a plain terminal) and tells the watchers; :func:`report_progress` tells them how far
generation is, :func:`report_work` how far a long step is (tokenizing, exporting, a tuning sweep). A watcher (the
live terminal view, :mod:`datagen.app.runview`; a command's bars, :mod:`datagen.app.bars`) registers itself for a
block with :func:`watching` and is told the events it has a method for; the work never knows who watches, and
work nobody watches pays nothing for it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from enum import StrEnum
from typing import Any, Protocol

from pydantic import BaseModel, Field

_logger = logging.getLogger(__name__)


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
    total: int = Field(
        description="Requests of the run (prompts times samples; each turn of an on-policy conversation is one)."
    )
    failed: int = 0
    conversations: int = Field(default=0, ge=0, description="On-policy conversations of the run (0: none).")
    conversations_done: int = Field(
        default=0,
        ge=0,
        description="On-policy conversations over so far (their last turn answered or ended).",
    )
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
    window_left_s: float | None = Field(
        default=None,
        description="Time left until the window ends and training must run again (None: no window).",
    )
    window_closing: bool = Field(
        default=False,
        description="Admission stopped for the window's end: no new request, the requests in flight finish.",
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
        """One line, the essentials first (the log line): ``62.5% · 200/320 answered · ...``.

        The cost so far and the window follow when the flow filled them.
        """
        return " · ".join(
            [
                f"{self.percent:.1f}% · {self.answered}/{self.total} answered",
                *self.conversation_lines(),
                f"{self.tokens_per_s:.1f} output tok/s · ETA {self.eta_text} · {self.failed} failed",
                f"{format_duration(self.elapsed_s)} elapsed",
                *self.cost_lines(),
            ]
        )

    @property
    def gpu_hours(self) -> float:
        """GPU-hours the run has held so far: the fleet's GPUs times the time training has been stopped."""
        return self.gpus * (self.training_paused_s or 0.0) / 3600

    def cost_line(self) -> str:
        """What the run has cost training so far: ``paused 1 h 2 min · 8.3 GPU-h``."""
        return f"paused {format_duration(self.training_paused_s or 0.0)} · {self.gpu_hours:.1f} GPU-h"

    def window_line(self) -> str:
        """The window: ``window 2 h 5 min left``, ``... · draining`` once admission stopped for its end."""
        left = f"window {format_duration(max(0.0, self.window_left_s or 0.0))} left"
        return f"{left} · draining" if self.window_closing else left

    def conversation_lines(self) -> list[str]:
        """``3/20 conversations done`` when the run has on-policy conversations (each turn one request)."""
        if not self.conversations:
            return []
        return [f"{self.conversations_done}/{self.conversations} conversations done"]

    def cost_lines(self) -> list[str]:
        """The cost so far and the window, each only when the flow filled it."""
        return [
            *([self.cost_line()] if self.training_paused_s is not None else []),
            *([self.window_line()] if self.window_left_s is not None else []),
        ]

    def card(self, detail: str = "") -> str:
        """The same figures as short Markdown lines, the essentials first, for the progress artifact's card.

        Prefect's UI draws an artifact's description on its card one line per paragraph and cuts each line off
        at the card's edge (about 40 characters at 1600 px): so one short paragraph per pair of figures,
        ``detail`` (the dispatcher's queues) last.
        """
        lines = [
            f"**{self.percent:.1f}%** · {self.answered}/{self.total} answered",
            *self.conversation_lines(),
            f"{self.tokens_per_s:.1f} output tok/s · ETA {self.eta_text}",
            f"{self.failed} failed · {format_duration(self.elapsed_s)} elapsed",
            *self.cost_lines(),
            *([detail] if detail else []),
        ]
        return "\n\n".join(lines)


class Stage(StrEnum):
    """The steps of a run, in the order a run on one box takes them; the value is its ``stage=`` log marker."""

    PREFLIGHT = "preflight"
    PREPARE_PROMPTS = "prepare-prompts"
    GPU_LOCK = "gpu-lock"
    HALT_TRAINING = "halt-training"
    PROBE = "probe"
    PLAN = "plan"
    START_SERVERS = "start-servers"
    GENERATE = "generate"
    STOP_SERVERS = "stop-servers"
    MERGE_AND_TOKENIZE = "merge-and-tokenize"
    REPORT = "report"
    MANIFEST = "manifest"


class WorkProgress(BaseModel):
    """A long step's progress in countable units (files tokenized, parts exported, levels measured)."""

    what: str = Field(description="What is being done, as a bar's label: `tokenize`, `export`.")
    done: int = Field(ge=0)
    total: int = Field(ge=0)
    unit: str = Field(description="What ``done`` and ``total`` count, plural: `files`, `parts`, `levels`.")
    detail: str = Field(default="", description="One short figure beside the bar, e.g. the rows so far.")


class StageWatcher(Protocol):
    """Follows the stages a run enters (the live terminal view's checklist)."""

    def stage_entered(self, stage: Stage) -> None:
        """The run has entered ``stage`` (the one before it is over)."""


class GenerationWatcher(Protocol):
    """Follows generation (the live terminal view's bar); told often while generating, so kept cheap."""

    def generation_progressed(self, progress: GenerationProgress) -> None:
        """Generation so far."""


class WorkWatcher(Protocol):
    """Follows a long step (a run's merge, a corpus adoption, an export, a tuning sweep)."""

    def work_progressed(self, progress: WorkProgress) -> None:
        """The step so far."""


# Whoever follows this process's work: each watcher is told the events it has a method for, and no others.
RunWatcher = StageWatcher | GenerationWatcher | WorkWatcher

_watchers: list[RunWatcher] = []
_watchers_lock = threading.Lock()


@contextlib.contextmanager
def watching(watcher: RunWatcher) -> Iterator[RunWatcher]:
    """Tell ``watcher`` the events it follows that any run of this process announces (from any thread) in the block."""
    with _watchers_lock:
        _watchers.append(watcher)
    try:
        yield watcher
    finally:
        with _watchers_lock:
            _watchers.remove(watcher)


def _tell_watchers(event: str, value: Any) -> None:
    with _watchers_lock:
        watchers = list(_watchers)
    for watcher in watchers:
        told = getattr(watcher, event, None)
        if told is None:  # not an event this watcher follows
            continue
        try:
            told(value)
        except Exception:  # a view is for humans: never worth failing a run over
            _logger.debug("run watcher failed event=%s", event, exc_info=True)


def enter_stage(logger: logging.Logger | logging.LoggerAdapter[Any], stage: Stage, **facts: object) -> None:
    """Say the run entered ``stage``: its ``stage=<name> key=value ...`` log line, and every watcher.

    Args:
        logger: The run's logger (the line goes where the run's other lines go).
        stage: The stage entered.
        **facts: Said on the line after the stage, in order.
    """
    logger.info("stage=%s%s", stage.value, "".join(f" {key}={value}" for key, value in facts.items()))
    _tell_watchers("stage_entered", stage)


def report_progress(progress: GenerationProgress) -> None:
    """Tell every watcher how far generation is (the log line and the artifact keep their own pace)."""
    _tell_watchers("generation_progressed", progress)


def report_work(progress: WorkProgress) -> None:
    """Tell every watcher how far a long step is."""
    _tell_watchers("work_progressed", progress)
