"""The target's tokenizer, loaded one way, and its chat template, rendered one way.

:func:`load_tokenizer` loads it from local files (a fast tokenizer with a chat template, or a
:class:`~datagen.errors.ConfigError` saying what to point ``model.tokenizer_path`` at); :func:`shared_tokenizer`
and :func:`shared_spec` keep one per process while its files stay unchanged. :class:`TokenizerSpec` is what
tokenizing needs (the Rust tokenizer serialized, the template, its special tokens), small enough for worker
processes; it renders the template in transformers' own sandboxed jinja environment
(:mod:`datagen.dataset.tokenize_template`) without importing transformers. :func:`render_prompt` is the one
prompt render: training rows and exact-token requests both use it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datagen.errors import ConfigError, TokenizeError
from datagen.records import Message

logger = logging.getLogger(__name__)

# The files a loaded tokenizer is built from: a change to any of them means loading it again.
TOKENIZER_SOURCE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def load_tokenizer(path: str, *, download: bool = False) -> Any:
    """Load the target's tokenizer from local files only (never the network, unless ``download``).

    Args:
        path: A local directory (or a hub id already in the local cache) holding a fast tokenizer
            with a chat template.
        download: Fetch a hub id that is not cached yet (prompt preparation, which runs first, may; the
            merge then finds it in the cache).

    Returns:
        A ``transformers`` fast tokenizer.

    Raises:
        ConfigError: Nothing loadable is there, the tokenizer is not a fast one, or it has no chat template.

    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=not download)
    except (OSError, ValueError) as error:
        where = "directory" if Path(path).exists() else "path (it does not exist locally)"
        raise ConfigError(
            f"Cannot load a tokenizer from {path}: {error}. Point `model.tokenizer_path` (or `model.path`) "
            f"at a local {where} holding the target's tokenizer files (tokenizer.json and its config).",
            path=path,
        ) from None
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(
            f"The tokenizer at {path} is not a fast (Rust) tokenizer; datagen tokenizes through its Rust "
            "backend. Provide a tokenizer.json next to the tokenizer config.",
            path=path,
        )
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"The tokenizer at {path} has no chat template; training rows must be rendered with the target's "
            "own template. Point `model.tokenizer_path` at the target model's tokenizer.",
            path=path,
        )
    return tokenizer


