"""Scan a run's datasets in parallel worker processes; their preparation then replays them in config order.

Preparing a dataset has a CPU-heavy part that needs nothing from the other datasets (reading, normalising,
hashing, encoding: :mod:`datagen.prompts.scan`) and a cheap part that does (duplicates of earlier
datasets, the quota under ``mix.rebalance``, the shards: :func:`datagen.prompts.prepare.prepare_prompts`).
:class:`DatasetScans` runs the first part of every dataset at once, one worker process per dataset and at
most one per core, each writing a spool file; ``prepare_prompts`` replays a dataset's spool once the
datasets before it are prepared. The output is the same, byte for byte, as preparing them one after
another in one process: the events are the same, only where they are computed differs.

Workers are plain ``python -m datagen.prompts.scan`` processes (not forked from a threaded flow
process): each holds one chunk of events in memory; they belong to the caller's process group (a kill
of the group takes them too) and stop on their own when their parent dies. A worker that fails leaves no
spool, and its dataset is then scanned in the preparing process, which raises the error exactly as a
sequential preparation would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

import datagen
from datagen.errors import DatasetError
from datagen.output.s3_client import S3Credentials
from datagen.processes import is_running
from datagen.prompts.datasets.sources import looks_like_hub_id
from datagen.prompts.scan import (
    CREDENTIALS_ENV,
    ScanEvent,
    ScanRequest,
    merge_parts,
    read_spool,
    scan_dataset,
)

logger = logging.getLogger(__name__)

SCAN_DIR_PREFIX = "scan-"
# A dataset is split over several workers only when each part still has this many bytes of files.
MIN_PART_BYTES = 4 << 20
# Local datasets of fewer bytes than this, all together, are scanned in the preparing process: a worker's
# start-up and its spool round trip cost more than they save below it (benchmarks/bench_prepare.py; the
# figures are in docs/performance.md, "Thresholds in the code").
MIN_WORKER_BYTES = 16 << 20
STDERR_TAIL_CHARS = 2000


def is_remote(path: str) -> bool:
    """Whether a dataset path is read over the network (s3://, Hub): :func:`local_bytes` cannot weigh it."""
    return "://" in path or looks_like_hub_id(path)


def _file_bytes(path: Path) -> int:
    """Bytes of one file as its rows are decoded: a Parquet file's uncompressed size (its pages compress)."""
    if path.suffix == ".parquet":
        with contextlib.suppress(Exception):  # unreadable: its scan reports why; here it only weighs less
            import pyarrow.parquet as pq

            metadata = pq.ParquetFile(path).metadata
            return sum(metadata.row_group(index).total_byte_size for index in range(metadata.num_row_groups))
    return path.stat().st_size


def local_bytes(path: str) -> int:
    """Bytes of a dataset's local files (a file, a folder or a glob); 0 for s3:// and Hub datasets.

    What :func:`plan_parts` weighs datasets by: Parquet files count their uncompressed size.
    """
    if "://" in path:
        return 0
    target = Path(path).expanduser()
    if target.is_file():
        files = [target]
    elif target.is_dir():
        files = [item for item in target.rglob("*") if item.is_file()]
    else:
        files = [Path(item) for item in glob.glob(str(target)) if Path(item).is_file()]
    return sum(_file_bytes(item) for item in files)


def plan_parts(sizes: Mapping[str, int], cores: int, min_part_bytes: int = MIN_PART_BYTES) -> dict[str, int]:
    """How many parts to split each dataset into: one each, then the spare cores to the largest parts.

    Args:
        sizes: Bytes of each dataset's files.
        cores: Workers available.
        min_part_bytes: No part smaller than this (splitting a small dataset costs more than it saves).

    Returns:
        Parts per dataset (at least 1).

    """
    parts = dict.fromkeys(sizes, 1)
    for _ in range(max(0, cores - len(sizes))):
        name = max(parts, key=lambda item: sizes[item] / parts[item], default=None)
        if name is None or sizes[name] / (parts[name] + 1) < min_part_bytes:
            break
        parts[name] += 1
    return parts


def remove_orphaned_scan_dirs(work_dir: Path) -> None:
    """Remove spool folders left by processes that died (a SIGKILLed run never cleans up after itself)."""
    if not work_dir.is_dir():
        return
    for entry in work_dir.iterdir():
        if not entry.name.startswith(SCAN_DIR_PREFIX):
            continue
        pid_text = entry.name[len(SCAN_DIR_PREFIX) :].split("-", 1)[0]
        if pid_text.isdigit() and not is_running(int(pid_text)):
            shutil.rmtree(entry, ignore_errors=True)


class DatasetScans:
    """Scans of datasets running in worker processes; :meth:`events` reads one back (or scans it here).

    Use as a context manager: leaving it stops the workers still running and removes the spools.

    Args:
        requests: The datasets to scan, in the order they will be read back (config order).
        work_dir: Where the spools go (a folder on local disk; created if missing).
        workers: Worker processes at once (0: scan nothing in workers, every dataset in :meth:`events`).
        parts: Parts to split a dataset into, each scanned by its own worker (default 1).
        credentials: S3 credentials for s3:// datasets (None: the standard AWS chain); workers get them in
            their environment (:data:`~datagen.prompts.scan.CREDENTIALS_ENV`), not in the request files.
    """

    def __init__(
        self,
        requests: Sequence[ScanRequest],
        work_dir: Path,
        workers: int,
        parts: Mapping[str, int] | None = None,
        *,
        credentials: S3Credentials | None = None,
    ) -> None:
        self._requests = {request.dataset: request for request in requests}
        self._credentials = credentials
        self._closed = False
        self._lock = threading.Lock()
        self._processes: set[subprocess.Popen[bytes]] = set()
        self._futures: dict[str, list[Future[Path | None]]] = {}
        self._dir: Path | None = None
        self._pool: ThreadPoolExecutor | None = None
        if workers < 1 or not requests:
            return
        work_dir.mkdir(parents=True, exist_ok=True)
        remove_orphaned_scan_dirs(work_dir)
        self._dir = Path(tempfile.mkdtemp(prefix=f"{SCAN_DIR_PREFIX}{os.getpid()}-", dir=work_dir))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prompt-scan")
        for request in requests:
            count = (parts or {}).get(request.dataset, 1)
            self._futures[request.dataset] = [
                self._pool.submit(self._scan, dataclasses.replace(request, part=part, parts=count))
                for part in range(count)
            ]
        logger.info(
            "scanning datasets in parallel datasets=%d workers=%d parts=%s",
            len(requests),
            workers,
            ",".join(f"{name}:{len(futures)}" for name, futures in self._futures.items()),
        )

    def _worker_env(self) -> dict[str, str]:
        # The worker must import this very code (a checkout may shadow an installed copy).
        root = str(Path(datagen.__file__).resolve().parent.parent)
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}
        env.pop(CREDENTIALS_ENV, None)
        if self._credentials is not None:
            env[CREDENTIALS_ENV] = self._credentials.revealed_json()
        return env

    def _scan(self, request: ScanRequest) -> Path | None:
        """Run one worker; the spool's path, or None when it failed (the dataset is then scanned in process)."""
        assert self._dir is not None
        name = f"{request.dataset}.{request.part:03d}"
        request_file = self._dir / f"{name}.request.json"
        spool = self._dir / f"{name}.spool"
        stderr_file = self._dir / f"{name}.stderr"
        request_file.write_text(request.to_json())
        started = time.monotonic()
        with self._lock:
            if self._closed:
                return None
            with stderr_file.open("wb") as stderr:
                process = subprocess.Popen(
                    [sys.executable, "-m", "datagen.prompts.scan", str(request_file), str(spool)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                    env=self._worker_env(),
                )
            self._processes.add(process)
        code = process.wait()
        with self._lock:
            self._processes.discard(process)
        if code == 0 and spool.exists():
            logger.info(
                "scanned dataset=%s part=%d/%d seconds=%.1f spool_bytes=%d",
                request.dataset,
                request.part + 1,
                request.parts,
                time.monotonic() - started,
                spool.stat().st_size,
            )
            return spool
        if not self._closed:
            tail = stderr_file.read_text(errors="replace")[-STDERR_TAIL_CHARS:].strip()
            logger.warning(
                "dataset scan worker failed dataset=%s exit=%s: scanning it in this process instead; %s",
                request.dataset,
                code,
                tail.splitlines()[-1] if tail else "no output",
            )
        return None

    def events(self, request: ScanRequest) -> Iterator[ScanEvent]:
        """The events of one dataset: read from its worker's spool, or scanned here.

        Scanned here when no worker scanned this request, when the worker failed (the scan here then
        raises its error), or when the spool was already read once (a retry of the preparation).

        Args:
            request: The dataset and seed.

        Yields:
            The events of :func:`datagen.prompts.scan.scan_dataset`.

        Raises:
            DatasetError: The scans were closed (the run is stopping), or the scan here failed.

        """
        if self._closed:
            raise DatasetError(
                f"The scans of the run's datasets were stopped before dataset {request.dataset!r} was "
                "prepared (the run is stopping); run it again to resume.",
                dataset=request.dataset,
            )
        futures = self._futures.pop(request.dataset, [])
        spools = [future.result() for future in futures]
        scanned = self._requests.get(request.dataset)
        if not spools or None in spools or scanned is None or not scanned.same_dataset(request):
            yield from scan_dataset(request, credentials=self._credentials)
            return
        yield from merge_parts([read_spool(spool) for spool in spools if spool is not None])
        # Read to the end: a retry scans again rather than keeping the spools for it.
        for spool in spools:
            if spool is not None:
                spool.unlink(missing_ok=True)

    def close(self) -> None:
        """Stop the workers still running, drop the scans not started, and remove the spools."""
        with self._lock:
            self._closed = True
            processes = list(self._processes)
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> DatasetScans:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
