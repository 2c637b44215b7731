"""Adopt the existing corpus as a base dataset version, without copying or modifying a byte of it.

``adopt_corpus`` lists every object under the corpus URL (the protected prefix), reads each one where it is,
validates and counts it, and writes a :class:`~datagen.dataset.versions.DatasetVersion` manifest into the output
store (never under the corpus URL) that references every object by URL, size and SHA-256:

* tokenized Parquet parts (``*.parquet``): ``input_ids`` and ``loss_mask`` list columns of equal length per row;
  counted rows, tokens and loss tokens; listed as the version's ``shards``, the training set's parts;
* completions (``*.jsonl``, datagen ``CompletionRecord`` lines): validated and counted (tokens from each
  record's ``usage``); listed as ``completion_sources``. Given the target's tokenizer (:class:`AdoptTokenize`),
  they are also tokenized exactly as a run's completions are (same filters, loss mask and writer) into
  write-once parts in the output store (``runs/adopted-<digest>/tokenized/``), listed after the adopted
  parts: then the version's Parquet parts are the whole corpus. Without one they are referenced only and are
  not training rows.

Rows are counted per category by a :class:`CategoryRule` (a Parquet column or record field, or a regular
expression over the object's key). Later versions name this one as ``tokenize.base_version`` and inherit its
references, so a training reader gets one list of Parquet parts for the whole mix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections import Counter
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from datagen.config import TokenizeConfig
from datagen.dataset.merge import write_tokenized_parts
from datagen.dataset.versions import CompletionSourceRef, DatasetVersion, TokenizedPartRef, claim_version
from datagen.errors import DatasetError
from datagen.output.layout import RunLayout, dataset_versions_prefix, parse_dataset_version
from datagen.output.manifest import HASH_CHUNK_BYTES
from datagen.output.store import Store
from datagen.progress import WorkProgress, report_work
from datagen.records import CompletionRecord

logger = logging.getLogger(__name__)

ADOPTED_RUN_ID = "adopted"
# Hex digits of the digest naming the parts tokenized from an adopted corpus's completions.
ADOPTED_PARTS_DIGEST_CHARS = 16
UNCATEGORIZED = "uncategorized"
PARQUET_SUFFIX = ".parquet"
JSONL_SUFFIX = ".jsonl"
# Rows read at a time from a Parquet part while counting: bounded memory whatever the part's size.
COUNT_BATCH_ROWS = 4_096


class CategoryRule(BaseModel):
    """How adopted rows are counted per category; the first rule that applies wins.

    Attributes:
        field: A Parquet column / completion-record field holding the category (e.g. ``dataset``).
        key_pattern: A regular expression with a ``category`` group, searched in each object's key relative to
            the corpus URL (e.g. ``^(?P<category>[^/]+)/``: the first folder).
    """

    model_config = ConfigDict(extra="forbid")

    field: str | None = Field(default=None, description="Column or record field holding the category.")
    key_pattern: str | None = Field(
        default=None, description="Regex with a `category` group, searched in the object key."
    )

    @model_validator(mode="after")
    def _pattern_has_group(self) -> CategoryRule:
        if self.key_pattern is not None:
            try:
                compiled = re.compile(self.key_pattern)
            except re.error as error:
                raise ValueError(f"key_pattern is not a valid regex: {error}") from None
            if "category" not in compiled.groupindex:
                raise ValueError("key_pattern needs a named group `category`, e.g. ^(?P<category>[^/]+)/")
        return self

    def for_key(self, key: str) -> str | None:
        """The category the key pattern gives ``key``, or None."""
        if self.key_pattern is None:
            return None
        match = re.search(self.key_pattern, key)
        return match["category"] if match and match["category"] else None


class AdoptTokenize(BaseModel):
    """Tokenize an adopted corpus's completions files into training parts, as a run's completions are.

    Attributes:
        tokenizer: The target's tokenizer folder (the model the completions were generated with).
        settings: Filters, part and row-group sizes, workers (``dataset_name`` and ``base_version`` unused).
    """

    model_config = ConfigDict(extra="forbid")

    tokenizer: str
    settings: TokenizeConfig = Field(default_factory=TokenizeConfig)


class AdoptedCorpus(BaseModel):
    """What ``adopt_corpus`` found and wrote."""

    model_config = ConfigDict(extra="forbid")

    version_key: str
    version_url: str
    version: DatasetVersion
    dropped_by_reason: dict[str, int] = Field(
        default_factory=dict,
        description="Completions not tokenized into rows, by reason (tokenized adoption).",
    )


def adopt_corpus(
    corpus_url: str,
    output: Store,
    *,
    name: str,
    rule: CategoryRule | None = None,
    tokenize: AdoptTokenize | None = None,
) -> AdoptedCorpus:
    """Reference every object under ``corpus_url`` in a new dataset version written to ``output``.

    Args:
        corpus_url: The existing corpus: a local folder or ``s3://bucket/prefix`` (read only).
        output: Where the manifest goes; the corpus URL is added to its protected prefixes.
        name: The dataset name (``datasets/<name>/vNNNN.json``).
        rule: How rows are counted per category; everything is ``uncategorized`` without one.
        tokenize: Also tokenize the completions files into parts (written to ``output``); referenced only
            when None.

    Returns:
        The written version.

    Raises:
        DatasetError: Nothing adoptable is there, or an object is not a valid part or completions file.
        ConfigError: The tokenizer cannot be read.
        TokenizeError: Parts an interrupted adoption left do not match the completions any more.

    """
    rule = rule or CategoryRule()
    corpus_url = corpus_url.rstrip("/")
    if corpus_url not in output.protected_prefixes:
        output.protected_prefixes.append(corpus_url)
    corpus = Store(corpus_url, credentials=output.credentials)
    sizes = {
        key: size
        for key, size in corpus.list_sizes("").items()
        if key.endswith((PARQUET_SUFFIX, JSONL_SUFFIX))
    }
    keys = list(sizes)
    if not keys:
        raise DatasetError(
            f"No *.parquet or *.jsonl objects under {corpus_url}: give the prefix that holds the existing "
            "tokenized parts and/or completions."
        )
    shards: list[TokenizedPartRef] = []
    sources: list[CompletionSourceRef] = []
    categories: Counter[str] = Counter()
    for index, key in enumerate(keys):
        report_work(WorkProgress(what="read the corpus", done=index, total=len(keys), unit="objects"))
        if key.endswith(PARQUET_SUFFIX):
            part, counts = _adopt_part(corpus, key, rule)
            shards.append(part)
        else:
            source, counts = _adopt_completions(corpus, key, rule)
            sources.append(source)
        categories.update(counts)
        logger.info("adopted key=%s categories=%s", key, dict(counts))
    report_work(WorkProgress(what="read the corpus", done=len(keys), total=len(keys), unit="objects"))
    dropped: dict[str, int] = {}
    if tokenize is not None and sources:
        completion_keys = [key for key in keys if key.endswith(JSONL_SUFFIX)]
        layout = RunLayout(_adopted_parts_id(corpus_url, sources, tokenize))
        logger.info("tokenizing adopted completions files=%d parts_run=%s", len(sources), layout.run_id)
        parts, tally, _ = write_tokenized_parts(
            output,
            layout,
            corpus,
            completion_keys,
            tokenizer=tokenize.tokenizer,
            settings=tokenize.settings,
            shard_bytes=sum(sizes[key] for key in completion_keys),
        )
        shards.extend(parts)
        sources = [
            source.model_copy(update={"tokenized_rows": tally.rows_by_file[key]})
            for source, key in zip(sources, completion_keys, strict=True)
        ]
        dropped = dict(sorted(tally.dropped.items()))
    adopted = _publish(output, name, corpus_url, shards, sources, dict(sorted(categories.items())))
    return adopted.model_copy(update={"dropped_by_reason": dropped})


def _adopted_parts_id(corpus_url: str, sources: list[CompletionSourceRef], tokenize: AdoptTokenize) -> str:
    """The run id of the parts tokenized from a corpus's completions: the same inputs, the same parts.

    A digest of the corpus URL, every completions file's checksum, the tokenizer (its files as read) and the
    settings that change rows, so adopting again finds (and resumes) its own parts and never another's.
    """
    from datagen.dataset.tokenizer import TokenizerSpec

    spec = TokenizerSpec.load(tokenize.tokenizer)
    settings = tokenize.settings
    identity = {
        "corpus": corpus_url,
        "files": [(source.url, source.sha256) for source in sources],
        "tokenizer": hashlib.sha256(
            json.dumps([spec.backend_json, spec.chat_template, spec.special_tokens]).encode()
        ).hexdigest(),
        "rows": [settings.max_length_tokens, settings.include_truncated, settings.answer_render],
        "parts": [settings.rows_per_part, settings.row_group_rows],
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return f"{ADOPTED_RUN_ID}-{digest[:ADOPTED_PARTS_DIGEST_CHARS]}"


def _adopt_part(corpus: Store, key: str, rule: CategoryRule) -> tuple[TokenizedPartRef, Counter[str]]:
    """Validate and count one tokenized Parquet part, hashing the bytes it was read from."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    data = corpus.read_bytes(key)
    url = corpus.url(key)
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
        names = set(parquet.schema_arrow.names)
        missing = {"input_ids", "loss_mask"} - names
        if missing:
            raise DatasetError(
                f"{url} lacks the column(s) {sorted(missing)}; it is not a tokenized training part."
            )
        column = rule.field if rule.field in names else None
        tokens = loss_tokens = rows = 0
        counts: Counter[str] = Counter()
        columns = ["input_ids", "loss_mask", *([column] if column else [])]
        for batch in parquet.iter_batches(batch_size=COUNT_BATCH_ROWS, columns=columns):
            ids, mask = batch.column("input_ids"), batch.column("loss_mask")
            if not pc.all(pc.equal(pc.list_value_length(ids), pc.list_value_length(mask))).as_py():
                raise DatasetError(f"{url}: a row's input_ids and loss_mask differ in length.")
            rows += batch.num_rows
            tokens += len(ids.flatten())
            loss_tokens += int(pc.sum(mask.flatten()).as_py() or 0)
            if column:
                counts.update(str(value) for value in batch.column(column).to_pylist())
    except (pa.ArrowException, OSError) as error:
        raise DatasetError(f"{url} is not a readable Parquet file: {error}") from None
    if not column:
        counts[rule.for_key(key) or UNCATEGORIZED] += rows
    part = TokenizedPartRef(
        url=url,
        rows=rows,
        source=f"adopted:{corpus.root}",
        size_bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        tokens=tokens,
        loss_tokens=loss_tokens,
    )
    return part, counts


