"""The target's chat template and tokenizer files, read and rendered without importing transformers.

Importing transformers (and torch with it) costs seconds of CPU in every process that tokenizes; the merge
needs only the Rust tokenizer and the chat template. This module renders the template in the same sandboxed
jinja environment as transformers' ``apply_chat_template`` (same options, filters, globals and extension; the
environment is transcribed from transformers 5.x ``utils/chat_template_utils.py``, Apache-2.0) and reads the
tokenizer folder the way transformers does for the one layout it recognises with certainty: a
``Qwen2Tokenizer`` with a ``tokenizer.json`` (see :func:`read_tokenizer_files`). Anything else is left to
transformers. ``tests/unit/test_tokenize_template.py`` checks renders and loaded files against transformers.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Files whose presence means transformers merges more into the tokenizer than this module reproduces.
_LEGACY_FILES = ("special_tokens_map.json", "added_tokens.json")
_EXTRA_TEMPLATES_DIR = "additional_chat_templates"
# The named special tokens transformers passes to every template (``special_tokens_map``).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Tokenizer classes whose files this module reads, with the special tokens their constructor defaults to.
_QWEN2_DEFAULTS: dict[str, str | None] = {
    "unk_token": "<|endoftext|>",
    "bos_token": None,
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
}
# Qwen2Tokenizer rebuilds the Qwen2 pipeline around the file's vocabulary; TokenizersBackend uses the file as is.
KNOWN_TOKENIZER_CLASSES: dict[str, dict[str, str | None]] = {
    "Qwen2Tokenizer": _QWEN2_DEFAULTS,
    "Qwen2TokenizerFast": _QWEN2_DEFAULTS,
    "TokenizersBackend": {},
}
_REBUILDS_QWEN2_PIPELINE = {"Qwen2Tokenizer", "Qwen2TokenizerFast"}
_ADDED_TOKEN_FIELDS = ("content", "lstrip", "rstrip", "normalized", "single_word", "special")
# Message fields a template may read reasoning from; transformers copies the first one set to the others.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@dataclass(frozen=True)
class TokenizerFiles:
    """What a tokenizer folder holds that tokenizing needs.

    Attributes:
        backend_json: ``tokenizer.json``'s text.
        chat_template: The chat template source.
        special_tokens: The template's special-token variables, as transformers' ``special_tokens_map``.

    """

    backend_json: str
    chat_template: str
    special_tokens: dict[str, str]


def read_tokenizer_files(path: str) -> TokenizerFiles | None:
    """Read a tokenizer folder without transformers, or None when transformers must load it.

    Accepted: a local folder with ``tokenizer.json`` and ``tokenizer_config.json`` naming ``TokenizersBackend``
    (transformers uses the file as it is) or a Qwen2 tokenizer class with a ``tokenizer.json`` whose pipeline is
    the one that class rebuilds (so both give the same ids); added tokens the config lists and special tokens it
    names already in the file, unchanged (transformers would add or alter them otherwise); one chat template
    (``chat_template.jinja``, else the config's string); special tokens as plain strings. Anything else (hub
    ids, legacy files, several named templates, token objects, other classes) returns None.

    Args:
        path: The tokenizer folder.

    Returns:
        The files, or None.

    """
    from datagen.dataset.tokenize_text import TextEncoder

    folder = Path(path)
    if not (folder / TOKENIZER_FILE).is_file() or not (folder / TOKENIZER_CONFIG_FILE).is_file():
        return None
    if (folder / _EXTRA_TEMPLATES_DIR).exists():
        return None
    config = json.loads((folder / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
    tokenizer_class = str(config.get("tokenizer_class"))
    defaults = KNOWN_TOKENIZER_CLASSES.get(tokenizer_class)
    if defaults is None or config.get("add_prefix_space") or config.get("split_special_tokens"):
        return None
    if "added_tokens_decoder" not in config and any((folder / name).exists() for name in _LEGACY_FILES):
        return None
    template_file = folder / CHAT_TEMPLATE_FILE
    template = (
        template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
    )
    if not isinstance(template, str) or not template:
        return None
    special_tokens = _special_tokens(config, defaults)
    if special_tokens is None:
        return None
    backend_json = (folder / TOKENIZER_FILE).read_text(encoding="utf-8")
    backend = json.loads(backend_json)
    if tokenizer_class in _REBUILDS_QWEN2_PIPELINE and not TextEncoder.supports(backend):
        return None
    if not _added_tokens_unchanged(config, backend, special_tokens):
        return None
    return TokenizerFiles(backend_json, template, special_tokens)


def _added_tokens_unchanged(config: dict[str, Any], backend: dict[str, Any], special: dict[str, str]) -> bool:
    """Tell whether transformers would leave the file's added tokens as they are.

    It adds (or re-adds with other settings) every ``added_tokens_decoder`` entry of the config that differs from
    the file's, and every special token (named or listed) the file lacks.
    """
    in_file = {
        int(token["id"]): tuple(token.get(field) for field in _ADDED_TOKEN_FIELDS)
        for token in backend.get("added_tokens") or []
    }
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        return False
    for token_id, token in decoder.items():
        if not isinstance(token, dict):
            return False
        if in_file.get(int(token_id)) != tuple(token.get(field) for field in _ADDED_TOKEN_FIELDS):
            return False
    contents = {fields[0] for fields in in_file.values()}
    listed = [
        token
        for key in ("extra_special_tokens", "additional_special_tokens")
        if isinstance(config.get(key), list)
        for token in config[key]
    ]
    return all(isinstance(token, str) and token in contents for token in [*special.values(), *listed])


def _special_tokens(config: dict[str, Any], defaults: dict[str, str | None]) -> dict[str, str] | None:
    """The ``special_tokens_map`` transformers builds from this config, or None when a value is not a plain string."""
    named: dict[str, Any] = {**defaults, **{key: config[key] for key in SPECIAL_TOKEN_NAMES if key in config}}
    # Model-specific named tokens: other ``*_token`` keys, and ``extra_special_tokens`` given as a mapping.
    extra = {
        key: value
        for key, value in config.items()
        if key not in SPECIAL_TOKEN_NAMES and key.endswith("_token") and isinstance(value, str)
    }
    for key in ("extra_special_tokens", "model_specific_special_tokens"):
        if isinstance(config.get(key), dict):
            extra.update(config[key])
    tokens: dict[str, str] = {}
    for key, value in {**named, **extra}.items():
        if value is None:
            continue
        if not isinstance(value, str):
            return None
        tokens[key] = value
    return tokens


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    variables: dict[str, Any],
) -> str:
    """Render plain JSON chat messages like ``apply_chat_template(..., tokenize=False)``.

    Args:
        template: The chat template source.
        messages: Chat-template message dicts (JSON values only, no None values).
        tools: Tool schemas, or None.
        add_generation_prompt: Append the assistant turn opener.
        variables: Special-token variables and template switches (``enable_thinking``...).

    Returns:
        The rendered text.

    Raises:
        jinja2.TemplateError: And any other error the template raises: the conversation cannot be rendered.

    """
    text: str = compile_chat_template(template).render(
        messages=_alias_reasoning_fields(messages),
        tools=tools,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **variables,
    )
    return text


def _alias_reasoning_fields(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fill ``thinking`` and ``reasoning_content`` from the first reasoning field set, as transformers does."""
    aliased = []
    for message in messages:
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


@functools.lru_cache(maxsize=8)
def compile_chat_template(template: str) -> Any:
    """The template compiled in transformers' sandboxed environment (cached per source)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        # transformers' AssistantTracker: `{% generation %}...{% endgeneration %}` renders its body; the
        # assistant-mask tracking it adds is not used here.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

        def _render_body(self, caller: Any) -> str:
            text: str = caller()
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Not jinja's own tojson, which escapes HTML characters.
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateDict:
        # `dict` without attribute access to the real type.
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # Namespaces that refuse underscore-prefixed attributes (no reach into CPython internals).
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
                )

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    environment.globals["dict"] = TemplateDict()
    environment.globals["namespace"] = TemplateNamespace
    return environment.from_string(template)
