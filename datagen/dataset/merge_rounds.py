"""A run's merge rounds: which finished completions files each round merges, and the run's merge over its rounds.

A run is merged in rounds. Round 0 merges every completions file finished when the run first merges. When
the generation window ended an attempt, round 0 holds the files finished by then and is published at once;
the run's continuation then merges round 1 with the files finished since (and so on), each round publishing
a dataset version on top of the previous round's. Each round has, under ``layout.tokenized_prefix(round)``::

    shards.json      MergeRoundShards: the files it merges and its base version, written once before its parts
    part-*.parquet   its rows
    summary.json     its TokenizeSummary, written last (after its dataset version): the round is finished

So every completions file lands in exactly one round (a round takes only files no earlier round listed), a
finished round is never redone (its summary is checked first), and an interrupted round resumes with the
files and base it fixed, even when more files finished meanwhile (those wait for the next round).

A window-ended attempt's round whose every completion was dropped is finished without a version (its summary
names none): the continuation's files then make the next round, on the last version a round did publish. The
run's last round is never finished that way (``datagen.dataset.merge`` refuses it, and it stays open for a merge
that keeps those answers).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections import Counter
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from datagen.dataset.versions import ExportRecord, TokenizedPartRef
from datagen.errors import OutputExistsError, TokenizeError
from datagen.output.layout import RunLayout
from datagen.output.store import Store
from datagen.records import utc_now

logger = logging.getLogger(__name__)

MERGE_ROUNDS_SCHEMA = 1


class TokenizeSummary(BaseModel):
    """What one merge round produced; written last as ``tokenized/summary.json`` (round r: its folder's)."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = 1
    run_id: str
    tokenizer: str
    shards_read: int = Field(description="Completion shards with a done marker that were read.")
    shards_incomplete: list[str] = Field(
        default_factory=list, description="Completion shards without a done marker (not read)."
    )
    completions_read: int
    rows: int
    total_tokens: int
    loss_tokens: int
    rows_by_dataset: dict[str, int] = Field(default_factory=dict)
    tokens_by_dataset: dict[str, int] = Field(default_factory=dict)
    dropped_by_reason: dict[str, int] = Field(default_factory=dict)
    turns_in_conversation_rows: int = Field(
        default=0,
        description="On-policy turns a later turn's per-conversation row holds (tokenize.conversation_rows: "
        "per_conversation): no row of their own, not dropped. completions_read = rows + these + dropped.",
    )
    parts: list[TokenizedPartRef] = Field(default_factory=list)
    resumed_parts: int = Field(default=0, description="Parts found from an interrupted attempt and kept.")
    dataset_name: str
    dataset_version: str | None = Field(
        description="Key of the dataset version manifest this round published; None: every completion it merged "
        "was dropped, so it published none (a window-ended attempt's round, closed so that the continuation's "
        "files make the next round)."
    )
    dataset_version_url: str | None
    dataset_version_rows: int = Field(
        description="Rows of the whole version (base shards included); without a version, the rows of the "
        "version the round would have extended (0 without one)."
    )
    base_version: str | None = None
    exports: list[ExportRecord] = Field(
        default_factory=list, description="Trainer exports of the version (`tokenize.formats`)."
    )
    merge_round: int = Field(default=0, ge=0, description="The run's merge round this summary closes.")
    shards_merged: list[str] | None = Field(
        default=None,
        description="The completions files this round merged, in row order (None: written before merges had "
        "rounds, when a run merged every file finished then, once).",
    )
    created_at: dt.datetime = Field(default_factory=utc_now)


class MergeRoundShards(BaseModel):
    """The completions files one merge round merges and the version it builds on, fixed before its first part."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = MERGE_ROUNDS_SCHEMA
    run_id: str
    merge_round: int = Field(ge=0)
    shards: list[str] = Field(description="Completions files (keys), in the order their rows are written.")
    base_version: str | None = Field(
        description="The version this round's version extends: round 0 the run's base, a later round the last "
        "version an earlier round published (the run's base when none did)."
    )
    created_at: dt.datetime = Field(default_factory=utc_now)


def finished_rounds(store: Store, layout: RunLayout) -> list[TokenizeSummary]:
    """The summaries of the run's finished merge rounds, round 0 first (empty: never merged)."""
    rounds: list[TokenizeSummary] = []
    while store.exists(key := layout.merge_summary(len(rounds))):
        rounds.append(TokenizeSummary.model_validate(store.read_json(key)))
    return rounds


def published_version(rounds: Sequence[TokenizeSummary]) -> str | None:
    """The key of the last version the rounds published (None: none did, every completion was dropped)."""
    return next((summary.dataset_version for summary in reversed(rounds) if summary.dataset_version), None)


def next_merge_round(
    store: Store, layout: RunLayout, finished: Sequence[str], base_version: str | None
) -> MergeRoundShards | None:
    """The merge round to run next and its files (stored before returned), or None: every finished file is merged.

    An interrupted round (its files stored, its summary not) is returned as it was fixed. Otherwise the next
    round takes the finished files no earlier round merged; a run never merged gets round 0 even with none.

    Args:
        store: The run's store.
        layout: The run's keys.
        finished: Every completions file with its done marker, in row order.
        base_version: The run's base version (round 0's); later rounds build on the last version a round
            published (the run's base when none did).

    Raises:
        TokenizeError: A merge written before merges had rounds stands for fewer files than are finished now.
    """
    rounds = finished_rounds(store, layout)
    number = len(rounds)
    key = layout.merge_shards(number)
    if store.exists(key):
        return MergeRoundShards.model_validate(store.read_json(key))
    merged: set[str] = set()
    for summary in rounds:
        if summary.shards_merged is not None:
            merged.update(summary.shards_merged)
            continue
        # Written before merges had rounds: it merged every file finished then, and named none of them.
        if len(finished) > summary.shards_read:
            raise TokenizeError(
                f"run {layout.run_id}: its merge published {summary.dataset_version} from {summary.shards_read} "
                f"completion shards, and {len(finished) - summary.shards_read} more finished since; that merge "
                "does not say which files it read, so no later round can take only the others. Their answers "
                "are stored; publish them from a new run.",
                run_id=layout.run_id,
            )
        merged.update(finished)
    todo = [file for file in finished if file not in merged]
    if rounds and not todo:
        return None
    round_shards = MergeRoundShards(
        run_id=layout.run_id,
        merge_round=number,
        shards=todo,
        base_version=published_version(rounds) or base_version,
    )
    try:
        store.write_json(key, round_shards)
    except OutputExistsError:
        # Another process on the run fixed this round first: its files are the round's.
        return MergeRoundShards.model_validate(store.read_json(key))
    logger.info(
        "merge round run_id=%s round=%d files=%d base_version=%s",
        layout.run_id,
        number,
        len(todo),
        round_shards.base_version,
    )
    return round_shards


def combine_rounds(rounds: Sequence[TokenizeSummary]) -> TokenizeSummary:
    """The run's merge over its rounds: counts and parts summed, the last published version (what the report shows).

    One round is returned as it is.
    """
    if not rounds:
        raise ValueError("a run's merge has at least one round")
    if len(rounds) == 1:
        return rounds[0]
    first, last = rounds[0], rounds[-1]
    published = [summary for summary in rounds if summary.dataset_version is not None]
    version = published[-1] if published else last

    def added(field: str) -> dict[str, int]:
        total: Counter[str] = Counter()
        for summary in rounds:
            total.update(getattr(summary, field))
        return dict(sorted(total.items()))

    return last.model_copy(
        update={
            "shards_read": sum(summary.shards_read for summary in rounds),
            "completions_read": sum(summary.completions_read for summary in rounds),
            "rows": sum(summary.rows for summary in rounds),
            "total_tokens": sum(summary.total_tokens for summary in rounds),
            "loss_tokens": sum(summary.loss_tokens for summary in rounds),
            "rows_by_dataset": added("rows_by_dataset"),
            "tokens_by_dataset": added("tokens_by_dataset"),
            "dropped_by_reason": added("dropped_by_reason"),
            "turns_in_conversation_rows": sum(summary.turns_in_conversation_rows for summary in rounds),
            "parts": [part for summary in rounds for part in summary.parts],
            "resumed_parts": sum(summary.resumed_parts for summary in rounds),
            "base_version": first.base_version,
            "shards_merged": [file for summary in rounds for file in summary.shards_merged or []],
            "dataset_version": version.dataset_version,
            "dataset_version_url": version.dataset_version_url,
            "dataset_version_rows": version.dataset_version_rows,
            "exports": version.exports,
        }
    )
