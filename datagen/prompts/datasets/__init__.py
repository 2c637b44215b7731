"""Read prompt datasets in their published layouts and normalise every row to neutral chat messages.

:mod:`~datagen.prompts.datasets.sources` streams raw rows from files; one module per family of layouts turns a
row into :class:`NormalisedPrompt` objects or a :class:`Rejection`; :mod:`~datagen.prompts.datasets.registry`
maps each :data:`datagen.config.DatasetFormat` to its normaliser.
"""

from datagen.prompts.datasets.model import REJECTION_REASONS, NormalisedPrompt, Rejection, RejectionReason
from datagen.prompts.datasets.registry import FORMATS, NORMALISERS, get_normaliser, normalise_row
from datagen.prompts.datasets.sources import SourceRow, iter_rows, resolve_files

__all__ = [
    "FORMATS",
    "NORMALISERS",
    "REJECTION_REASONS",
    "NormalisedPrompt",
    "Rejection",
    "RejectionReason",
    "SourceRow",
    "get_normaliser",
    "iter_rows",
    "normalise_row",
    "resolve_files",
]