def _adopt_completions(
    corpus: Store, key: str, rule: CategoryRule
) -> tuple[CompletionSourceRef, Counter[str]]:
    """Validate and count one completions JSONL file while streaming it through SHA-256."""
    url = corpus.url(key)
    digest = hashlib.sha256()
    size = rows = tokens = 0
    counts: Counter[str] = Counter()
    pending = b""
    line = 0
    with corpus.open_read(key) as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
            *complete, pending = (pending + chunk).split(b"\n")
            for raw in complete:
                line += 1
                rows, tokens = _count_line(url, line, raw, rule, key, counts, rows, tokens)
    if pending.strip():
        rows, tokens = _count_line(url, line + 1, pending, rule, key, counts, rows, tokens)
    source = CompletionSourceRef(
        url=url, rows=rows, size_bytes=size, sha256=digest.hexdigest(), usage_tokens=tokens
    )
    return source, counts


def _count_line(
    url: str,
    line: int,
    raw: bytes,
    rule: CategoryRule,
    key: str,
    counts: Counter[str],
    rows: int,
    tokens: int,
) -> tuple[int, int]:
    if not raw.strip():
        return rows, tokens
    try:
        record = CompletionRecord.model_validate_json(raw)
    except ValidationError as error:
        raise DatasetError(f"{url} line {line} is not a datagen completion record: {error}") from None
    value: Any = getattr(record, rule.field, None) if rule.field else None
    counts[str(value) if value is not None else (rule.for_key(key) or UNCATEGORIZED)] += 1
    return rows + 1, tokens + record.usage.prompt_tokens + record.usage.completion_tokens


