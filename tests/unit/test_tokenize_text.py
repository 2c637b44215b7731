"""TextEncoder gives exactly the Rust tokenizer's ids, on the real Qwen3 tokenizer, for any text.

Seeded fuzzing over the characters that decide the split: every ASCII character (controls, the whitespace the
pattern treats specially, apostrophe contractions in any case), and Unicode that must take the Rust path
(letters and digits of other scripts, combining marks that NFC composes, including onto ``>`` right after an
added token, Unicode whitespace and line separators, emoji), mixed with added tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datagen.dataset.tokenize_text import PIECE_CACHE_ENTRIES, TextEncoder
from tests.support.qwen import build_qwen_tokenizer_dir

ADDED = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<|endoftext|>"]
ASCII_ATOMS = [chr(code) for code in range(128)] + [
    "'s", "'S", "'t", "'re", "'RE", "'Ve", "'m", "'ll", "'LL", "'d", "'x", "  ", "\n\n", "\r\n", " \n ",
    "\t\t", "   \n", "word", " Word", "123", "3.14", "...", "!!\n", "a_b", "def f(x):\n    return x\n",
]  # fmt: skip
UNICODE_ATOMS = [
    "\u00e9", "e\u0301", "\u0301", "\u0338", "\u00df", "\u017f", "\u212a", "\u0130", "\u4e2d\u6587",
    "\u0661\u0662", "\u216b", "\u00b2", "\u00a0", "\u3000", "\u2028", "\u2029", "\x85", "\u200b",
    "\U0001f642", "\U0001f44d\U0001f3fd", "\u2126", "\ufb01", "\ud55c\uad6d\uc5b4", "\u1100\u1161",
    "\u2014", "\u201cquoted\u201d", " \u00e9t\u00e9", " e\u0301", " \u0301", "\u3000x", "\u00a0y", "\u3000 ",
    " \u4e2d", "x\u00a0 ", "\u2028 a", "'\u017f",
]  # fmt: skip


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tokenizers import Tokenizer

    directory = build_qwen_tokenizer_dir(tmp_path_factory.mktemp("qwen3"), "qwen3")
    return Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))


def _texts(seed: int, count: int, atoms: list[str]) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(atoms) for _ in range(rng.randint(0, 40))) for _ in range(count)]


def _reference(backend: Any, texts: list[str]) -> list[list[int]]:
    return [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]


def test_qwen3_tokenizer_takes_the_fast_path(backend: Any) -> None:
    assert TextEncoder(backend).fast


def test_ascii_text_gives_the_tokenizers_ids(backend: Any) -> None:
    texts = _texts(0, 4000, ASCII_ATOMS)
    encoder = TextEncoder(backend)
    assert encoder.encode_batch(texts) == _reference(backend, texts)


def test_unicode_and_added_tokens_give_the_tokenizers_ids(backend: Any) -> None:
    texts = _texts(1, 4000, ASCII_ATOMS + UNICODE_ATOMS + ADDED + [">\u0338", "<\u0338"])
    encoder = TextEncoder(backend)
    assert encoder.encode_batch(texts) == _reference(backend, texts)


def test_added_token_then_combining_mark_is_not_composed_across_the_token(backend: Any) -> None:
    texts = ["<think>\u0338x", "a</think>\u0338\n\u0338", "<|im_end|>\u0301\ne\u0301"]
    assert TextEncoder(backend).encode_batch(texts) == _reference(backend, texts)


def test_last_added_end_is_just_past_the_last_added_token(backend: Any) -> None:
    encoder = TextEncoder(backend)
    assert encoder.last_added_end("<|im_start|>assistant\n<think>\n") == len("<|im_start|>assistant\n<think>")
    assert encoder.last_added_end("no tokens") == 0


def test_full_piece_cache_is_emptied_and_results_stay_exact(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("datagen.dataset.tokenize_text.PIECE_CACHE_ENTRIES", 8)
    texts = _texts(2, 300, ASCII_ATOMS + UNICODE_ATOMS)
    encoder = TextEncoder(backend)
    assert encoder.encode_batch(texts) == _reference(backend, texts)
    assert len(encoder._cache) <= 8
    assert PIECE_CACHE_ENTRIES > 8


def test_other_tokenizer_structures_are_encoded_by_the_tokenizer_itself(backend: Any) -> None:
    from tokenizers import Tokenizer

    spec = json.loads(backend.to_str())
    spec["normalizer"] = {"type": "NFKC"}
    other = Tokenizer.from_str(json.dumps(spec))
    encoder = TextEncoder(other)
    texts = ["ﬁne ²", "plain text"]
    assert not encoder.fast
    assert encoder.encode_batch(texts) == _reference(other, texts)


def test_a_tokenizer_that_encodes_special_tokens_as_text_is_left_to_itself(backend: Any) -> None:
    from tokenizers import Tokenizer

    split = Tokenizer.from_str(backend.to_str())
    split.encode_special_tokens = True
    encoder = TextEncoder(split)
    texts = ["<|im_start|>user\nhi<|im_end|>"]
    assert not encoder.fast
    assert encoder.encode_batch(texts) == _reference(split, texts)


WORD_ATOMS = [
    "word", "Word", "it's", "x86", "3.14", "na\u00efve", "caf\u00e9", "\u00e9t\u00e9", "\u4e2d\u6587", "\u2014", "\u2192",
    "e\u0301t\u0301", "\U0001f642", "\u0661\u0662", "\u00b2", "'\u017f", "'S", "-", "...", "(a)", "\u2126",
]  # fmt: skip
SEPARATORS = [
    " ",
    " ",
    " ",
    "  ",
    "\t",
    "\n",
    "\n\n",
    " \n",
    "\u00a0",
    "\u3000",
    "\u2028",
    "\x85",
    "\r\n",
    "",
]


def test_sentences_mixing_ascii_and_other_words_give_the_tokenizers_ids(backend: Any) -> None:
    rng = random.Random(3)
    texts = [
        "".join(rng.choice(WORD_ATOMS) + rng.choice(SEPARATORS) for _ in range(rng.randint(1, 30)))
        for _ in range(5000)
    ]
    assert TextEncoder(backend).encode_batch(texts) == _reference(backend, texts)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=60))
def test_any_text_gives_the_tokenizers_ids(backend: Any, text: str) -> None:
    encoder = TextEncoder(backend)
    assert encoder.encode(text) == backend.encode(text, add_special_tokens=False).ids
    assert (
        encoder.encode(" a" + text + " b\n")
        == backend.encode(" a" + text + " b\n", add_special_tokens=False).ids
    )