class _FilesCache:
    """One loaded object per tokenizer folder and process, reloaded when a tokenizer file changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded: dict[str, tuple[tuple[tuple[str, int, int], ...], Any]] = {}

    def get(self, path: str, load: Callable[[str], Any]) -> Any:
        signature = _tokenizer_files_signature(path)
        with self._lock:
            cached = self._loaded.get(path)
            if cached is None or cached[0] != signature:
                cached = (signature, load(path))
                self._loaded[path] = cached
            return cached[1]


_loaded_tokenizers = _FilesCache()
_loaded_specs = _FilesCache()


def shared_tokenizer(path: str, *, download: bool = False) -> Any:
    """:func:`load_tokenizer`, loaded once per process while its files stay unchanged.

    Preflight, prompt preparation's length rule, the exact-token prompt renders of every shard task and the
    merge all run in the flow process: one load (seconds for a real vocabulary) serves them all. Callers
    must not modify it.

    Args:
        path: As for :func:`load_tokenizer`.
        download: As for :func:`load_tokenizer`.

    Returns:
        The loaded tokenizer, the same object for every caller until a tokenizer file changes.

    Raises:
        ConfigError: As for :func:`load_tokenizer`.

    """
    return _loaded_tokenizers.get(path, functools.partial(load_tokenizer, download=download))


def shared_spec(path: str) -> TokenizerSpec:
    """:meth:`TokenizerSpec.load`, once per process while the tokenizer's files stay unchanged.

    Preflight, the exact-token prompt renders of every shard task and the merge run in the flow process; a
    tokenizer folder of a known layout is read without importing transformers (seconds of CPU per process).

    Args:
        path: As for :func:`load_tokenizer`.

    Returns:
        The spec, the same object for every caller until a tokenizer file changes.

    Raises:
        ConfigError: As for :func:`load_tokenizer`.

    """
    spec: TokenizerSpec = _loaded_specs.get(path, TokenizerSpec.load)
    return spec


def _tokenizer_files_signature(path: str) -> tuple[tuple[str, int, int], ...]:
    """Name, mtime and size of the tokenizer files under ``path`` (empty for a hub id)."""
    folder = Path(path)
    signature = []
    for name in TOKENIZER_SOURCE_FILES:
        try:
            stat = (folder / name).stat()
        except OSError:
            continue
        signature.append((name, stat.st_mtime_ns, stat.st_size))
    return tuple(signature)


def render_prompt(
    spec: TokenizerSpec,
    messages: list[Message],
    tools: list[dict[str, Any]] | None,
    enable_thinking: bool | None,
) -> str:
    """A prompt as the server sees it: the chat template with the generation prompt appended.

    The one prompt render: training rows (:class:`RowTokenizer`) and exact-token requests
    (:mod:`datagen.generation.sglang_generate`) both use it, so the ids sent to ``/generate`` are the ids of the
    training row's prompt.

    Args:
        spec: The target tokenizer's spec (only its template and special tokens are used).
        messages: The prompt's messages, ending with the turn to answer.
        tools: Tool schemas, or None.
        enable_thinking: The template's thinking switch (left out when None).

    Returns:
        The rendered text.

    Raises:
        TokenizeError: The template failed to render these messages.

    """
    return spec.render(
        [message.to_chat_dict() for message in messages],
        tools=tools,
        add_generation_prompt=True,
        enable_thinking=enable_thinking,
    )


@dataclass(frozen=True)
class TokenizerSpec:
    """What tokenizing needs from the target's tokenizer, small enough to send to worker processes.

    Workers rebuild the Rust tokenizer from its serialized form and render the chat template in transformers'
    own sandboxed jinja environment (:mod:`datagen.dataset.tokenize_template`), without importing transformers.

    Attributes:
        backend_json: The Rust tokenizer, serialized (empty when only rendering is needed).
        chat_template: The chat template source.
        special_tokens: The template's special-token variables (``eos_token``...), as apply_chat_template passes.

    """

    backend_json: str
    chat_template: str
    special_tokens: dict[str, str]

    @classmethod
    def load(cls, path: str) -> TokenizerSpec:
        """The spec of the tokenizer at ``path``, read without transformers when its layout allows.

        Read from its files when they are a layout known exactly
        (:func:`~datagen.dataset.tokenize_template.read_tokenizer_files`), else loaded through transformers
        (:func:`shared_tokenizer`: once per process).

        Raises:
            ConfigError: As :func:`load_tokenizer`.

        """
        from datagen.dataset.tokenize_template import read_tokenizer_files

        files = read_tokenizer_files(path) if Path(path).is_dir() else None
        if files is None:
            return cls.from_tokenizer(shared_tokenizer(path))
        logger.debug("tokenizer read from its files path=%s", path)
        return cls(files.backend_json, files.chat_template, files.special_tokens)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, with_backend: bool = True) -> TokenizerSpec:
        """The spec of a loaded ``transformers`` fast tokenizer."""
        return cls(
            backend_json=tokenizer.backend_tokenizer.to_str() if with_backend else "",
            chat_template=str(tokenizer.chat_template),
            special_tokens={str(key): str(value) for key, value in tokenizer.special_tokens_map.items()},
        )

    def backend(self) -> Any:
        """A fresh Rust tokenizer (``tokenizers.Tokenizer``)."""
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self.backend_json)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        enable_thinking: bool | None,
    ) -> str:
        """Render like ``apply_chat_template(..., tokenize=False)`` for plain JSON messages.

        Raises:
            TokenizeError: The template failed to render these messages.

        """
        from datagen.dataset.tokenize_template import render_chat_template

        variables: dict[str, Any] = dict(self.special_tokens)
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        try:
            text = render_chat_template(
                self.chat_template,
                messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                variables=variables,
            )
        except (
            Exception
        ) as error:  # jinja raises many types (TemplateError, TypeError...): all mean "cannot render"
            raise TokenizeError(f"The chat template failed to render the conversation: {error}") from error
        if not isinstance(text, str):
            raise TokenizeError(f"The chat template returned {type(text).__name__}, expected text")
        return text
