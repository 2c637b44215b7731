"""The CPU-heavy part of preparing a dataset: read, normalise, hash, encode; nothing that needs other datasets.

:func:`scan_dataset` turns a dataset's rows into a stream of :class:`ScanEvent`: a rejection of the
reader or the normaliser (``malformed``, ``empty``, ...), or a :class:`Candidate` (a normalised prompt
with its id, sampling priority and encoded record). Everything in it is a pure function of the dataset's
files, its format and multi-turn policy, and the run's seed, so it can run before the earlier datasets
of the run are prepared, in another process (:mod:`datagen.prompts.parallel`). What depends on them
(duplicates across datasets, the quota under ``mix.rebalance``, the shards) is decided afterwards, in
config order, by :func:`datagen.prompts.prepare.prepare_prompts` replaying the events.

A scan run in another process writes its events to a *spool* file (:func:`write_spool`), read back
with :func:`read_spool`: zlib-compressed pickled chunks, so memory stays at one chunk on either side.
The spool is a private, short-lived file of one run on one host: it is written and read by the same
code, never stored with the run's output.

    python -m datagen.prompts.scan <request.json> <spool>   (the worker :mod:`.parallel` starts)
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from datagen.config import MultiTurnPolicy
from datagen.output.s3_client import S3Credentials
from datagen.prompts.datasets.model import Rejection, RejectionReason
from datagen.prompts.datasets.registry import normalise_row
from datagen.prompts.datasets.sources import iter_rows
from datagen.prompts.datasets.tally import SAMPLES_PER_REASON, excerpt
from datagen.prompts.rules import Candidate

SCAN_BLOCK_ROWS = 2048  # a dataset split over several workers is dealt out in blocks of this many rows
SPOOL_CHUNK_EVENTS = 2048  # events per pickled chunk: big enough to amortise pickling, small in memory
SPOOL_COMPRESSION = 1  # zlib level: the record JSON shrinks about 4x for little CPU
PARENT_CHECK_ROWS = 4096  # a worker whose parent died stops within this many rows
# A worker's S3 credentials (S3Credentials.revealed_json): in its environment, not in the request file on disk.
CREDENTIALS_ENV = "DATAGEN_SCAN_S3_CREDENTIALS"


@dataclass(frozen=True)
class ScanRequest:
    """What a scan needs: the dataset's files, layout and policy, and the run's seed.

    Attributes:
        dataset: The dataset's name (it goes into every record).
        format: Its :data:`~datagen.config.DatasetFormat`.
        path: Its files (local path, glob, directory, s3:// URL or Hub id).
        multi_turn: Its multi-turn policy.
        seed: The run's seed (of the sampling priorities).
        part: Which part of the dataset this scan normalises (0-based)...
        parts: ...of how many: part ``p`` takes the blocks of ``block_rows`` rows whose number modulo
            ``parts`` is ``p`` (every part still reads every row; normalising is the larger cost).
        block_rows: Rows per block.
    """

    dataset: str
    format: str
    path: str
    multi_turn: MultiTurnPolicy
    seed: int
    part: int = 0
    parts: int = 1
    block_rows: int = SCAN_BLOCK_ROWS

    def same_dataset(self, other: ScanRequest) -> bool:
        """Whether ``other`` scans the same dataset with the same seed (whatever the parts)."""
        fields = ("dataset", "format", "path", "multi_turn", "seed")
        return all(getattr(self, name) == getattr(other, name) for name in fields)

    def to_json(self) -> str:
        """The request as JSON (for a worker process)."""
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> ScanRequest:
        """The request written by :meth:`to_json`."""
        return cls(**json.loads(text))


@dataclass(frozen=True)
class RowRejection:
    """A row the reader or the normaliser refused, counted before any rule runs.

    Attributes:
        reason: The rejection reason.
        detail: Why.
        source_index: The row number.
        example: The row's excerpt for the summary's samples; None when the row has no data, or when
            this reason already had :data:`~datagen.prompts.datasets.tally.SAMPLES_PER_REASON` earlier
            row rejections (the summary never keeps it then).
    """

    reason: RejectionReason
    detail: str
    source_index: int
    example: str | None


@dataclass(frozen=True)
class BlockEnd:
    """The end of one block of rows in a scan of one part of a dataset (``parts`` > 1)."""

    block: int


@dataclass(frozen=True)
class ScanEnd:
    """The last event of a complete scan: how many rows it read."""

    rows_read: int


ScanEvent = RowRejection | Candidate | BlockEnd | ScanEnd


def scan_dataset(
    request: ScanRequest, *, credentials: S3Credentials | None = None, stop_if_orphaned: bool = False
) -> Iterator[ScanEvent]:
    """The events of one dataset in row order, ending with :class:`ScanEnd`.

    Args:
        request: The dataset and seed.
        credentials: S3 credentials for an s3:// dataset (None: the standard AWS chain).
        stop_if_orphaned: Exit the process when its parent has died (a worker process).

    Yields:
        Row rejections and candidates in the order of the rows (and turns), then the end. A scan of one
        part of several yields those of its blocks only, each block closed by a :class:`BlockEnd`
        (:func:`merge_parts` puts the parts back in row order).

    Raises:
        DatasetError: The dataset cannot be read.

    """
    rows_read = 0
    sampled: Counter[str] = Counter()
    parent = os.getppid()
    current: int | None = None
    wanted = None
    if request.parts > 1:

        def wanted(index: int) -> bool:
            return (index // request.block_rows) % request.parts == request.part

    for row in iter_rows(request.path, wanted=wanted, credentials=credentials):
        rows_read += 1
        if stop_if_orphaned and rows_read % PARENT_CHECK_ROWS == 0 and os.getppid() != parent:
            sys.exit(1)
        if row.skipped:
            continue
        if request.parts > 1:
            block = row.index // request.block_rows
            if current is not None and block != current:
                yield BlockEnd(current)
            current = block
        if row.error is not None:
            sampled["malformed"] += 1
            yield RowRejection("malformed", row.error, row.index, None)
            continue
        result = normalise_row(request.format, row.data, row.index, request.multi_turn)
        if isinstance(result, Rejection):
            # Only the first few rejections of a reason become samples: later ones need no excerpt.
            keep = row.data is not None and sampled[result.reason] < SAMPLES_PER_REASON
            sampled[result.reason] += 1
            yield RowRejection(result.reason, result.detail, row.index, excerpt(row.data) if keep else None)
            continue
        for prompt in result:
            yield Candidate.of(prompt, request.seed, request.dataset)
    if current is not None:
        yield BlockEnd(current)
    yield ScanEnd(rows_read)


def merge_parts(parts: list[Iterator[ScanEvent]]) -> Iterator[ScanEvent]:
    """The events of a dataset's part scans (in part order) as one scan of the whole dataset would give.

    Blocks are dealt out round robin, and every row gives at least one event, so block ``b`` is the next
    block of part ``b % len(parts)`` until that part has ended, and then the dataset has ended.
    """
    if len(parts) == 1:
        yield from parts[0]
        return
    block = 0
    while True:
        stream = parts[block % len(parts)]
        event = next(stream)
        if isinstance(event, ScanEnd):
            break
        while not isinstance(event, BlockEnd):
            if isinstance(event, ScanEnd):
                raise ValueError(f"part scan ended inside block {block}")
            yield event
            event = next(stream)
        if event.block != block:
            raise ValueError(f"part scans out of step: block {event.block} where {block} was due")
        block += 1
    rows_read = event.rows_read
    for stream in parts:
        for event in stream:  # every other part is at its end too (its ScanEnd: the same count)
            if not isinstance(event, ScanEnd):
                raise ValueError("a part scan has blocks after the dataset ended")
    yield ScanEnd(rows_read)


def write_spool(events: Iterator[ScanEvent], target: BinaryIO) -> None:
    """Write events as compressed pickled chunks (each chunk: a length, then its bytes)."""
    chunk: list[ScanEvent] = []

    def flush() -> None:
        data = zlib.compress(pickle.dumps(chunk, protocol=pickle.HIGHEST_PROTOCOL), SPOOL_COMPRESSION)
        target.write(len(data).to_bytes(8, "big"))
        target.write(data)
        chunk.clear()

    for event in events:
        chunk.append(event)
        if len(chunk) >= SPOOL_CHUNK_EVENTS:
            flush()
    if chunk:
        flush()


def read_spool(path: Path) -> Iterator[ScanEvent]:
    """The events :func:`write_spool` wrote to ``path``, one chunk in memory at a time."""
    with path.open("rb") as handle:
        while header := handle.read(8):
            data = handle.read(int.from_bytes(header, "big"))
            yield from pickle.loads(zlib.decompress(data))


def main(argv: list[str] | None = None) -> int:
    """Worker entry point: scan the dataset of ``argv[0]`` (a request JSON file) into the spool ``argv[1]``.

    The spool appears under its name only once complete (written to a temporary name, then renamed). S3
    credentials come from :data:`CREDENTIALS_ENV` (set by the parent), never from the request file.
    """
    # The parent owns its workers: a Ctrl-C or SIGTERM to the process group is the parent's to handle (it
    # kills its workers as it stops); a worker whose parent died stops by itself (scan_dataset).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    request_path, spool_path = (argv if argv is not None else sys.argv[1:])[:2]
    request = ScanRequest.from_json(Path(request_path).read_text())
    revealed = os.environ.get(CREDENTIALS_ENV)
    credentials = S3Credentials.model_validate_json(revealed) if revealed else None
    target = Path(spool_path)
    partial = target.with_name(target.name + ".partial")
    with partial.open("wb") as handle:
        write_spool(scan_dataset(request, credentials=credentials, stop_if_orphaned=True), handle)
    partial.rename(target)
    return 0


if __name__ == "__main__":
    # Run as the module's importable name, not as __main__: the events pickle by their module's name.
    from datagen.prompts import scan

    sys.exit(scan.main())
