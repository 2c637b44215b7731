"""The rules a normalised prompt passes before it is taken: language, corpus, duplicate, quota, length.

:func:`prompt_rules` builds the chain one dataset applies, in this order; :func:`first_rejection` runs a
candidate through it and returns the first rule's rejection (its reason is counted in the summary). The
order is part of the behaviour: the cheap checks run first, and the quota comes before the length check
because a prompt the sample would never draw need not be rendered with the chat template.

- :class:`LanguageRule` (``wrong_language``): the row's language is not in ``languages``.
- :class:`CorpusRule` (``in_existing_corpus``): the prompt is in ``existing_corpus.dedupe_against``.
- :class:`DuplicateRule` (``duplicate``): same content as an earlier prompt of this dataset or of an
  earlier dataset of the run. A prompt that passes is remembered, whatever later rules decide.
- :class:`QuotaRule` (``over_cap``): the seeded bottom-k sample of the quota would not draw it. It also
  holds the sample: :meth:`QuotaRule.take` keeps a passing prompt and returns the one it pushed out.
- :class:`LengthRule` (``template_error``, ``too_long``): the prompt, rendered with the target's chat
  template, is longer than ``max_prompt_tokens``.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Protocol

from datagen.dataset.tokenizer import TokenizerSpec, render_prompt
from datagen.prompts.datasets.identity import prompt_id_for
from datagen.prompts.datasets.model import NormalisedPrompt, RejectionReason
from datagen.records import PromptRecord

PRIORITY_BYTES = 8  # 64-bit sampling priorities: ties are practically impossible
PREVIEW_CHARS = 200


def sampling_priority(seed: int, prompt_id: str) -> int:
    """The seeded priority of a prompt in the quota's sample: the smallest ``k`` are drawn."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:PRIORITY_BYTES], "big")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A normalised prompt on its way through the rules, with everything the rules and the shards need.

    Built by :meth:`of` from a normalised prompt, in the process that reads the dataset (it may be a
    worker: a candidate pickles small).

    Attributes:
        prompt_id: The stable id of the prompt's content.
        priority: The prompt's priority in the quota's sample.
        language: The row's language, when the dataset records one.
        preview: The start of the last message, kept as a rejection sample.
        source_index: The row number in the dataset.
        turn_index: Which assistant turn of the row the prompt asks for.
        record_json: The prompt's :class:`~datagen.records.PromptRecord` as JSON (a line of its shard).
    """

    prompt_id: str
    priority: int
    language: str | None
    preview: str
    source_index: int
    turn_index: int
    record_json: str

    @classmethod
    def of(cls, prompt: NormalisedPrompt, seed: int, dataset: str = "") -> Candidate:
        """The candidate of ``prompt`` in dataset ``dataset`` of a run with seed ``seed``."""
        prompt_id = prompt_id_for(prompt.messages, prompt.tools)
        return cls(
            prompt_id=prompt_id,
            priority=sampling_priority(seed, prompt_id),
            language=prompt.language,
            preview=(prompt.messages[-1].content or "")[:PREVIEW_CHARS],
            source_index=prompt.source_index,
            turn_index=prompt.turn_index,
            record_json=prompt_record(prompt, prompt_id, dataset).model_dump_json(),
        )

    def record(self) -> PromptRecord:
        """The prompt's record, parsed from its JSON."""
        return PromptRecord.model_validate_json(self.record_json)


def prompt_record(prompt: NormalisedPrompt, prompt_id: str, dataset: str) -> PromptRecord:
    """The record of a normalised prompt: its messages and tools, provenance in ``metadata``."""
    metadata: dict[str, Any] = {key: value for key, value in prompt.metadata.items() if value is not None}
    metadata["turn_index"] = prompt.turn_index
    if prompt.language is not None:
        metadata["language"] = prompt.language
    return PromptRecord(
        prompt_id=prompt_id,
        dataset=dataset,
        messages=prompt.messages,
        tools=prompt.tools,
        source_index=prompt.source_index,
        metadata=metadata,
    )


@dataclass(frozen=True)
class RuleRejection:
    """Why a rule refused a candidate: the counted reason, a detail, and an optional example."""

    reason: RejectionReason
    detail: str
    example: Any = None


class PromptRule(Protocol):
    """One named rule of the chain."""

    name: str

    def check(self, candidate: Candidate) -> RuleRejection | None:
        """The rejection of ``candidate``, or None when it passes."""
        ...


def language_allowed(language: str | None, allowed: Sequence[str] | None) -> bool:
    """Rows that record no language pass; ``zh`` in the list admits ``zh-cn`` and ``zh-tw``."""
    if not allowed or language is None:
        return True
    wanted = {item.strip().lower() for item in allowed}
    code = language.strip().lower()
    return code in wanted or code.split("-")[0] in wanted


@dataclass
class LanguageRule:
    """Keep rows whose language is listed (``languages`` of the dataset)."""

    languages: list[str]
    name: str = "language"

    def check(self, candidate: Candidate) -> RuleRejection | None:
        """Reject a row in a language not listed."""
        language = candidate.language
        if language_allowed(language, self.languages):
            return None
        return RuleRejection("wrong_language", f"language {language!r} not in {self.languages}")


@dataclass
class CorpusRule:
    """Never take a prompt the existing training data already has."""

    corpus_ids: AbstractSet[str]
    name: str = "corpus"

    def check(self, candidate: Candidate) -> RuleRejection | None:
        """Reject a prompt whose id is in the existing corpus."""
        if candidate.prompt_id not in self.corpus_ids:
            return None
        detail = f"prompt {candidate.prompt_id} is in the existing corpus"
        return RuleRejection("in_existing_corpus", detail, candidate.preview)


