r"""Exact token ids of text, several times faster than the Rust tokenizer's own encode for Qwen's tokenizer.

The Qwen2/Qwen3 tokenizer is a byte-level BPE: its ``tokenizer.json`` splits the text on added tokens
(``<|im_start|>``, ``<think>``...), NFC-normalizes each remaining segment, cuts it into pieces with one regular
expression, and runs BPE on each piece's bytes alone. The ids of a text are therefore the concatenation of the
ids of its pieces, and a piece always gets the same ids. :class:`TextEncoder` does the splitting in Python's
C regex engine and looks each piece up in a cache; only pieces it has not seen go through the Rust tokenizer.
The Rust tokenizer spends most of its time on per-character bookkeeping (normalization alignments, offsets,
token strings) that training rows do not need.

Exactness, by construction rather than by hope:

* Only tokenizers whose ``tokenizer.json`` has exactly the structure above (NFC or no normalizer, the Qwen2
  split pattern, byte-level, a deterministic BPE, added tokens matched verbatim) get the fast path
  (:meth:`TextEncoder.supports`); anything else is encoded by the Rust tokenizer, unchanged.
* The split pattern is run only on ASCII text, translated to explicit ASCII classes (for ASCII, ``\p{L}`` is
  ``[A-Za-z]``, ``\p{N}`` is ``[0-9]``, ``\s`` is ``[ \t\n\v\f\r]``, and the case-insensitive contractions
  fold only ASCII letters), and ASCII text is already NFC. Text with other characters is cut where the pattern
  cuts whatever those characters' classes are: between a newline and a printable ASCII character other than
  space (no piece runs across a newline into a non-whitespace character), and before a space followed by an
  ASCII letter (every alternative stops at a space unless it starts with it, a whitespace run ends before a
  space that precedes a letter, and the piece starting at the space depends on nothing before it). Lookaheads
  at a cut see a space or a printable character in context and the end in isolation, which they treat alike;
  NFC never composes across a newline or a space. Consecutive ASCII chunks take the fast path together; each
  other chunk (typically one word) goes through the Rust tokenizer whole, which sees exactly the pieces it
  would have seen in context, and is cached like a piece.
* A piece missing from the cache goes through the tokenizer's own BPE model, as the pipeline's last step does:
  its bytes written as byte-level characters (GPT-2's map), merged by the same model.

``tests/unit/test_tokenize_text.py`` compares every result with the Rust tokenizer's on fuzzed ASCII and
Unicode text, the benchmark compares every row.
"""

from __future__ import annotations

import json
import logging
import re
from itertools import chain
from typing import Any

logger = logging.getLogger(__name__)

# The pre-tokenizer regex of Qwen2/Qwen2.5/Qwen3 (and Qwen3.5/3.6) tokenizer.json files.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
# The same pattern for ASCII text only, with the Unicode classes written out (re.ASCII: \s is [ \t\n\v\f\r]).
_ASCII_SPLIT = re.compile(
    r"'(?:[sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD])|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]"
    r"| ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    re.ASCII,
)
# Where the pattern always cuts, whatever the other characters' classes (see the module docstring): between a
# newline and a printable, non-space ASCII character, and before a space followed by an ASCII letter.
_ASCII_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_NON_ASCII = re.compile(r"[^\x00-\x7f]+")
# Distinct pieces (and non-ASCII chunks) kept per process (~250 bytes each with their ids and the dict slot, so
# ~50 MB at most):
# English prose and code need tens of thousands; the cache is emptied when full, so memory stays bounded
# whatever the data.
PIECE_CACHE_ENTRIES = 200_000