def _publish(
    output: Store,
    name: str,
    corpus_url: str,
    shards: list[TokenizedPartRef],
    sources: list[CompletionSourceRef],
    categories: dict[str, int],
) -> AdoptedCorpus:
    """Write the manifest at the next free version number of ``name`` (an identical one is reused)."""
    numbers: list[int] = []
    for key in output.list_level(dataset_versions_prefix(name)).objects:
        number = parse_dataset_version(name, key)
        if number is None:
            continue
        numbers.append(number)
        stored = DatasetVersion.model_validate(json.loads(output.read_bytes(key)))
        if (
            stored.adopted_from == corpus_url
            and stored.shards == shards
            and stored.completion_sources == sources
        ):
            logger.info("corpus already adopted key=%s", key)
            return AdoptedCorpus(version_key=key, version_url=output.url(key), version=stored)
    key, version = claim_version(
        output,
        numbers,
        DatasetError,
        DatasetVersion(
            name=name,
            version=1,
            run_id=ADOPTED_RUN_ID,
            adopted_from=corpus_url,
            rows=sum(shard.rows for shard in shards),
            shards=shards,
            completion_sources=sources,
            categories=categories,
        ),
    )
    logger.info("wrote adopted version key=%s parts=%d completion_files=%d", key, len(shards), len(sources))
    return AdoptedCorpus(version_key=key, version_url=output.url(key), version=version)
