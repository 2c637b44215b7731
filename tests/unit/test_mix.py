"""The mix plan: quotas from counts and shares, category caps, shortfalls, rebalance, the mix table."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

from datagen.config import RunConfig, parse_run_config
from datagen.dataset.report import build_report
from datagen.errors import ConfigError
from datagen.prompts.mix import (
    apportion,
    dataset_mix,
    effective_quotas,
    mix_table,
    plan_mix,
    quota_for,
    validate_mix,
)
from datagen.records import PreparedDataset


def dataset(name: str, category: str | None = None, **quota: Any) -> dict[str, Any]:
    item: dict[str, Any] = {"name": name, "format": "metamath", "path": f"/data/{name}.json", **quota}
    if category is not None:
        item["category"] = category
    return item


def config(datasets: list[dict[str, Any]], **extra: Any) -> RunConfig:
    return parse_run_config({"model": {"path": "/m"}, "datasets": datasets, "output": "/out", **extra})


def prepared(name: str, prompts: int) -> PreparedDataset:
    return PreparedDataset(dataset=name, rows_read=prompts, prompts=prompts)


def test_apportion_adds_up_exactly_and_is_proportional() -> None:
    assert apportion(100, [Fraction(1, 3)] * 3) == [34, 33, 33]
    assert apportion(10, [Fraction(0), Fraction(1)]) == [0, 10]
    assert apportion(0, [Fraction(1)]) == [0]
    parts = apportion(1000, [Fraction(7), Fraction(2), Fraction(1)])
    assert parts == [700, 200, 100]


def test_shares_of_the_total_become_quotas_that_add_up_to_it() -> None:
    plan = plan_mix(
        config(
            [
                dataset("a", "chat", share=0.29),
                dataset("b", "math", share=0.29),
                dataset("c", "code", share=0.42),
                dataset("d", "tools", max_prompts=50),
            ],
            mix={"total_prompts": 1000},
        )
    )
    assert [plan.quota(name) for name in "abcd"] == [290, 290, 420, 50]
    assert plan.category_targets() == {"chat": 290, "math": 290, "code": 420, "tools": 50}
    shares = plan.target_shares()
    assert shares is not None and shares["code"] == pytest.approx(420 / 1050)


def test_a_category_cap_lowers_only_that_category_split_by_request() -> None:
    plan = plan_mix(
        config(
            [
                dataset("py", "code", max_prompts=600),
                dataset("js", "code", max_prompts=200),
                dataset("gsm", "math", max_prompts=150),
                dataset("chat", max_prompts=50),
            ],
            mix={"category_caps": {"code": 0.2}},
        )
    )
    # code may be 20% of the new data: 200 others -> 250 in all, 50 of them code, split 3:1.
    assert [plan.quota(name) for name in ("py", "js", "gsm", "chat")] == [38, 12, 150, 50]
    assert plan.capped_categories == ["code"]
    targets = plan.category_targets()
    assert targets["code"] == 50 and targets["uncategorised"] == 50


def test_capping_one_category_can_push_another_over_its_cap() -> None:
    plan = plan_mix(
        config(
            [
                dataset("code", "code", max_prompts=800),
                dataset("math", "math", max_prompts=150),
                dataset("chat", "chat", max_prompts=100),
            ],
            mix={"category_caps": {"code": 0.5, "math": 0.3}},
        )
    )
    # code capped: 250 others -> 500 in all; math is then exactly 30% of 500, at its cap, not over it.
    assert (plan.quota("code"), plan.quota("math"), plan.quota("chat")) == (250, 150, 100)
    tighter = plan_mix(
        config(
            [
                dataset("code", "code", max_prompts=800),
                dataset("math", "math", max_prompts=150),
                dataset("chat", "chat", max_prompts=100),
            ],
            mix={"category_caps": {"code": 0.5, "math": 0.2}},
        )
    )
    # code capped -> 500 in all, math 150 > 20% of 500 -> capped too: chat 100 is the other 30%,
    # 333.3 in all, code 166, math 66.
    assert (tighter.quota("code"), tighter.quota("math"), tighter.quota("chat")) == (166, 66, 100)
    assert tighter.capped_categories == ["code", "math"]


def test_a_cap_that_does_not_bind_changes_nothing() -> None:
    plan = plan_mix(
        config(
            [dataset("code", "code", share=0.2), dataset("math", "math", share=0.8)],
            mix={"total_prompts": 500, "category_caps": {"code": 0.25}},
        )
    )
    assert (plan.quota("code"), plan.quota("math")) == (100, 400)
    assert plan.capped_categories == []


@pytest.mark.parametrize(
    ("datasets", "mix", "message"),
    [
        ([dataset("a", share=0.5)], {}, "mix.total_prompts is unset"),
        ([dataset("a", max_prompts=5)], {"total_prompts": 10}, "no dataset sets `share`"),
        ([dataset("a", share=0.7), dataset("b", share=0.4)], {"total_prompts": 10}, "add up to 1.1"),
        ([dataset("a", share=0.5, max_prompts=3)], {"total_prompts": 10}, "both max_prompts and share"),
        ([dataset("a", "code", max_prompts=3)], {"category_caps": {"cod": 0.2}}, "no dataset has: cod"),
        ([dataset("a", "code", max_prompts=3), dataset("b")], {"category_caps": {"code": 0.2}}, "none on: b"),
        ([dataset("a", "code", max_prompts=3)], {"category_caps": {"code": 1.5}}, "less than or equal to 1"),
    ],
)
def test_inconsistent_mix_settings_are_refused_with_the_fix(
    datasets: list[dict[str, Any]], mix: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        config(datasets, mix=mix)


def test_caps_that_cannot_all_hold_are_refused_by_the_mix_check_not_by_loading() -> None:
    run = config([dataset("a", "code", max_prompts=3)], mix={"category_caps": {"code": 0.5}})
    with pytest.raises(ConfigError, match="cannot all hold"):
        validate_mix(run)


def test_without_rebalance_a_shortfall_is_reported_not_moved() -> None:
    run = config([dataset("a", "math", max_prompts=100), dataset("b", "math", max_prompts=100)])
    assert effective_quotas(run, {"a": 60, "b": 100}) == {"a": 100, "b": 100}
    entries = dataset_mix(run, [prepared("a", 60), prepared("b", 100)])
    assert [(e.dataset, e.quota, e.shortfall) for e in entries] == [("a", 100, 40), ("b", 100, 0)]


def test_rebalance_moves_a_shortfall_to_the_next_datasets_of_the_same_category() -> None:
    run = config(
        [
            dataset("a", "math", max_prompts=100),
            dataset("x", "code", max_prompts=100),
            dataset("b", "math", max_prompts=100),
            dataset("c", "math", max_prompts=100),
        ],
        mix={"rebalance": True},
    )
    a = run.dataset("a")
    b = run.dataset("b")
    c = run.dataset("c")
    assert quota_for(run, a, []) == 100
    assert quota_for(run, b, [prepared("a", 60), prepared("x", 10)]) == 140  # not code's shortfall
    assert quota_for(run, c, [prepared("a", 60), prepared("x", 10), prepared("b", 120)]) == 120
    with pytest.raises(ConfigError, match="prepare them first"):
        quota_for(run, c, [prepared("a", 60)])


def test_mix_table_compares_new_and_combined_data_with_the_target() -> None:
    run = config(
        [
            dataset("code", "code", share=0.2),
            dataset("math", "math", share=0.4),
            dataset("chat", "chat", share=0.4),
        ],
        mix={"total_prompts": 1000},
        existing_corpus={"category_counts": {"code": 694_540, "math": 120_000, "agent": 87_460}},
    )
    summaries = [prepared("code", 200), prepared("math", 350), prepared("chat", 400)]
    rows = {"code": 200, "math": 700, "chat": 400}  # math sampled twice per prompt
    table = {row.category: row for row in mix_table(run, summaries, rows)}
    assert list(table) == ["code", "math", "chat", "agent"]
    assert (table["math"].target_prompts, table["math"].prompts, table["math"].shortfall) == (400, 350, 50)
    assert table["math"].target_share == pytest.approx(0.4)
    assert table["math"].prompt_share == pytest.approx(350 / 950)
    assert table["code"].combined_rows == 694_740
    assert table["code"].combined_share == pytest.approx(694_740 / (902_000 + 1300))
    assert (table["agent"].target_prompts, table["agent"].existing_rows, table["agent"].rows) == (
        None,
        87_460,
        0,
    )

    report = build_report(
        run_id="r1",
        config=run,
        prepared=summaries,
        shards=[],
        tokenize_summary={"rows_by_dataset": rows},
        servers=0,
        generation_wall_s=0.0,
        dataset_mix=dataset_mix(run, summaries),
        mix_by_category=mix_table(run, summaries, rows),
    )
    assert report.mix_by_category == list(table.values())
    math = next(item for item in report.datasets if item.dataset == "math")
    assert (math.quota, math.shortfall) == (400, 50)
    markdown = report.to_markdown()
    assert "## Mix by category" in markdown
    assert "| code | 200 | 20.0% | 200 | 21.1% | 0 | 200 |" in markdown
    assert "- math: 350 of 400 (short by 50)" in markdown


def test_caps_count_what_the_series_already_holds() -> None:
    run = config(
        [dataset("chat", "chat", max_prompts=100), dataset("code", "code", max_prompts=100)],
        mix={"category_caps": {"code": 0.5}},
    )
    assert plan_mix(run).quota("code") == 100  # 100 of 200: at its cap, not over
    # The series already holds 300 code and 100 chat prompts: code may be at most half of
    # 100 + 100 (chat) + 300 + new code, so no new code at all.
    held = {"code": 300, "chat": 100}
    assert plan_mix(run, held).quota("code") == 0
    assert plan_mix(run, held).quota("chat") == 100
    # Holding only a little code leaves room for some: (100 + 50 + c) / 2 >= 50 + c  ->  c = 50.
    assert plan_mix(run, {"code": 50}).quota("code") == 50
    assert quota_for(run, run.dataset("code"), [], {"code": 50}) == 50
