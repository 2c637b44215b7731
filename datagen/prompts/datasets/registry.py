"""The normaliser of every dataset format, and :func:`normalise_row`, which never raises on a bad row."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, get_args

from datagen.config import DatasetFormat, MultiTurnPolicy
from datagen.errors import DatasetError
from datagen.prompts.datasets.hermes import normalise_hermes_fc
from datagen.prompts.datasets.model import NormalisedPrompt, Rejection, RowRejected
from datagen.prompts.datasets.openai import normalise_code_feedback, normalise_openai_messages
from datagen.prompts.datasets.qa import (
    normalise_codefeedback_filtered,
    normalise_metamath,
    normalise_webinstruct,
)
from datagen.prompts.datasets.sharegpt import (
    normalise_agentinstruct,
    normalise_infinity_instruct,
    normalise_sharegpt,
)
from datagen.prompts.datasets.toucan import normalise_toucan

logger = logging.getLogger(__name__)

Normaliser = Callable[[Any, int, MultiTurnPolicy], list[NormalisedPrompt]]
DETAIL_MAX_CHARS = 300  # keep rejection details short: they land in summaries and logs

NORMALISERS: Mapping[str, Normaliser] = {
    "infinity_instruct": normalise_infinity_instruct,
    "webinstruct": normalise_webinstruct,
    "codefeedback_filtered": normalise_codefeedback_filtered,
    "code_feedback": normalise_code_feedback,
    "metamath": normalise_metamath,
    "hermes_fc": normalise_hermes_fc,
    "agentinstruct": normalise_agentinstruct,
    "toucan": normalise_toucan,
    "sharegpt": normalise_sharegpt,
    "openai_messages": normalise_openai_messages,
}
FORMATS: tuple[str, ...] = get_args(DatasetFormat)
assert set(NORMALISERS) == set(FORMATS), "every DatasetFormat needs a normaliser"


def get_normaliser(format: str) -> Normaliser:
    """The normaliser of ``format``.

    Raises:
        DatasetError: The format is unknown; the message lists the known ones.

    """
    try:
        return NORMALISERS[format]
    except KeyError:
        raise DatasetError(f"Unknown dataset format {format!r}; use one of: {', '.join(FORMATS)}") from None


def normalise_row(
    format: str, row: Any, index: int = 0, policy: MultiTurnPolicy = "last_turn"
) -> list[NormalisedPrompt] | Rejection:
    """Normalise one dataset row; every failure becomes a counted :class:`Rejection`, never an exception.

    Args:
        format: The dataset format (a :data:`datagen.config.DatasetFormat`).
        row: The raw row as read from the file (any JSON value).
        index: The row number, carried into prompts and rejections.
        policy: The multi-turn policy.

    Returns:
        One prompt or more (``every_turn`` may give several), or the reason the row was rejected.

    Raises:
        DatasetError: Only for an unknown ``format`` (a configuration error, not a bad row).

    """
    normaliser = get_normaliser(format)
    try:
        prompts = normaliser(row, index, policy)
    except RowRejected as rejected:
        return Rejection(
            reason=rejected.reason, detail=rejected.detail[:DETAIL_MAX_CHARS], source_index=index
        )
    except Exception as error:  # a row nobody anticipated must still be counted, not crash the run
        logger.debug("row index=%d rejected by unexpected error=%r", index, error)
        return Rejection(
            reason="malformed",
            detail=f"{type(error).__name__}: {error}"[:DETAIL_MAX_CHARS],
            source_index=index,
        )
    if not prompts:
        return Rejection(reason="empty", detail="the row produced no prompt", source_index=index)
    return prompts
