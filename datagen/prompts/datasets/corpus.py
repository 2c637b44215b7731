"""The prompt ids of the existing training corpus, so the new data never repeats a prompt it holds.

Four kinds of source (:class:`~datagen.config.CorpusSource`), each streamed, so memory is the id set:

* ``prompt_ids``: text files with one id per line: a datagen prompt id (16 hex characters) or the full
  SHA-256 of the normalised content (64 hex; its first 16 characters are the id). Blank lines and
  ``#`` comments are skipped; any other line is an error naming the file and line.
* ``prompts``: dataset files in a supported layout, normalised and hashed exactly like new prompts
  (:mod:`datagen.prompts.datasets.identity`); rows that do not normalise are skipped and counted in the log.
* ``run``: the folder of a previous datagen run (``<output>/runs/<run_id>``): the ids in its prompt
  shards.
* ``dataset_version``: a dataset version manifest (``datasets/<name>/vNNNN.json``): the ``prompt_id``
  column of every Parquet shard it lists, inherited shards included.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

from datagen.config import CorpusSource, ExistingCorpusConfig
from datagen.errors import DatasetError
from datagen.output.s3_client import S3Credentials
from datagen.prompts.datasets.identity import PROMPT_ID_HEX_CHARS, prompt_id_for
from datagen.prompts.datasets.inputs import input_filesystem, open_input
from datagen.prompts.datasets.model import Rejection
from datagen.prompts.datasets.registry import normalise_row
from datagen.prompts.datasets.sources import (
    GLOB_CHARACTERS,
    PARQUET_BATCH_ROWS,
    iter_rows,
)

logger = logging.getLogger(__name__)

SHA256_HEX_CHARS = 64
_HEX_ID = re.compile(rf"^(?:[0-9a-f]{{{PROMPT_ID_HEX_CHARS}}}|[0-9a-f]{{{SHA256_HEX_CHARS}}})$")
_PROMPT_SHARD_KEY = re.compile(r"^prompts/[^/]+/shard-\d+\.jsonl$")


def _id_files(path: str, credentials: S3Credentials | None) -> list[str]:
    fs, root = input_filesystem(path, credentials)
    if any(char in path for char in GLOB_CHARACTERS):
        files = sorted(str(item) for item in fs.glob(root))
    else:
        files = [root] if fs.isfile(root) else []
    if not files:
        raise DatasetError(
            f"existing_corpus: no prompt id file at {path}; give a text file (or glob) with one id per line."
        )
    return [fs.unstrip_protocol(item) if "://" in path else item for item in files]


def _iter_id_file(path: str, credentials: S3Credentials | None) -> Iterator[str]:
    for file in _id_files(path, credentials):
        with open_input(file, "rt", compression="infer", encoding="utf-8", credentials=credentials) as f:
            for line_number, raw in enumerate(f, start=1):
                line = raw.strip().lower()
                if not line or line.startswith("#"):
                    continue
                if _HEX_ID.match(line) is None:
                    raise DatasetError(
                        f"existing_corpus: line {line_number} of {file} is not a prompt id ({raw.strip()[:80]!r}); "
                        f"expected {PROMPT_ID_HEX_CHARS} or {SHA256_HEX_CHARS} hex characters per line."
                    )
                yield line[:PROMPT_ID_HEX_CHARS]


def _iter_prompt_files(source: CorpusSource, credentials: S3Credentials | None) -> Iterator[str]:
    assert source.format is not None  # CorpusSource validates it for kind 'prompts'
    skipped = 0
    for row in iter_rows(source.path, credentials=credentials):
        result = (
            normalise_row(source.format, row.data, row.index, source.multi_turn)
            if row.error is None
            else None
        )
        if result is None or isinstance(result, Rejection):
            skipped += 1
            continue
        for prompt in result:
            yield prompt_id_for(prompt.messages, prompt.tools)
    if skipped:
        logger.info("existing corpus rows not usable path=%s skipped=%d", source.path, skipped)


def _iter_run(path: str, credentials: S3Credentials | None) -> Iterator[str]:
    from datagen.output.store import Store

    store = Store(path.rstrip("/"), credentials=credentials)
    keys = [key for key in store.list("prompts") if _PROMPT_SHARD_KEY.match(key)]
    if not keys:
        raise DatasetError(
            f"existing_corpus: no prompt shards under {path}/prompts; give the folder of a previous run "
            "(<output>/runs/<run_id>)."
        )
    for key in keys:
        for line in store.iter_jsonl(key):
            yield str(line["prompt_id"])


def _iter_parquet_ids(url: str, credentials: S3Credentials | None) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open_input(url, "rb", credentials=credentials) as handle:
        try:
            parquet = pq.ParquetFile(handle)
            if "prompt_id" not in parquet.schema_arrow.names:
                raise DatasetError(
                    f"existing_corpus: Parquet shard {url} has no prompt_id column (not written by datagen); "
                    "dedupe against that data with kind 'prompts' (its source files) or 'prompt_ids'."
                )
            for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=["prompt_id"]):
                for value in batch.column(0).to_pylist():
                    if value:
                        yield str(value)
        except (pa.ArrowException, OSError) as error:
            raise DatasetError(f"existing_corpus: cannot read Parquet shard {url}: {error}") from error


def _iter_dataset_version(path: str, credentials: S3Credentials | None) -> Iterator[str]:
    import json

    from pydantic import ValidationError

    from datagen.dataset.versions import DatasetVersion

    try:
        with open_input(path, "rb", credentials=credentials) as handle:
            version = DatasetVersion.model_validate(json.loads(handle.read()))
    except FileNotFoundError:
        raise DatasetError(f"existing_corpus: dataset version manifest {path} does not exist.") from None
    except (ValueError, ValidationError) as error:
        raise DatasetError(
            f"existing_corpus: {path} is not a datagen dataset version manifest: {error}"
        ) from None
    for shard in version.shards:
        yield from _iter_parquet_ids(shard.url, credentials)


def iter_corpus_ids(source: CorpusSource, credentials: S3Credentials | None = None) -> Iterator[str]:
    """Stream the prompt ids of one existing-corpus source (repeats possible).

    Args:
        source: The source.
        credentials: S3 credentials for s3:// sources (None: the standard AWS chain).

    Yields:
        Prompt ids (16 lowercase hex characters).

    Raises:
        DatasetError: The source is missing or not what its ``kind`` says.

    """
    if source.kind == "prompt_ids":
        yield from _iter_id_file(source.path, credentials)
    elif source.kind == "prompts":
        yield from _iter_prompt_files(source, credentials)
    elif source.kind == "run":
        yield from _iter_run(source.path, credentials)
    else:
        yield from _iter_dataset_version(source.path, credentials)


def load_corpus_ids(corpus: ExistingCorpusConfig, credentials: S3Credentials | None = None) -> frozenset[str]:
    """The prompt ids of every ``dedupe_against`` source, read once.

    Args:
        corpus: The existing-corpus config.
        credentials: S3 credentials for s3:// sources (None: the standard AWS chain).

    Returns:
        The ids (empty when there is no source).

    Raises:
        DatasetError: A source is missing or unreadable.

    """
    ids: set[str] = set()
    for source in corpus.dedupe_against:
        before = len(ids)
        ids.update(iter_corpus_ids(source, credentials))
        logger.info(
            "existing corpus source kind=%s path=%s new_ids=%d", source.kind, source.path, len(ids) - before
        )
    return frozenset(ids)
