"""Counting rejections by reason, keeping a few truncated examples of each for the summary."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from datagen.prompts.datasets.model import RejectionReason

SAMPLES_PER_REASON = 5
SAMPLE_MAX_CHARS = 300  # a sample shows the shape of the problem, not the whole row


def excerpt(value: Any, limit: int = SAMPLE_MAX_CHARS) -> str:
    """A short JSON excerpt of ``value`` for a report."""
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RejectionTally:
    """Counts per reason and up to :data:`SAMPLES_PER_REASON` examples of each."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.samples: list[dict[str, Any]] = []
        self._sampled: Counter[str] = Counter()

    def add(
        self,
        reason: RejectionReason,
        detail: str,
        source_index: int,
        example: Any = None,
        *,
        example_text: str | None = None,
    ) -> None:
        """Count one rejection; keep it as a sample while its reason has fewer than the limit.

        Args:
            reason: Why it was rejected.
            detail: A short explanation.
            source_index: The row number.
            example: The rejected value, shown as a short JSON excerpt in its sample.
            example_text: An excerpt already made (by :func:`excerpt`, in a worker), used as it is.
        """
        self.counts[reason] += 1
        if self._sampled[reason] < SAMPLES_PER_REASON:
            self._sampled[reason] += 1
            sample: dict[str, Any] = {
                "reason": reason,
                "detail": detail[:SAMPLE_MAX_CHARS],
                "source_index": source_index,
            }
            if example is not None:
                sample["example"] = excerpt(example)
            elif example_text is not None:
                sample["example"] = example_text
            self.samples.append(sample)

    def as_dict(self) -> dict[str, int]:
        """The counts, sorted by reason."""
        return dict(sorted(self.counts.items()))