class TextEncoder:
    """Token ids of text, identical to ``backend.encode(text, add_special_tokens=False).ids``.

    Args:
        backend: The Rust tokenizer (``tokenizers.Tokenizer``).

    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        # A tokenizer told to encode special tokens as text does not split on them: not the structure above.
        self.fast = self.supports(_structure(backend)) and not getattr(
            backend, "encode_special_tokens", False
        )
        self._cache: dict[str, list[int]] = {}
        self._added: re.Pattern[str] | None = None
        self._added_ids: dict[str, int] = {}
        if self.fast:
            self._added_ids = {
                token.content: int(token_id) for token_id, token in backend.get_added_tokens_decoder().items()
            }
            # Leftmost, then longest, like the tokenizer's added-token matcher.
            alternatives = sorted(self._added_ids, key=len, reverse=True)
            self._added = re.compile("(" + "|".join(re.escape(token) for token in alternatives) + ")")
        logger.debug("text encoder fast=%s", self.fast)

    @staticmethod
    def supports(spec: dict[str, Any]) -> bool:
        """Tell whether a tokenizer (``tokenizer.json``'s structure) is one the fast path reproduces exactly.

        ``spec`` needs the keys ``normalizer``, ``pre_tokenizer``, ``model`` (its settings; the vocabulary is
        not read) and ``added_tokens``.
        """
        normalizer = spec.get("normalizer")
        pre = spec.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
        model = spec.get("model") or {}
        if normalizer is not None and normalizer != {"type": "NFC"}:
            return False
        if not steps or len(steps) != 2:
            return False
        split, byte_level = steps
        if split != {
            "type": "Split",
            "pattern": {"Regex": QWEN2_SPLIT_PATTERN},
            "behavior": "Isolated",
            "invert": False,
        }:
            return False
        if (
            byte_level.get("type") != "ByteLevel"
            or byte_level.get("use_regex")
            or byte_level.get("add_prefix_space")
        ):
            return False
        if model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback"):
            return False
        if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            return False
        added = spec.get("added_tokens") or []
        return bool(added) and all(
            not (token["normalized"] or token["lstrip"] or token["rstrip"] or token["single_word"])
            for token in added
        )

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (no special tokens added)."""
        if self._added is None:
            ids: list[int] = self.backend.encode(text, add_special_tokens=False).ids
            return ids
        ids = []
        added_ids = self._added_ids
        for index, part in enumerate(self._added.split(text)):
            if index % 2:
                ids.append(added_ids[part])
            elif part.isascii():
                self._extend_ascii(ids, part)
            elif part:
                self._extend_mixed(ids, part)
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The token ids of each text."""
        if self._added is None:
            return [encoding.ids for encoding in self.backend.encode_batch(texts, add_special_tokens=False)]
        return [self.encode(text) for text in texts]

    def last_added_end(self, text: str) -> int:
        """Index just past the last added token in ``text`` (0 when it has none)."""
        if self._added is None:
            raise RuntimeError("last_added_end needs the fast path")
        end = 0
        for match in self._added.finditer(text):
            end = match.end()
        return end

    def _extend_ascii(self, ids: list[int], text: str) -> None:
        pieces = _ASCII_SPLIT.findall(text)
        cache = self._cache
        try:
            found = list(chain.from_iterable(map(cache.__getitem__, pieces)))
        except KeyError:
            missing = set(pieces).difference(cache)
            if len(cache) + len(missing) > PIECE_CACHE_ENTRIES:
                cache.clear()
                missing = set(pieces)
            tokenize = self.backend.model.tokenize
            for piece in missing:
                # The pipeline's last step on a piece: BPE on its bytes, written as byte-level characters.
                cache[piece] = [token.id for token in tokenize(piece.translate(_BYTE_LEVEL_ASCII))]
            found = list(chain.from_iterable(map(cache.__getitem__, pieces)))
        ids += found

    def _extend_mixed(self, ids: list[int], text: str) -> None:
        """Text with non-ASCII characters: ASCII stretches as above, each chunk with others whole (cached).

        A chunk is the text between two cut points (see the module docstring); the chunks holding non-ASCII
        characters are found from those characters outwards, so the ASCII between them stays in long stretches.
        """
        done = 0
        island_end = 0
        island_start = 0
        for match in _NON_ASCII.finditer(text):
            start, end = match.span()
            if start < island_end:  # the same chunk as the previous run
                island_end = _next_cut(text, end)
                continue
            if island_end:
                self._extend_chunk(ids, text[island_start:island_end])
                done = island_end
            island_start = _previous_cut(text, start)
            if island_start > done:
                self._extend_ascii(ids, text[done:island_start])
            island_end = _next_cut(text, end)
        if island_end:
            self._extend_chunk(ids, text[island_start:island_end])
            done = island_end
        if done < len(text):
            self._extend_ascii(ids, text[done:])

    def _extend_chunk(self, ids: list[int], chunk: str) -> None:
        """A chunk with non-ASCII characters: the Rust tokenizer's ids for it alone, cached like a piece."""
        cached = self._cache.get(chunk)
        if cached is None:
            if len(self._cache) >= PIECE_CACHE_ENTRIES:
                self._cache.clear()
            cached = self._cache[chunk] = self.backend.encode(chunk, add_special_tokens=False).ids
        ids += cached


def _is_cut(text: str, index: int) -> bool:
    """Tell whether the split pattern cuts ``text`` before ``index``, whatever the non-ASCII classes are."""
    character = text[index]
    if character == " ":
        return index + 1 < len(text) and text[index + 1] in _ASCII_LETTERS
    return "!" <= character <= "~" and index > 0 and text[index - 1] in "\r\n"


def _previous_cut(text: str, index: int) -> int:
    """The last cut at or before ``index`` (the start of the text is one)."""
    while index > 0 and not _is_cut(text, index):
        index -= 1
    return index


def _next_cut(text: str, index: int) -> int:
    """The first cut at or after ``index`` (the end of the text is one)."""
    while index < len(text) and not _is_cut(text, index):
        index += 1
    return index


def _structure(backend: Any) -> dict[str, Any]:
    """The parts of a Rust tokenizer's serialized form that :meth:`TextEncoder.supports` reads."""
    model = backend.model
    settings: dict[str, Any] = {"type": type(model).__name__}
    for name in ("dropout", "byte_fallback", "continuing_subword_prefix", "end_of_word_suffix"):
        settings[name] = getattr(model, name, None)
    return {
        "normalizer": json.loads(backend.normalizer.__getstate__()) if backend.normalizer else None,
        "pre_tokenizer": json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer else None,
        "model": settings,
        "added_tokens": [
            {
                "normalized": token.normalized,
                "lstrip": token.lstrip,
                "rstrip": token.rstrip,
                "single_word": token.single_word,
            }
            for token in backend.get_added_tokens_decoder().values()
        ],
    }


def _byte_level_ascii() -> dict[int, str]:
    """GPT-2's byte-to-character map, for the ASCII bytes: printable characters map to themselves."""
    printable = set(range(ord("!"), ord("~") + 1))
    table: dict[int, str] = {}
    shift = 0
    for byte in range(256):
        if byte in printable or 0xA1 <= byte <= 0xAC or 0xAE <= byte <= 0xFF:
            character = chr(byte)
        else:
            character = chr(256 + shift)
            shift += 1
        if byte < 128:
            table[byte] = character
    return table


_BYTE_LEVEL_ASCII = _byte_level_ascii()
