"""The mix of the new prompts: per-dataset quotas, category caps, shortfalls, and the mix table.

A dataset's *requested* quota is its ``max_prompts``, or its ``share`` of ``mix.total_prompts`` (shares
are apportioned by largest remainder, so quotas add up exactly). ``mix.category_caps`` then lower the
quotas of every category that would be more than its cap of the new prompts: the capped categories are
found by water-filling (capping one shrinks the total, which may push another over its cap), and each
capped category's quota is split over its datasets in proportion to their requests. Caps never raise a
quota, so the total may end below ``total_prompts``. Caps hold for the plan: when another category falls
short, the capped category's share of what was actually prepared ends above its cap, and the report
shows it.

All of this is a pure function of the config (:func:`plan_mix`), so every dataset's quota is known
before any dataset is read. A dataset with fewer valid prompts than its quota reports a *shortfall*;
with ``mix.rebalance`` the shortfall moves to the next datasets of the same category in config order
(:func:`quota_for` then needs the counts of those earlier datasets), otherwise it is only reported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction

from pydantic import BaseModel, ConfigDict, Field

from datagen.config import DatasetConfig, RunConfig
from datagen.errors import ConfigError
from datagen.records import DatasetMix, MixRow, PreparedDataset


class DatasetQuota(BaseModel):
    """The planned quota of one dataset.

    Attributes:
        dataset: The dataset name.
        category: Its mix category.
        requested: ``max_prompts`` or its apportioned share of ``total_prompts``; None: no quota.
        quota: ``requested`` after the category caps.

    """

    model_config = ConfigDict(extra="forbid")

    dataset: str
    category: str
    requested: int | None
    quota: int | None


class MixPlan(BaseModel):
    """Every dataset's quota and the resulting target per category, from the config alone."""

    model_config = ConfigDict(extra="forbid")

    datasets: list[DatasetQuota]
    capped_categories: list[str] = Field(default_factory=list, description="Categories a cap lowered.")

    def quota(self, dataset: str) -> int | None:
        """The planned quota of ``dataset`` (None: take every valid prompt)."""
        for item in self.datasets:
            if item.dataset == dataset:
                return item.quota
        raise ConfigError(f"no dataset named {dataset!r} in the mix plan", name=dataset)

    def category_targets(self) -> dict[str, int | None]:
        """Planned prompts per category; None for a category holding a dataset without a quota."""
        targets: dict[str, int | None] = {}
        for item in self.datasets:
            current = targets.get(item.category, 0)
            if current is None or item.quota is None:
                targets[item.category] = None
            else:
                targets[item.category] = current + item.quota
        return targets

    def target_shares(self) -> dict[str, float] | None:
        """Planned share of the new prompts per category; None unless every dataset has a quota."""
        targets = self.category_targets()
        if any(value is None for value in targets.values()):
            return None
        counts = {category: value or 0 for category, value in targets.items()}
        total = sum(counts.values())
        return {category: (count / total if total else 0.0) for category, count in counts.items()}


def apportion(total: int, weights: Sequence[Fraction]) -> list[int]:
    """Split ``total`` into integers proportional to ``weights`` (largest remainder; ties to the first).

    Args:
        total: What to split (>= 0).
        weights: Non-negative weights, not all zero unless ``total`` is 0.

    Returns:
        One integer per weight, adding up to ``total``.

    """
    weight_sum = sum(weights, Fraction(0))
    if total == 0 or weight_sum == 0:
        return [0] * len(weights)
    exact = [Fraction(total) * weight / weight_sum for weight in weights]
    floors = [math.floor(value) for value in exact]
    left = total - sum(floors)
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - floors[i]), i))
    for i in order[:left]:
        floors[i] += 1
    return floors


def _exact(value: float) -> Fraction:
    """The decimal the user wrote (0.3 is 3/10, not the nearest binary float)."""
    return Fraction(repr(value))


def _requested_quotas(config: RunConfig) -> dict[str, int | None]:
    requested: dict[str, int | None] = {d.name: d.max_prompts for d in config.datasets}
    shared = [d for d in config.datasets if d.share is not None]
    if shared and config.mix.total_prompts is not None:
        shares = [_exact(d.share or 0.0) for d in shared]
        share_total = round(sum(shares, Fraction(0)) * config.mix.total_prompts)
        for dataset, quota in zip(shared, apportion(share_total, shares), strict=True):
            requested[dataset.name] = quota
    return requested


