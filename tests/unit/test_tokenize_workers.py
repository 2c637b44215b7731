"""Worker processes of merge-and-tokenize: failures surface instead of hanging."""

from __future__ import annotations

from pathlib import Path

import pytest

from datagen.dataset.tokenize_workers import TokenizeJob, tokenize_shards
from datagen.dataset.tokenizer import TokenizerSpec
from datagen.output.store import Store


def test_workers_that_cannot_start_fail_the_merge_instead_of_restarting_forever(store_root: Path) -> None:
    store = Store(str(store_root))
    keys = ["a/shard-00000.jsonl", "a/shard-00001.jsonl"]
    for key in keys:
        store.write_text(key, "{}\n")
    broken = TokenizeJob(
        spec=TokenizerSpec(backend_json="not a tokenizer", chat_template="", special_tokens={}),
        max_length_tokens=None,
        include_truncated=False,
    )
    with pytest.raises(Exception, match=r"(?i)expected|invalid|json"):
        list(tokenize_shards(lambda: broken, store, keys, workers=2))
