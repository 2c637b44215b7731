"""Dataset scans: parts dealt out in blocks merge back into the whole scan; a failed worker falls back."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datagen.errors import DatasetError
from datagen.output.s3_client import S3Credentials
from datagen.prompts.datasets.sources import PARQUET_BATCH_ROWS, iter_rows
from datagen.prompts.datasets.tally import SAMPLES_PER_REASON
from datagen.prompts.parallel import DatasetScans, plan_parts
from datagen.prompts.scan import (
    CREDENTIALS_ENV,
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

REPO = Path(__file__).resolve().parents[2]


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


def _workers_of(spool_dir: Path) -> list[int]:
    """Pids of scan workers writing under ``spool_dir``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if argv[1:3] == ["-m", "datagen.prompts.scan"] and str(spool_dir) in argv[-2]:
                pids.append(int(entry.name))
    return pids


def _wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_closing_the_scans_stops_their_workers_and_a_later_read_is_refused(tmp_path: Path) -> None:
    request = request_for(metamath_file(tmp_path / "m.json", 200_000))
    scans = DatasetScans([request], tmp_path / "scans", workers=1)
    assert _wait_for(lambda: bool(_workers_of(tmp_path / "scans")), 60)
    started = time.monotonic()
    scans.close()
    assert time.monotonic() - started < 10
    assert _workers_of(tmp_path / "scans") == []
    with pytest.raises(DatasetError, match="were stopped"):
        list(scans.events(request))


PARENT = """
import sys, time
from pathlib import Path
from datagen.prompts.parallel import DatasetScans
from datagen.prompts.scan import ScanRequest
request = ScanRequest(dataset="m", format="metamath", path=sys.argv[1], multi_turn="last_turn", seed=0)
scans = DatasetScans([request], Path(sys.argv[2]), workers=1)
time.sleep(600)
"""


def _ignores(pid: int, *signums: signal.Signals) -> bool:
    """Whether ``pid`` ignores every one of ``signums`` (its SigIgn mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    return all(mask & (1 << (signum - 1)) for signum in signums)


def test_a_worker_whose_parent_was_killed_stops_and_ignores_signals_to_its_group(tmp_path: Path) -> None:
    data = metamath_file(tmp_path / "m.json", 400_000)
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(data), str(tmp_path / "scans")],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,
    )
    try:
        assert _wait_for(lambda: bool(_workers_of(tmp_path / "scans")), 60)
        (worker,) = _workers_of(tmp_path / "scans")
        # Once its own signal handling is in place (SIGINT and SIGTERM ignored; a busy box imports slowly).
        assert _wait_for(lambda: _ignores(worker, signal.SIGINT, signal.SIGTERM), 60)
        os.kill(worker, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group: the parent decides
        os.kill(worker, signal.SIGTERM)
        time.sleep(0.5)
        assert _workers_of(tmp_path / "scans") == [worker]
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert _wait_for(lambda: not _workers_of(tmp_path / "scans"), 30), "the orphaned worker kept running"
        # It stopped part way (a worker that ran to the end would have completed its spool).
        assert list((tmp_path / "scans").glob("*/*.spool")) == []
        assert list((tmp_path / "scans").glob("*/*.spool.partial"))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)


def test_scan_workers_get_the_credentials_in_their_environment_not_on_disk(tmp_path: Path) -> None:
    secret = "Sup3rSecret/NeverOnDisk"
    credentials = S3Credentials(access_key_id="AKIATEST", secret_access_key=secret, session_token="token-1")
    request = ScanRequest(
        dataset="d", format="sharegpt", path="s3://bucket/d.jsonl", multi_turn="last_turn", seed=1
    )

    env = DatasetScans([request], tmp_path, 0, credentials=credentials)._worker_env()
    without = DatasetScans([request], tmp_path, 0)._worker_env()

    assert S3Credentials.model_validate_json(env[CREDENTIALS_ENV]) == credentials
    assert CREDENTIALS_ENV not in without
    assert secret not in request.to_json() and secret not in repr(credentials)
