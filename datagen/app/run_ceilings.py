"""The ceilings a deployed run's choices meet: the box's operator sets them, the run stays under them.

A run's sampling choices reach every request it sends and its ``samples_per_prompt`` multiplies them, so one
trigger could keep training halted for days. The config's ``run_choices:`` section
(:class:`datagen.config.RunChoicesConfig`) caps what a run may choose; where it says nothing, the ceiling is
what the config itself plans (its context, its own samples per prompt). A choice over a ceiling is refused in
one line naming the choice and the ceiling; a run at or under every ceiling is unchanged.
"""

from __future__ import annotations

import math
from typing import Final

from datagen.config import RunConfig
from datagen.engines.model_size import read_model_shape

# Where a refusal tells the operator the ceilings live.
CEILINGS_SECTION: Final = "run_choices"


def planned_context_tokens(config: RunConfig) -> int | None:
    """The context a request of ``config`` may fill: ``model.max_model_len_tokens``, else the model's own.

    The model's own is ``max_position_embeddings`` of its local ``config.json``; None when neither is known
    (a hub id, an unreadable folder).
    """
    if config.model.max_model_len_tokens:
        return config.model.max_model_len_tokens
    try:
        shape = read_model_shape(config.model.path)
    except ValueError:
        return None
    return shape.max_position_embeddings if shape is not None else None


def _vocab_size(config: RunConfig) -> int | None:
    try:
        shape = read_model_shape(config.model.path)
    except ValueError:
        return None
    return shape.vocab_size if shape is not None else None


def planned_prompts(config: RunConfig) -> float:
    """The most prompts ``config`` may take: ``mix.total_prompts``, else its datasets' quotas summed.

    A dataset without a quota takes all of its rows: unbounded (``math.inf``).
    """
    if config.mix.total_prompts is not None:
        return float(config.mix.total_prompts)
    quotas = [dataset.max_prompts for dataset in config.datasets]
    return math.inf if any(quota is None for quota in quotas) else float(sum(q or 0 for q in quotas))


def choice_problems(
    box: RunConfig,
    resolved: RunConfig,
    *,
    max_tokens: int | None,
    top_k: int | None,
    samples_per_prompt: int | None,
) -> list[str]:
    """What a run's choices ask beyond the ceilings of its box config, one line each (none: all fit).

    Args:
        box: The box's config as its file says, before the run's choices.
        resolved: The config with the run's choices applied (its budget is checked).
        max_tokens: The run's ``sampling.max_tokens`` choice, if any.
        top_k: The run's ``sampling.top_k`` choice, if any.
        samples_per_prompt: The run's ``sampling.samples_per_prompt`` choice, if any.
    """
    ceilings = box.run_choices
    problems: list[str] = []
    if samples_per_prompt is not None:
        most = ceilings.max_samples_per_prompt or box.sampling.samples_per_prompt
        if samples_per_prompt > most:
            problems.append(
                f"sampling.samples_per_prompt: at most {most} on this box ({CEILINGS_SECTION}.max_samples_per_"
                "prompt, else the config's own sampling.samples_per_prompt): choose fewer, or ask the box's "
                "operator to raise the ceiling"
            )
    if max_tokens is not None:
        context = planned_context_tokens(box)
        most = ceilings.max_tokens or context or box.sampling.max_tokens
        if context is not None:
            most = min(most, context)
        if max_tokens > most:
            problems.append(
                f"sampling.max_tokens: at most {most} on this box ({CEILINGS_SECTION}.max_tokens, bounded by the "
                "planned context): choose fewer"
            )
    if top_k is not None:
        vocab = _vocab_size(box)
        if vocab is not None and top_k > vocab:
            problems.append(
                f"sampling.top_k: at most {vocab}, the model's vocabulary (a larger one samples among every "
                "token all the same): choose fewer, or leave it unset"
            )
    budget = ceilings.max_prompts
    if budget is not None:
        planned = planned_prompts(resolved)
        if planned > budget:
            planned_text = (
                "every row of a dataset without a quota" if math.isinf(planned) else f"{planned:.0f}"
            )
            problems.append(
                f"max_prompts: this run would plan {planned_text} prompts, over this box's budget of {budget} "
                f"({CEILINGS_SECTION}.max_prompts): pass max_prompts to stay under it"
            )
    return problems


__all__ = ["CEILINGS_SECTION", "choice_problems", "planned_context_tokens", "planned_prompts"]
