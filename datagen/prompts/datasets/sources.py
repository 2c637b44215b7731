"""Stream raw rows out of dataset files: local paths, globs, directories or s3:// URLs.

Supported file types, chosen by suffix (a ``.gz``/``.bz2``/``.xz``/``.zst`` suffix is decompressed on the
fly): Parquet (read batch by batch), JSON Lines (``.jsonl``, ``.ndjson``) and JSON files holding one
top-level array (``.json``, streamed element by element). Nothing is ever loaded whole.

Hugging Face Hub ids (``owner/name[:config]`` or ``hf://datasets/owner/name``) are streamed through the
`datasets` library (extra ``hub``) when the Hub is reachable, and refused with a clear message when it is
not: GPU hosts often cannot reach it, so datasets are usually copied to local disk or S3 first.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datagen.errors import DatasetError
from datagen.output.s3_client import S3Credentials
from datagen.prompts.datasets.inputs import input_filesystem, open_input
from datagen.prompts.datasets.jsonstream import iter_json_array

logger = logging.getLogger(__name__)

PARQUET_BATCH_ROWS = 1024  # rows per Arrow batch: small enough to bound memory on wide rows
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
PARQUET_SUFFIXES = (".parquet",)
JSONL_SUFFIXES = (".jsonl", ".ndjson")
JSON_SUFFIXES = (".json",)
SUPPORTED_SUFFIXES = PARQUET_SUFFIXES + JSONL_SUFFIXES + JSON_SUFFIXES
# owner/name, optionally :config (how a config names a dataset on the Hub).
HUB_ID_PATTERN = re.compile(r"^(hf://(datasets/)?)?[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")
GLOB_CHARACTERS = "*?["


@dataclass(frozen=True)
class SourceRow:
    """One raw row of a dataset, or the reason it could not be read.

    Attributes:
        index: The row's position in the dataset, counted across its files in sorted order.
        data: The parsed row (any JSON value), or None when ``error`` is set.
        error: Why the row could not be parsed (e.g. a broken JSON line), else None.
        file: The file the row came from.
        skipped: The caller did not want this row (``wanted`` of :func:`iter_rows`): it was counted but,
            where the file type allows, not decoded; ``data`` is None.

    """

    index: int
    data: Any
    error: str | None
    file: str
    skipped: bool = False


class _Skipped:
    """Rows a reader passed over without decoding them (none of them wanted)."""

    __slots__ = ("rows",)

    def __init__(self, rows: int) -> None:
        self.rows = rows


Wanted = Callable[[int], bool]


def _file_kind(name: str) -> str | None:
    lowered = name.lower()
    for suffix in COMPRESSION_SUFFIXES:
        lowered = lowered.removesuffix(suffix)
    if lowered.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if lowered.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if lowered.endswith(JSON_SUFFIXES):
        return "json"
    return None


def looks_like_hub_id(path: str) -> bool:
    """Tell whether ``path`` names a Hugging Face Hub dataset rather than a file location."""
    if path.startswith("hf://"):
        return True
    if "://" in path or any(char in path for char in GLOB_CHARACTERS) or path.startswith((".", "/", "~")):
        return False
    if _file_kind(path.split(":")[0]) is not None:
        return False  # `data/train.jsonl` is a (missing) relative file, not a repository
    return HUB_ID_PATTERN.match(path) is not None and not Path(path).exists()


def resolve_files(path: str, credentials: S3Credentials | None = None) -> list[str]:
    """List the data files ``path`` names, sorted, as URLs fsspec can open.

    Args:
        path: A file, a directory (searched recursively), a glob, or an s3:// URL of any of these.
        credentials: S3 credentials for an s3:// path (None: the standard AWS chain).

    Returns:
        The matching files with a supported suffix, in sorted order (the order rows are numbered in).

    Raises:
        DatasetError: Nothing matches, or a named file has an unsupported type.

    """
    if looks_like_hub_id(path):
        repo = path.split(":")[0].removeprefix("hf://datasets/").removeprefix("hf://")
        raise DatasetError(
            f"Dataset path {path!r} looks like a Hugging Face Hub id, and the Hub is not reachable from "
            "this host. Download the files where the Hub is reachable (e.g. `hf download "
            f"--repo-type dataset {repo}`), "
            "copy them to local disk or S3, and set the dataset's `path` to that copy."
        )
    try:
        fs, root = input_filesystem(path, credentials)
        if any(char in path for char in GLOB_CHARACTERS):
            candidates = [str(item) for item in fs.glob(root)]
        elif fs.isdir(root):
            candidates = [str(item) for item in fs.find(root)]
        elif fs.exists(root):
            if _file_kind(root) is None:
                raise DatasetError(
                    f"Dataset file {path} has an unsupported type; use .parquet, .jsonl/.ndjson or .json "
                    "(optionally compressed: .gz, .bz2, .xz, .zst)."
                )
            candidates = [root]
        else:
            candidates = []
    except DatasetError:
        raise
    except (OSError, ValueError) as error:
        raise DatasetError(f"Cannot list dataset files at {path}: {error}") from error
    files = sorted(
        item for item in candidates if _file_kind(item) is not None and not Path(item).name.startswith(".")
    )
    if not files:
        raise DatasetError(
            f"No dataset files found at {path}: expected a .parquet, .jsonl or .json file, a directory "
            "holding such files, or a glob matching them."
        )
    return [fs.unstrip_protocol(item) if "://" in path else item for item in files]


def iter_rows(
    path: str,
    *,
    limit: int | None = None,
    wanted: Wanted | None = None,
    credentials: S3Credentials | None = None,
) -> Iterator[SourceRow]:
    """Stream every row of the dataset at ``path``, file after file, in bounded memory.

    Args:
        path: A file, directory, glob or s3:// URL (see :func:`resolve_files`).
        limit: Stop after this many rows.
        wanted: Which row indexes the caller wants; the others come as ``skipped`` rows, not decoded
            where the file type allows (Parquet batches and JSON Lines lines no wanted row is in).
        credentials: S3 credentials for an s3:// path (None: the standard AWS chain).

    Yields:
        One :class:`SourceRow` per row; rows that cannot be parsed carry an ``error`` instead of data.

    Raises:
        DatasetError: The location holds no readable dataset files, or a file is broken as a whole
            (not Parquet, a JSON file that is not one array, a truncated array).

    """
    if looks_like_hub_id(path):
        yield from _iter_hub_rows(path, limit=limit)
        return
    index = 0
    for file in resolve_files(path, credentials):
        logger.info("reading dataset file=%s", file)
        for item in _iter_file(file, index, wanted, credentials):
            if isinstance(item, _Skipped):
                for _ in range(item.rows):
                    if limit is not None and index >= limit:
                        return
                    yield SourceRow(index=index, data=None, error=None, file=file, skipped=True)
                    index += 1
                continue
            if limit is not None and index >= limit:
                return
            data, error = item
            if wanted is not None and not wanted(index):
                yield SourceRow(index=index, data=None, error=None, file=file, skipped=True)
            else:
                yield SourceRow(index=index, data=data, error=error, file=file)
            index += 1
    if index == 0:
        logger.warning("dataset path=%s holds no rows", path)


def _iter_hub_rows(path: str, *, limit: int | None) -> Iterator[SourceRow]:
    """Stream a Hub dataset (``owner/name[:config]``, split ``train``) through the `datasets` library."""
    repo, _, config = path.removeprefix("hf://datasets/").removeprefix("hf://").partition(":")
    advice = (
        "Or download the files where the Hub is reachable (e.g. `hf download --repo-type dataset "
        f"{repo}`), copy them to local disk or S3, and set the dataset's `path` to that copy."
    )
    try:
        datasets: Any = importlib.import_module("datasets")
    except ImportError:
        datasets = None
    # A folder called `datasets` in the working directory (datagen's own output!) imports as an empty
    # namespace package: only the real library has load_dataset.
    if not hasattr(datasets, "load_dataset"):
        raise DatasetError(
            f"Dataset path {path!r} is a Hugging Face Hub id; reading it needs the `datasets` library: "
            f"pip install 'datagen[hub]'. {advice}"
        )
    try:
        stream = datasets.load_dataset(repo, config or None, split="train", streaming=True)
        for index, data in enumerate(stream):
            if limit is not None and index >= limit:
                return
            yield SourceRow(index=index, data=data, error=None, file=f"hf://datasets/{repo}")
    except DatasetError:
        raise
    except Exception as error:
        raise DatasetError(
            f"Cannot read Hub dataset {path!r} ({type(error).__name__}: {error}); the Hub is probably not "
            f"reachable from this host. {advice}"
        ) from None


_FileItem = tuple[Any, str | None] | _Skipped


def _iter_file(
    file: str, first: int, wanted: Wanted | None, credentials: S3Credentials | None
) -> Iterator[_FileItem]:
    """The rows of one file whose first row has index ``first``; unwanted ones skipped where cheap."""
    kind = _file_kind(file)
    if kind == "parquet":
        yield from _iter_parquet(file, first, wanted, credentials)
    elif kind == "jsonl":
        yield from _iter_jsonl(file, first, wanted, credentials)
    else:
        yield from _iter_json(file, credentials)


def _iter_parquet(
    file: str, first: int, wanted: Wanted | None, credentials: S3Credentials | None
) -> Iterator[_FileItem]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open_input(file, "rb", credentials=credentials) as handle:
        try:
            parquet = pq.ParquetFile(handle)
            index = first
            for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
                rows = batch.num_rows
                if wanted is not None and not any(wanted(item) for item in range(index, index + rows)):
                    yield _Skipped(rows)  # converting a batch to Python objects is the costly part
                else:
                    for row in batch.to_pylist():
                        yield row, None
                index += rows
        except (pa.ArrowException, OSError) as error:
            raise DatasetError(f"Cannot read Parquet file {file}: {error}") from error


def _iter_jsonl(
    file: str, first: int, wanted: Wanted | None, credentials: S3Credentials | None
) -> Iterator[_FileItem]:
    index = first
    with open_input(file, "rb", compression="infer", credentials=credentials) as handle:
        for line_number, raw in enumerate(handle, start=1):
            line = raw.strip()
            if not line:
                continue
            index += 1
            if wanted is not None and not wanted(index - 1):
                yield _Skipped(1)
                continue
            try:
                yield json.loads(line), None
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                yield None, f"line {line_number} is not valid JSON: {error}"


def _iter_json(file: str, credentials: S3Credentials | None) -> Iterator[_FileItem]:
    with open_input(file, "rb", compression="infer", credentials=credentials) as handle:
        for element in iter_json_array(handle, file):
            yield element, None
