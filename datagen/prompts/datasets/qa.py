"""Single question/answer rows: WebInstructSub, CodeFeedback-Filtered-Instruction, MetaMathQA.

Each row becomes one prompt holding the question as the user turn; the answer is what is regenerated,
so it is dropped (and never required: a row with only a question is still a prompt).
"""

from __future__ import annotations

from typing import Any

from datagen.config import MultiTurnPolicy
from datagen.prompts.datasets.model import NormalisedPrompt
from datagen.prompts.datasets.turns import build_prompts, require_row, require_text, text_turn


def _question_prompt(
    row: Any, index: int, policy: MultiTurnPolicy, question_key: str, metadata_keys: tuple[str, ...]
) -> list[NormalisedPrompt]:
    data = require_row(row)
    question = require_text(data.get(question_key), f"field {question_key!r}")
    metadata = {
        key: data[key] for key in metadata_keys if isinstance(data.get(key), str | int | float | bool)
    }
    return build_prompts([text_turn("user", question)], policy=policy, source_index=index, metadata=metadata)


def normalise_webinstruct(row: Any, index: int, policy: MultiTurnPolicy) -> list[NormalisedPrompt]:
    """TIGER-Lab/WebInstructSub: ``question``, ``answer``, ``source`` (maybe ``index``)."""
    return _question_prompt(row, index, policy, "question", ("source", "index"))


def normalise_codefeedback_filtered(row: Any, index: int, policy: MultiTurnPolicy) -> list[NormalisedPrompt]:
    """m-a-p/CodeFeedback-Filtered-Instruction: ``query``, ``answer`` (maybe ``resource``, ``lang``).

    ``lang`` is the programming language, kept as metadata, never used by the language filter.
    """
    return _question_prompt(row, index, policy, "query", ("resource", "lang"))


def normalise_metamath(row: Any, index: int, policy: MultiTurnPolicy) -> list[NormalisedPrompt]:
    """meta-math/MetaMathQA: ``query``, ``response``, ``type``, ``original_question``."""
    return _question_prompt(row, index, policy, "query", ("type",))
