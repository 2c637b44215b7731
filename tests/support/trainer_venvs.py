"""Small venvs holding the drafter trainers' data-loading code, for the export contract tests on a CPU box.

``.venv-trainers/specforge`` holds SpecForge's wheel and ``.venv-trainers/speculators`` vllm-project speculators'
wheel, each installed ``--no-deps`` from PyPI at the release we validate against, plus the few pure-Python
packages their data modules import and the ``transformers`` release each one pins (SpecForge ``==5.8.1``,
speculators ``<=5.19.0``: the test interpreter's is newer). Everything else (torch CPU, numpy, pydantic,
tokenizers, ...) comes from the interpreter running the tests, through a ``.pth`` file that appends its
site-packages. Their GPU stacks (sglang, flash-attn, vLLM, torchvision, mooncake) are not installed: the
modules the tests and ``benchmarks/compare_trainer_masks.py`` use do not import them. Two small real
dependencies are needed at import time: speculators' package ``__init__`` imports its training data module,
which imports ``hs_connectors`` (24 kB, pure Python, installed ``--no-deps``); SpecForge's pinned transformers
checks ``tokenizers<=0.23.0`` and ``huggingface-hub<2`` at import (installed at those versions in its venv).

Built once (about a minute each, from PyPI) and reused while ``.venv-trainers/<trainer>/.ready`` names the same
packages: ``python -m tests.support.trainer_venvs`` (what ``make test`` runs) or on first use by the tests.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_ROOT = REPO_ROOT / ".venv-trainers"
SPECFORGE_VERSION = "0.2.0"
SPECULATORS_VERSION = "0.9.0"
READY_MARKER = ".ready"
PIP_TIMEOUT_S = 600
# Per trainer: the wheel (--no-deps), packages installed --no-deps at the trainer's pin, and light packages
# installed with their dependencies (resolved against the test interpreter's site-packages).
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


def _pip(venv: Path, *args: str) -> None:
    command = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", *args]
    subprocess.run(command, check=True, timeout=PIP_TIMEOUT_S)


def ensure_venv(trainer: str) -> Path:
    """Build (once) the venv of ``trainer`` (``specforge`` or ``speculators``); returns its interpreter."""
    venv = VENV_ROOT / trainer
    spec = TRAINERS[trainer]
    stamp = " ".join(spec["no_deps"] + spec["deps"]) + "\n"
    marker = venv / READY_MARKER
    if marker.is_file() and marker.read_text() == stamp:
        return venv_python(trainer)
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(
        subprocess.run(
            [str(venv_python(trainer)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # After the venv's own packages: the test interpreter's torch, numpy, pydantic, tokenizers, ...
    (site / "zz_test_interpreter.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _pip(venv, "--no-deps", *spec["no_deps"])
    _pip(venv, *spec["deps"])
    marker.write_text(stamp)
    return venv_python(trainer)


def main() -> int:
    """Build both trainers' venvs (``make test`` runs this first)."""
    for trainer in TRAINERS:
        print(f"{trainer}: {ensure_venv(trainer)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