@dataclass
class DuplicateRule:
    """Take each content once: not twice in a dataset, not again after an earlier dataset of the run."""

    excluded: AbstractSet[str]
    seen: set[str] = field(default_factory=set)
    name: str = "duplicate"

    def check(self, candidate: Candidate) -> RuleRejection | None:
        """Reject a repeat; remember a first sighting (even if a later rule rejects it)."""
        prompt_id = candidate.prompt_id
        if prompt_id in self.seen or prompt_id in self.excluded:
            where = "this dataset" if prompt_id in self.seen else "an earlier dataset of the run"
            return RuleRejection(
                "duplicate", f"same content as prompt {prompt_id} of {where}", candidate.preview
            )
        self.seen.add(prompt_id)
        return None


class QuotaRule:
    """Take the dataset's quota as a seeded uniform sample: the ``quota`` smallest priorities (bottom-k).

    The sample uses memory for the quota only, does not depend on the order rows are read in, and is the
    same in every run with the same seed. Its cut-off only falls, so a candidate it would not keep now is
    never drawn: :meth:`check` rejects it before the costly length check.

    Args:
        quota: How many prompts to take.
    """

    name = "quota"

    def __init__(self, quota: int) -> None:
        self.quota = quota
        self._heap: list[tuple[int, str, Candidate]] = []

    @property
    def over_cap_detail(self) -> str:
        """The detail of every ``over_cap`` rejection."""
        return f"not drawn by the sample of the quota ({self.quota})"

    def check(self, candidate: Candidate) -> RuleRejection | None:
        """Reject a candidate the sample would not keep."""
        if len(self._heap) < self.quota or candidate.priority < -self._heap[0][0]:
            return None
        return RuleRejection("over_cap", self.over_cap_detail)

    def take(self, candidate: Candidate) -> Candidate | None:
        """Keep a candidate that passed every rule; return the one it pushed out of the sample, if any."""
        entry = (-candidate.priority, candidate.prompt_id, candidate)
        if len(self._heap) < self.quota:
            heapq.heappush(self._heap, entry)
            return None
        return heapq.heappushpop(self._heap, entry)[2]

    def drawn_in_source_order(self) -> list[Candidate]:
        """The sample, in the order its rows (and turns) appear in the dataset."""
        return sorted(
            (entry[2] for entry in self._heap), key=lambda item: (item.source_index, item.turn_index)
        )


def count_prompt_tokens(
    tokenizer: Any,
    prompt: NormalisedPrompt | PromptRecord,
    *,
    enable_thinking: bool | None = None,
    spec: TokenizerSpec | None = None,
) -> int:
    """Tokens of the prompt as the target renders it: its chat template, tools, generation prompt.

    The render is the one the training rows and exact-token requests use
    (:func:`datagen.dataset.tokenizer.render_prompt`), so a prompt is measured as the server will see it.

    Args:
        tokenizer: A ``transformers`` tokenizer with a chat template.
        prompt: The prompt.
        enable_thinking: Passed to the template when set (it changes the generation prompt).
        spec: ``tokenizer``'s template and special tokens, when the caller keeps them (built here otherwise).

    Returns:
        The token count.

    Raises:
        TokenizeError: The template failed to render the prompt.

    """
    template = spec or TokenizerSpec.from_tokenizer(tokenizer, with_backend=False)
    text = render_prompt(template, prompt.messages, prompt.tools or None, enable_thinking)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class LengthRule:
    """Drop prompts longer than ``max_prompt_tokens`` under the target's chat template (tools included)."""

    tokenizer: Any
    max_tokens: int
    enable_thinking: bool | None
    name: str = "length"
    spec: TokenizerSpec | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # The template and special tokens, read from the tokenizer once for every prompt of the dataset.
        if self.spec is None:
            self.spec = TokenizerSpec.from_tokenizer(self.tokenizer, with_backend=False)

    def check(self, candidate: Candidate) -> RuleRejection | None:
        """Reject a prompt that is too long, or that the template refuses to render."""
        try:
            tokens = count_prompt_tokens(
                self.tokenizer, candidate.record(), enable_thinking=self.enable_thinking, spec=self.spec
            )
        except Exception as error:  # a template refusing one prompt must not stop the dataset
            return RuleRejection("template_error", f"{type(error).__name__}: {error}", candidate.preview)
        if tokens > self.max_tokens:
            detail = f"{tokens} tokens > max_prompt_tokens {self.max_tokens}"
            return RuleRejection("too_long", detail, candidate.preview)
        return None


def prompt_rules(
    *,
    languages: list[str] | None,
    corpus_ids: AbstractSet[str],
    excluded: AbstractSet[str],
    quota: QuotaRule | None,
    length: LengthRule | None,
) -> list[PromptRule]:
    """The chain of one dataset, in order; a rule with nothing to check is left out.

    Args:
        languages: The dataset's ``languages`` (None or empty: every language).
        corpus_ids: Ids of the existing corpus's prompts.
        excluded: Ids already taken by earlier datasets of the run.
        quota: The quota's sample, when the dataset has a quota.
        length: The length rule, when the dataset sets ``max_prompt_tokens``.

    Returns:
        The rules: language, corpus, duplicate, quota, length.

    """
    rules: list[PromptRule] = []
    if languages:
        rules.append(LanguageRule(languages))
    rules += [CorpusRule(corpus_ids), DuplicateRule(excluded)]
    if quota is not None:
        rules.append(quota)
    if length is not None:
        rules.append(length)
    return rules


def first_rejection(rules: Sequence[PromptRule], candidate: Candidate) -> RuleRejection | None:
    """Run ``candidate`` through the chain; the first rule that rejects it decides."""
    for rule in rules:
        rejection = rule.check(candidate)
        if rejection is not None:
            return rejection
    return None