def _cap_counts(
    requested_by_category: Mapping[str, int],
    caps: Mapping[str, float],
    held: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """The new prompt count of every category whose cap binds (water-filling; caps only lower counts).

    ``held`` are prompts a series already holds per category: a cap then bounds held + new against the
    series' total, so a category the series already has plenty of gets fewer new prompts (never below 0).
    """
    held = held or {}
    held_only = sum(count for category, count in held.items() if category not in requested_by_category)
    capped: set[str] = set()
    while True:
        uncapped_total = held_only + sum(
            count + held.get(category, 0)
            for category, count in requested_by_category.items()
            if category not in capped
        )
        cap_sum = sum((_exact(caps[category]) for category in capped), Fraction(0))
        if capped and (uncapped_total == 0 or cap_sum >= 1):
            raise ConfigError(
                "mix.category_caps cannot all hold: the capped categories "
                f"({', '.join(sorted(capped))}) would have to make up the whole mix. Raise a cap, or give "
                "an uncapped category some prompts."
            )
        total = Fraction(uncapped_total) / (1 - cap_sum)
        newly = {
            category
            for category, count in requested_by_category.items()
            if category in caps
            and category not in capped
            and count + held.get(category, 0) > _exact(caps[category]) * total
        }
        if not newly:
            return {
                category: max(0, math.floor(_exact(caps[category]) * total) - held.get(category, 0))
                for category in capped
            }
        capped |= newly


def plan_mix(config: RunConfig, held: Mapping[str, int] | None = None) -> MixPlan:
    """Every dataset's quota from ``max_prompts``, ``share`` x ``mix.total_prompts`` and the category caps.

    Args:
        config: The run config.
        held: Prompts per category an expansion series already holds (its ledger); the caps then bound
            the series' whole mix, not only this run's prompts.

    Returns:
        The plan; :meth:`MixPlan.quota` gives each dataset's quota.

    Raises:
        ConfigError: The caps cannot all hold.

    """
    requested = _requested_quotas(config)
    quotas = dict(requested)
    capped: dict[str, int] = {}
    if config.mix.category_caps and all(value is not None for value in requested.values()):
        by_category: dict[str, int] = {}
        for dataset in config.datasets:
            by_category[dataset.mix_category] = by_category.get(dataset.mix_category, 0) + (
                requested[dataset.name] or 0
            )
        capped = _cap_counts(by_category, config.mix.category_caps, held)
        for category, count in capped.items():
            members = [d for d in config.datasets if d.mix_category == category]
            weights = [Fraction(requested[d.name] or 0) for d in members]
            for dataset, quota in zip(members, apportion(count, weights), strict=True):
                quotas[dataset.name] = quota
    return MixPlan(
        datasets=[
            DatasetQuota(
                dataset=d.name,
                category=d.mix_category,
                requested=requested[d.name],
                quota=quotas[d.name],
            )
            for d in config.datasets
        ],
        capped_categories=sorted(capped),
    )


def validate_mix(config: RunConfig) -> MixPlan:
    """Check that the mix can be planned: every category cap can hold together with the others.

    The config model checks each mix setting on its own; this is the check across them, which needs the
    plan. Preflight and the CLI call it, so an impossible mix is refused before training is halted.

    Args:
        config: The run config.

    Returns:
        The plan.

    Raises:
        ConfigError: The caps cannot all hold; the message says which and what to change.

    """
    return plan_mix(config)


def effective_quotas(
    config: RunConfig, prompts_by_dataset: Mapping[str, int], held: Mapping[str, int] | None = None
) -> dict[str, int | None]:
    """Each dataset's quota once earlier shortfalls are moved on (``mix.rebalance``), in config order.

    Args:
        config: The run config.
        prompts_by_dataset: Prompts each prepared dataset produced; a dataset missing here stops the
            carrying of its category's shortfall (the later datasets of that category are left out).
        held: Prompts per category the run's series already holds (see :func:`plan_mix`).

    Returns:
        The quota of every dataset whose quota is known (None: no quota).

    """
    plan = plan_mix(config, held)
    carry: dict[str, int] = {}
    blocked: set[str] = set()
    quotas: dict[str, int | None] = {}
    for dataset in config.datasets:
        planned = plan.quota(dataset.name)
        category = dataset.mix_category
        if planned is None or not config.mix.rebalance:
            quotas[dataset.name] = planned
            continue
        if category in blocked:
            continue
        quota = planned + carry.get(category, 0)
        quotas[dataset.name] = quota
        if dataset.name in prompts_by_dataset:
            carry[category] = max(0, quota - prompts_by_dataset[dataset.name])
        else:
            blocked.add(category)
    return quotas


def quota_for(
    config: RunConfig,
    dataset: DatasetConfig,
    earlier: Sequence[PreparedDataset],
    held: Mapping[str, int] | None = None,
) -> int | None:
    """The quota of one dataset, given the summaries of the datasets prepared before it.

    Args:
        config: The run config.
        dataset: The dataset about to be prepared.
        earlier: Summaries of the datasets before it in config order (only read with ``rebalance``).
        held: Prompts per category the run's series already holds (see :func:`plan_mix`).

    Returns:
        How many prompts to take (None: every valid prompt).

    Raises:
        ConfigError: ``mix.rebalance`` is on and an earlier dataset of the same category is missing.

    """
    known = {item.dataset: item.prompts for item in earlier}
    quotas = effective_quotas(config, known, held)
    if dataset.name not in quotas:
        missing = [
            other.name
            for other in config.datasets[: config.datasets.index(dataset)]
            if other.mix_category == dataset.mix_category and other.name not in known
        ]
        raise ConfigError(
            f"mix.rebalance: the quota of dataset {dataset.name!r} depends on the earlier datasets of its "
            f"category; prepare them first and pass their summaries: {', '.join(missing)}",
            name=dataset.name,
        )
    return quotas[dataset.name]


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def dataset_mix(config: RunConfig, prepared: Sequence[PreparedDataset]) -> list[DatasetMix]:
    """The quota and shortfall of every prepared dataset.

    Args:
        config: The run config.
        prepared: The summaries of prepare_prompts.

    Returns:
        One entry per prepared dataset, in config order.

    """
    counts = {item.dataset: item.prompts for item in prepared}
    quotas = effective_quotas(config, counts)
    entries = []
    for dataset in config.datasets:
        if dataset.name not in counts:
            continue
        quota = quotas.get(dataset.name)
        prompts = counts[dataset.name]
        entries.append(
            DatasetMix(
                dataset=dataset.name,
                category=dataset.mix_category,
                quota=quota,
                prompts=prompts,
                shortfall=max(0, quota - prompts) if quota is not None else 0,
            )
        )
    return entries


def mix_table(
    config: RunConfig, prepared: Sequence[PreparedDataset], rows_by_dataset: Mapping[str, int]
) -> list[MixRow]:
    """The mix per category: target, new prompts and rows, existing rows, and the combined share.

    Args:
        config: The run config (plan, categories, ``existing_corpus.category_counts``).
        prepared: The summaries of prepare_prompts.
        rows_by_dataset: Tokenized training rows per dataset.

    Returns:
        One row per category (the config's categories in order, then existing-only ones, sorted).

    """
    plan = plan_mix(config)
    targets = plan.category_targets()
    target_shares = plan.target_shares()
    category_of = {d.name: d.mix_category for d in config.datasets}
    existing = config.existing_corpus.category_counts
    categories = list(dict.fromkeys([*(d.mix_category for d in config.datasets), *sorted(existing)]))
    prompts = dict.fromkeys(categories, 0)
    rows = dict.fromkeys(categories, 0)
    for item in prepared:
        prompts[category_of[item.dataset]] += item.prompts
    for name, count in rows_by_dataset.items():
        if name in category_of:
            rows[category_of[name]] += count
    total_prompts = sum(prompts.values())
    total_rows = sum(rows.values())
    total_combined = total_rows + sum(existing.values())
    table = []
    for category in categories:
        target = targets.get(category)
        combined = rows[category] + existing.get(category, 0)
        table.append(
            MixRow(
                category=category,
                target_prompts=target,
                target_share=target_shares.get(category) if target_shares is not None else None,
                prompts=prompts[category],
                prompt_share=_share(prompts[category], total_prompts),
                shortfall=max(0, target - prompts[category]) if target is not None else 0,
                rows=rows[category],
                row_share=_share(rows[category], total_rows),
                existing_rows=existing.get(category, 0),
                combined_rows=combined,
                combined_share=_share(combined, total_combined),
            )
        )
    return table
