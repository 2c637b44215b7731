"""The storage layout of a run: every object key datagen writes, in one place.

Keys are relative to the output root (a local directory or ``s3://bucket/prefix``)::

    runs/<run_id>/probes/write-once-<token>.json    preflight's proof that the store refuses an overwrite
    runs/<run_id>/config.json                       the resolved config (run identity), before any output
    runs/<run_id>/attempts/<attempt>/preflight.json  one folder per flow attempt (never overwritten):
    runs/<run_id>/attempts/<attempt>/training.json   what was halted, last checkpoint
    runs/<run_id>/attempts/<attempt>/env.json        probe report
    runs/<run_id>/attempts/<attempt>/plan.json       server plan
    runs/<run_id>/attempts/<attempt>/generation.json how long this attempt generated (summed in the report)
    runs/<run_id>/prompts/<dataset>/shard-00000.jsonl
    runs/<run_id>/prompts/<dataset>/summary.json    prepare summary (written after its shards)
    runs/<run_id>/parts/<dataset>/shard-00000/completions-00000.jsonl   in-shard checkpoints
    runs/<run_id>/parts/<dataset>/shard-00000/failures-00000.jsonl
    runs/<run_id>/completions/<dataset>/shard-00000.jsonl
    runs/<run_id>/failures/<dataset>/shard-00000.jsonl
    runs/<run_id>/done/<dataset>/shard-00000.json   shard marker, written after both files above
    runs/<run_id>/parts/<dataset>/shard-00000/retry-0001/completions-00000.jsonl   retry round 1's checkpoints
    runs/<run_id>/completions/<dataset>/shard-00000.retry-0001.jsonl   answers of round 1 (its requests only)
    runs/<run_id>/failures/<dataset>/shard-00000.retry-0001.jsonl      every failure still standing after it
    runs/<run_id>/done/<dataset>/shard-00000.retry-0001.json           round 1's marker: the shard's new summary
    runs/<run_id>/tokenized/shards.json             merge round 0: the completions files it merges, before its parts
    runs/<run_id>/tokenized/part-00000.parquet
    runs/<run_id>/tokenized/summary.json            merge round 0's summary, written after its version
    runs/<run_id>/tokenized/round-0001/{shards.json,part-00000.parquet,summary.json}   merge round 1 (the rest)
    runs/<run_id>/report.json, report.md
    runs/<run_id>/manifest.json                     written last: every object, counts, checksums
    runs/<run_id>/series.json                       series runs: earlier runs excluded, base version
    runs/<run_id>/hosts/<attempt>/<host>/preflight.json  multi-host: a host part's checks (host -> parent)
    runs/<run_id>/hosts/<attempt>/go.json            multi-host: halt and serve, or not (parent -> hosts)
    runs/<run_id>/hosts/<attempt>/<host>/fleet.json  multi-host: a host's server URLs (host -> parent)
    runs/<run_id>/hosts/<attempt>/release.json       multi-host: generation is over (parent -> hosts)
    series/<series>/ledger/<run_id>.jsonl           series runs: the prompts each run took (written once)
    datasets/<name>/v0001.json                      dataset versions (old shards referenced, never rewritten)
    datasets/<name>/exports/<digest>/train.jsonl    a version's rows as the drafter trainers read them
    datasets/<name>/exports/<digest>.json           that export's record, written after the rows

The layout is a schema: a reader lists one folder level at a time (``Store.list_level``) and takes a key only
when it is exactly the key this module builds for what it reads (the ``parse_*`` functions). Anything else
found under a root (a stray file, a folder nested below another's objects) is never read as a run's object.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, overload

SHARD_DIGITS = 5
VERSION_DIGITS = 4
RETRY_DIGITS = 4
MERGE_ROUND_DIGITS = 4
# The folders at the top of an output root: everything datagen writes lies in one of them.
LAYOUT_FOLDERS: Final = ("runs", "series", "datasets")

_SHARD_FILE = re.compile(r"shard-(?P<index>\d+)(?:\.retry-(?P<round>\d+))?\.jsonl")
_PART_FILE = re.compile(r"part-(?P<index>\d+)\.parquet")
_VERSION_FILE = re.compile(r"v(?P<version>\d+)\.json")
_RUN_LEDGER_FILE = re.compile(r"(?P<run_id>[a-z0-9][a-z0-9._-]{0,79})\.jsonl")


def retry_suffix(retry_round: int) -> str:
    """``.retry-0001`` for retry round 1; empty for round 0 (a shard's first generation)."""
    return f".retry-{retry_round:0{RETRY_DIGITS}d}" if retry_round else ""


def shard_name(index: int) -> str:
    """``shard-00000``: zero-padded so listings sort."""
    return f"shard-{index:0{SHARD_DIGITS}d}"


class _RunObject:
    """A fixed object of every run, read as an attribute: its key below the run's root."""

    def __init__(self, name: str, doc: str) -> None:
        self.name = name
        self.__doc__ = doc

    @overload
    def __get__(self, layout: None, owner: type[RunLayout]) -> _RunObject: ...
    @overload
    def __get__(self, layout: RunLayout, owner: type[RunLayout]) -> str: ...
    def __get__(self, layout: RunLayout | None, owner: type[RunLayout]) -> str | _RunObject:
        # Read on the class (documentation tools, introspection) it is the row itself.
        return self if layout is None else f"{layout.root}/{self.name}"


@dataclass(frozen=True)
class RunLayout:
    """Object keys of one run, relative to the store root."""

    run_id: str

    @property
    def root(self) -> str:
        """The run's prefix."""
        return f"runs/{self.run_id}"

    # The fixed objects of a run, one row each: (key below the root, what it holds).
    config = _RunObject("config.json", "The resolved config, the run's first object.")
    tokenized_summary = _RunObject(
        "tokenized/summary.json", "Merge round 0's tokenize summary, written after its parts and version."
    )
    report_json = _RunObject("report.json", "The machine-readable report.")
    report_md = _RunObject("report.md", "The human-readable report.")
    manifest = _RunObject("manifest.json", "The run manifest, written last.")
    series_entry = _RunObject(
        "series.json", "A series run's place in its series, written before its prompts are chosen."
    )

    def _shard_key(self, folder: str, dataset: str, index: int, suffix: str) -> str:
        # Every per-shard object: <root>/<folder>/<dataset>/shard-00000<suffix>.
        return f"{self.root}/{folder}/{dataset}/{shard_name(index)}{suffix}"

    def write_once_probe(self, token: str) -> str:
        """The object preflight writes twice, before anything is halted, to see the second write refused."""
        return f"{self.root}/probes/write-once-{token}.json"

    def attempt_object(self, attempt_id: str, name: str) -> str:
        """A record of one flow attempt (preflight, training, env, plan): reruns add, never overwrite."""
        return f"{self.root}/attempts/{attempt_id}/{name}"

    @property
    def attempts_prefix(self) -> str:
        """The folder holding one subfolder per flow attempt."""
        return f"{self.root}/attempts/"

    def prompt_shard(self, dataset: str, index: int) -> str:
        """One prompt shard."""
        return self._shard_key("prompts", dataset, index, ".jsonl")

    def prompts_summary(self, dataset: str) -> str:
        """The prepare summary of one dataset, written after all its shards."""
        return f"{self.root}/prompts/{dataset}/summary.json"

    # A shard's objects take a retry round (0: its first generation). Round r > 0 sends again the failures
    # round r - 1 left standing whose reason was not the prompt's own, into objects of its own: nothing of an
    # earlier round is ever rewritten, and the highest round with a done marker is the shard's outcome.

    def shard_parts_prefix(self, dataset: str, index: int, retry_round: int = 0) -> str:
        """The folder of one shard's (or one retry round's) in-progress checkpoint parts."""
        folder = self._shard_key("parts", dataset, index, "")
        return f"{folder}/retry-{retry_round:0{RETRY_DIGITS}d}" if retry_round else folder

    def completions_part(self, dataset: str, index: int, part: int, retry_round: int = 0) -> str:
        """One checkpoint part of completions inside a shard."""
        prefix = self.shard_parts_prefix(dataset, index, retry_round)
        return f"{prefix}/completions-{part:0{SHARD_DIGITS}d}.jsonl"

    def failures_part(self, dataset: str, index: int, part: int, retry_round: int = 0) -> str:
        """One checkpoint part of failures inside a shard."""
        return (
            f"{self.shard_parts_prefix(dataset, index, retry_round)}/failures-{part:0{SHARD_DIGITS}d}.jsonl"
        )

    def completions(self, dataset: str, index: int, retry_round: int = 0) -> str:
        """The final completions of one shard (of a retry round: the answers of its requests only)."""
        return self._shard_key("completions", dataset, index, f"{retry_suffix(retry_round)}.jsonl")

    def failures(self, dataset: str, index: int, retry_round: int = 0) -> str:
        """The final failures of one shard (of a retry round: every failure of the shard still standing)."""
        return self._shard_key("failures", dataset, index, f"{retry_suffix(retry_round)}.jsonl")

    def shard_done(self, dataset: str, index: int, retry_round: int = 0) -> str:
        """The done marker of one shard or retry round (a ShardSummary), written after its two final files."""
        return self._shard_key("done", dataset, index, f"{retry_suffix(retry_round)}.json")

    @property
    def completions_prefix(self) -> str:
        """Where all final completion shards live."""
        return f"{self.root}/completions"

    # A run's merge comes in rounds (0 first): a round merges the finished completions files no earlier round
    # merged, into parts and a dataset version of its own (a window-ended attempt publishes round 0, the run's
    # continuation round 1 on top of it). Round 0 keeps the keys of a run merged once.

    def tokenized_prefix(self, merge_round: int = 0) -> str:
        """The folder of one merge round's parts, list of merged files and summary."""
        folder = f"{self.root}/tokenized"
        return f"{folder}/round-{merge_round:0{MERGE_ROUND_DIGITS}d}" if merge_round else folder

    def tokenized_part(self, index: int, merge_round: int = 0) -> str:
        """One Parquet part of tokenized training rows (of one merge round)."""
        return f"{self.tokenized_prefix(merge_round)}/part-{index:0{SHARD_DIGITS}d}.parquet"

    def merge_shards(self, merge_round: int = 0) -> str:
        """The completions files a merge round merges, fixed before its first part (a resume merges the same)."""
        return f"{self.tokenized_prefix(merge_round)}/shards.json"

    def merge_summary(self, merge_round: int = 0) -> str:
        """A merge round's tokenize summary, written last (round 0's is :attr:`tokenized_summary`)."""
        return f"{self.tokenized_prefix(merge_round)}/summary.json"

    def parse_completions(self, key: str) -> tuple[str, int, int] | None:
        """``(dataset, shard index, retry round)`` when ``key`` is exactly one of this run's completions files."""
        dataset, _, name = key.removeprefix(f"{self.completions_prefix}/").partition("/")
        match = _SHARD_FILE.fullmatch(name)
        if match is None:
            return None
        found = (dataset, int(match["index"]), int(match["round"] or 0))
        return found if self.completions(*found) == key else None

    def parse_tokenized_part(self, key: str, merge_round: int = 0) -> int | None:
        """The part's index when ``key`` is exactly one of this run's tokenized parts of ``merge_round``."""
        match = _PART_FILE.fullmatch(key.removeprefix(f"{self.tokenized_prefix(merge_round)}/"))
        if match is None:
            return None
        index = int(match["index"])
        return index if self.tokenized_part(index, merge_round) == key else None

    def hosts_object(self, attempt_id: str, name: str, host: str | None = None) -> str:
        """A multi-host handshake object of one parent attempt: the parent's (no ``host``) or a host's."""
        folder = f"{self.root}/hosts/{attempt_id}"
        return f"{folder}/{host}/{name}" if host is not None else f"{folder}/{name}"


def series_ledger_prefix(series: str) -> str:
    """The folder of a series' prompt ledgers, e.g. ``series/nightly/ledger``."""
    return f"series/{series}/ledger"


def series_ledger(series: str, run_id: str) -> str:
    """The prompt ledger of one run of a series."""
    return f"{series_ledger_prefix(series)}/{run_id}.jsonl"


def parse_series_ledger(series: str, key: str) -> str | None:
    """The run id when ``key`` is exactly the ledger file of one run of ``series``."""
    match = _RUN_LEDGER_FILE.fullmatch(key.removeprefix(f"{series_ledger_prefix(series)}/"))
    if match is None:
        return None
    return match["run_id"] if series_ledger(series, match["run_id"]) == key else None


def dataset_versions_prefix(name: str) -> str:
    """The folder of dataset ``name``'s version manifests, e.g. ``datasets/drafter-expansion``."""
    return f"datasets/{name}"


def parse_dataset_version(name: str, key: str) -> int | None:
    """The version number when ``key`` is exactly a version manifest of dataset ``name``."""
    match = _VERSION_FILE.fullmatch(key.removeprefix(f"{dataset_versions_prefix(name)}/"))
    if match is None:
        return None
    number = int(match["version"])
    return number if dataset_version(name, number) == key else None


def dataset_version(name: str, version: int) -> str:
    """The key of one dataset version manifest, e.g. ``datasets/drafter-expansion/v0001.json``."""
    return f"{dataset_versions_prefix(name)}/v{version:0{VERSION_DIGITS}d}.json"


def dataset_export(name: str, digest: str) -> tuple[str, str]:
    """The keys of a trainer export of dataset ``name``: its rows, and its record (written after the rows).

    ``digest`` names the exported list of parts (:func:`datagen.dataset.export.export_keys`); the rows' folder
    holds nothing else, so a trainer given the folder reads only rows.
    """
    folder = f"datasets/{name}/exports/{digest}"
    return f"{folder}/train.jsonl", f"{folder}.json"
