"""Dataset scans: parts dealt out in blocks merge back into the whole scan; a failed worker falls back."""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datagen.errors import DatasetError
from datagen.prompts.datasets.sources import PARQUET_BATCH_ROWS, iter_rows
from datagen.prompts.datasets.tally import SAMPLES_PER_REASON
from datagen.prompts.parallel import DatasetScans, plan_parts
from datagen.prompts.scan import (
    BlockEnd,
    RowRejection,
    ScanEnd,
    ScanEvent,
    ScanRequest,
    merge_parts,
    read_spool,
    scan_dataset,
    write_spool,
)


def metamath_file(path: Path, rows: int) -> Path:
    data: list[object] = []
    for index in range(rows):
        if index % 9 == 4:
            data.append({"response": "no query"})  # rejected: malformed
        else:
            data.append({"query": f"Question {index % 50}?", "response": "The answer is: 1"})
    path.write_text(json.dumps(data))
    return path


def as_summarised(events: list[ScanEvent]) -> list[ScanEvent]:
    """The events with the excerpts a summary never keeps left out (a part keeps a few more: its own first)."""
    seen: Counter[str] = Counter()
    result: list[ScanEvent] = []
    for event in events:
        if isinstance(event, RowRejection):
            seen[event.reason] += 1
            if seen[event.reason] > SAMPLES_PER_REASON:
                event = replace(event, example=None)
        result.append(event)
    return result


def request_for(path: Path) -> ScanRequest:
    return ScanRequest(dataset="m", format="metamath", path=str(path), multi_turn="last_turn", seed=3)


def test_parts_of_a_scan_merge_back_into_the_whole_scan(tmp_path: Path) -> None:
    request = request_for(metamath_file(tmp_path / "m.json", 103))
    whole = list(scan_dataset(request))
    assert isinstance(whole[-1], ScanEnd) and whole[-1].rows_read == 103
    for parts in (2, 3, 5):
        scans = [scan_dataset(replace(request, part=p, parts=parts, block_rows=4)) for p in range(parts)]
        assert as_summarised(list(merge_parts(scans))) == as_summarised(whole)
    # A spool round trip keeps every event.
    spool = tmp_path / "m.spool"
    with spool.open("wb") as handle:
        write_spool(scan_dataset(replace(request, part=1, parts=2, block_rows=4)), handle)
    events = list(read_spool(spool))
    assert events == list(scan_dataset(replace(request, part=1, parts=2, block_rows=4)))
    assert [event.block for event in events if isinstance(event, BlockEnd)] == list(range(1, 26, 2))


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_parts_skip_decoding_the_rows_of_other_parts_and_still_merge_into_the_whole_scan(
    tmp_path: Path, kind: str
) -> None:
    rows = [{"question": f"Question {index}?", "answer": "1"} for index in range(2600)]
    rows[1500] = {"answer": "no question"}
    if kind == "parquet":
        path = tmp_path / "w.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path = tmp_path / "w.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "not json\n")
    request = ScanRequest(dataset="w", format="webinstruct", path=str(path), multi_turn="last_turn", seed=1)
    whole = list(scan_dataset(request))
    # Blocks as large as a Parquet batch: a part never converts a batch of another part's rows.
    parts = [replace(request, part=part, parts=2, block_rows=PARQUET_BATCH_ROWS) for part in range(2)]
    assert as_summarised(list(merge_parts([scan_dataset(part) for part in parts]))) == as_summarised(whole)
    wanted = [index for index in range(len(rows) + 1) if (index // PARQUET_BATCH_ROWS) % 2 == 1]
    read = list(iter_rows(str(path), wanted=lambda index: (index // PARQUET_BATCH_ROWS) % 2 == 1))
    assert [row.index for row in read] == list(range(len(read)))
    assert [row.index for row in read if not row.skipped] == [index for index in wanted if index < len(read)]
    assert all(row.data is None and row.error is None for row in read if row.skipped)


def test_parts_out_of_step_are_refused(tmp_path: Path) -> None:
    request = request_for(metamath_file(tmp_path / "m.json", 20))
    scans = [scan_dataset(replace(request, part=p, parts=2, block_rows=4)) for p in (1, 0)]
    with pytest.raises(ValueError, match="out of step"):
        list(merge_parts(scans))


def test_spare_cores_split_the_largest_datasets_never_below_the_smallest_part() -> None:
    mib = 1 << 20
    sizes = {"infinity": 400 * mib, "metamath": 100 * mib, "hermes": 5 * mib, "remote": 0}
    assert plan_parts(sizes, 16, 32 * mib) == {"infinity": 11, "metamath": 3, "hermes": 1, "remote": 1}
    assert plan_parts(sizes, 3, 32 * mib) == dict.fromkeys(sizes, 1)


def test_a_failed_worker_leaves_the_scan_to_the_caller_which_raises_its_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not a parquet file")
    request = ScanRequest(dataset="b", format="webinstruct", path=str(broken), multi_turn="last_turn", seed=0)
    with pytest.raises(DatasetError) as sequential:
        list(scan_dataset(request))
    with (
        caplog.at_level(logging.WARNING, logger="datagen.prompts.parallel"),
        DatasetScans([request], tmp_path / "scans", workers=1) as scans,
        pytest.raises(DatasetError) as parallel,
    ):
        list(scans.events(request))
    assert str(parallel.value) == str(sequential.value)
    assert "dataset scan worker failed dataset=b" in caplog.text
    assert list((tmp_path / "scans").iterdir()) == []
