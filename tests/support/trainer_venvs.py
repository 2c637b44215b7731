"""Small venvs holding the drafter trainers' data-loading code, for the export contract tests on a CPU box.

``.venv-trainers/specforge`` holds SpecForge's wheel and ``.venv-trainers/speculators`` vllm-project speculators'
wheel at the release we validate against, plus the few pure-Python packages their data modules import and the
``transformers`` release each one pins (SpecForge ``==5.8.1``, speculators ``<=5.19.0``: the dev venv's is
newer). Each is installed from its own lock, ``requirements/trainer-<name>.txt``; torch CPU, numpy, pydantic,
tokenizers, ... come from the locked dev ``.venv`` (:mod:`tests.support.locked_venv`). Their GPU stacks (sglang,
flash-attn, vLLM, torchvision, mooncake) are not installed: the modules the tests and
``benchmarks/compare_trainer_masks.py`` use do not import them. Two small real dependencies are needed at import
time: speculators' package ``__init__`` imports its training data module, which imports ``hs_connectors``
(24 kB, pure Python); SpecForge's pinned transformers checks ``tokenizers<=0.23.0`` and ``huggingface-hub<2`` at
import (installed at those versions in its venv).

Built once (seconds, from the lock) and reused while ``.venv-trainers/<trainer>/.ready`` names the same lock:
``python -m tests.support.trainer_venvs`` (what ``make test`` runs) or on first use by the tests. ``make lock``
re-resolves :data:`TRAINERS` and rewrites the locks.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.support.locked_venv import REPO_ROOT, build_from_lock, is_ready, lock_path, mark_ready

VENV_ROOT = REPO_ROOT / ".venv-trainers"
SPECFORGE_VERSION = "0.2.0"
SPECULATORS_VERSION = "0.9.0"
# Per trainer, the recipe `make lock` resolves: the wheel and packages installed --no-deps at the trainer's pin,
# and light packages installed with their dependencies (resolved against the dev venv's site-packages).
TRAINERS: dict[str, dict[str, tuple[str, ...]]] = {
    "specforge": {
        "no_deps": (f"specforge=={SPECFORGE_VERSION}", "transformers==5.8.1", "tokenizers==0.22.2"),
        "deps": ("datasets>=4,<5.2", "huggingface-hub>=1.5.0,<2.0", "tqdm", "pyyaml"),
    },
    "speculators": {
        "no_deps": (f"speculators=={SPECULATORS_VERSION}", "transformers==5.19.0", "hs-connectors==0.9.0"),
        "deps": ("datasets>=4.0.0,<=5.1.0", "tqdm", "loguru==0.7.3", "rich", "httpx"),
    },
}


def venv_python(trainer: str) -> Path:
    """The interpreter of the venv holding ``trainer``'s data code."""
    return VENV_ROOT / trainer / "bin" / "python"


def lock_name(trainer: str) -> str:
    """The lock file's name (``requirements/<name>.txt``) of ``trainer``'s venv."""
    return f"trainer-{trainer}"


def ensure_venv(trainer: str) -> Path:
    """Build (once) the venv of ``trainer`` (``specforge`` or ``speculators``) from its lock."""
    venv = VENV_ROOT / trainer
    lock = lock_path(lock_name(trainer))
    if not is_ready(venv, lock):
        build_from_lock(venv, lock)
        mark_ready(venv, lock)
    return venv_python(trainer)


def main() -> int:
    """Build both trainers' venvs (``make test`` runs this first)."""
    for trainer in TRAINERS:
        print(f"{trainer}: {ensure_venv(trainer)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
