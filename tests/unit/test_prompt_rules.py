"""The chain of prompt rules: order decides the reason, duplicates are remembered, the quota sample."""

from __future__ import annotations

from datagen.prompts.datasets.model import NormalisedPrompt
from datagen.prompts.rules import (
    Candidate,
    CorpusRule,
    DuplicateRule,
    QuotaRule,
    first_rejection,
    prompt_rules,
)
from datagen.records import Message, PromptRecord


def candidate(text: str, *, language: str | None = None, index: int = 0) -> Candidate:
    prompt = NormalisedPrompt(
        messages=[Message(role="user", content=text)], language=language, source_index=index
    )
    return Candidate.of(prompt, seed=0, dataset="d")


def test_a_candidate_carries_the_record_of_its_shard_line() -> None:
    item = candidate("What is 2 + 2?", language="en", index=3)
    assert item.record() == PromptRecord(
        prompt_id=item.prompt_id,
        dataset="d",
        messages=[Message(role="user", content="What is 2 + 2?")],
        source_index=3,
        metadata={"turn_index": 0, "language": "en"},
    )
    assert item.preview == "What is 2 + 2?"


def test_the_chain_runs_language_corpus_duplicate_quota_length_in_order() -> None:
    rules = prompt_rules(languages=["en"], corpus_ids=set(), excluded=set(), quota=QuotaRule(1), length=None)
    assert [rule.name for rule in rules] == ["language", "corpus", "duplicate", "quota"]
    bare = prompt_rules(languages=None, corpus_ids=set(), excluded=set(), quota=None, length=None)
    assert [rule.name for rule in bare] == ["corpus", "duplicate"]


def test_the_first_rule_that_rejects_names_the_reason() -> None:
    in_corpus = candidate("What is 2 + 2?", language="fr")
    rules = prompt_rules(
        languages=["en"], corpus_ids={in_corpus.prompt_id}, excluded=set(), quota=None, length=None
    )
    rejection = first_rejection(rules, in_corpus)
    assert rejection is not None and rejection.reason == "wrong_language"
    english = candidate("What is 2 + 2?", language="en-us")
    rejection = first_rejection(rules, english)
    assert rejection is not None and rejection.reason == "in_existing_corpus"
    assert rejection.example == "What is 2 + 2?"


def test_a_prompt_is_remembered_by_the_duplicate_rule_even_when_a_later_rule_rejects_it() -> None:
    duplicates = DuplicateRule(excluded=set())
    first, again = candidate("Name a prime."), candidate("Name a prime.", index=1)
    assert duplicates.check(first) is None
    rejection = duplicates.check(again)
    assert rejection is not None and rejection.reason == "duplicate"
    assert "of this dataset" in rejection.detail
    earlier = DuplicateRule(excluded={first.prompt_id}).check(first)
    assert earlier is not None and "earlier dataset of the run" in earlier.detail


def test_the_quota_sample_keeps_the_smallest_priorities_and_returns_what_it_pushes_out() -> None:
    items = [candidate(f"question {n}", index=n) for n in range(6)]
    sample = QuotaRule(2)
    pushed_out = []
    for item in items:
        if sample.check(item) is None:
            out = sample.take(item)
            if out is not None:
                pushed_out.append(out.prompt_id)
    smallest = sorted(items, key=lambda item: item.priority)[:2]
    drawn = sample.drawn_in_source_order()
    assert [r.prompt_id for r in drawn] == [
        i.prompt_id for i in sorted(smallest, key=lambda i: i.source_index)
    ]
    assert not set(pushed_out) & {r.prompt_id for r in drawn}
    rejection = sample.check(max(items, key=lambda item: item.priority))
    assert rejection is not None and rejection.reason == "over_cap"


def test_corpus_rule_passes_prompts_the_corpus_lacks() -> None:
    assert CorpusRule(corpus_ids={"elsewhere"}).check(candidate("new")) is None
