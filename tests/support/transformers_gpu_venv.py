"""A small venv holding the transformers release the GPU serving set pins, for the chat-template tests.

datagen renders chat templates without importing transformers (``datagen/dataset/tokenize_template.py``
transcribes transformers' jinja environment). The dev ``.venv``'s transformers checks that copy in the tests;
``.venv-transformers-gpu`` checks it against the releases ``requirements/gpu.txt`` pins, the ones a GPU host's
SGLang renders prompts with: ``transformers``, ``huggingface-hub`` and ``tokenizers`` at gpu.txt's versions
(:func:`recipe`), installed from their own lock ``requirements/transformers-gpu.txt``; jinja2, numpy and the rest
come from the locked dev ``.venv`` (:mod:`tests.support.locked_venv`), where gpu.txt pins the same jinja2.

Built once (seconds, from the lock) and reused while ``.venv-transformers-gpu/.ready`` names the same lock:
``python -m tests.support.transformers_gpu_venv`` (what ``make test`` runs) or on first use by the tests.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tests.support.locked_venv import LOCK_DIR, REPO_ROOT, build_from_lock, is_ready, lock_path, mark_ready

VENV = REPO_ROOT / ".venv-transformers-gpu"
LOCK_NAME = "transformers-gpu"
# The packages whose releases decide a render and a tokenization: taken at the serving set's versions.
PACKAGES = ("transformers", "huggingface-hub", "tokenizers")


def gpu_versions() -> dict[str, str]:
    """``{package: version}`` of :data:`PACKAGES` in ``requirements/gpu.txt``."""
    text = (LOCK_DIR / "gpu.txt").read_text()
    return {name: re.search(rf"^{name}==(\S+)", text, re.M)[1] for name in PACKAGES}  # type: ignore[index]


def recipe() -> tuple[list[str], list[str]]:
    """What ``make lock`` resolves: the serving set's releases, ``--no-deps`` (the dev venv has the rest)."""
    return [f"{name}=={version}" for name, version in gpu_versions().items()], []


def ensure_venv() -> Path:
    """Build (once) the venv from its lock; returns its interpreter."""
    lock = lock_path(LOCK_NAME)
    if not is_ready(VENV, lock):
        build_from_lock(VENV, lock)
        mark_ready(VENV, lock)
    return VENV / "bin" / "python"


def main() -> int:
    """Build the venv (``make test`` runs this first)."""
    print(f"{LOCK_NAME}: {ensure_venv()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
