"""Which flags an installed sglang accepts, asked of sglang's own argument parser in its interpreter.

Since sglang 0.5.2x the launch flags are defined across ``sglang/srt/arg_groups/``; reading the text of
``server_args.py`` finds a handful of them. So :func:`sglang_flags` runs
:mod:`datagen.engines.sglang_introspect` in the serving interpreter (a subprocess: the orchestrator never
imports sglang or torch) and caches the answer per interpreter and sglang version under the user cache
folder (``$XDG_CACHE_HOME/datagen/sglang-flags``), since one run costs a few seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

INTROSPECT_SCRIPT = Path(__file__).with_name("sglang_introspect.py")
# Importing sglang's server args pulls in torch; a cold start on a busy host takes tens of seconds.
INTROSPECT_TIMEOUT_S = 300.0
# What each introspection mode asks sglang for, as an error message names it.
INTROSPECT_WHAT = {"flags": "launch flags", "check": "check of the planned launches and requests"}
VERSION_TIMEOUT_S = 60.0
CACHE_SUBDIR = Path("datagen") / "sglang-flags"
_VERSION_CODE = (
    "import importlib.metadata as m\n"
    "try:\n    print(m.version('sglang'))\n"
    "except m.PackageNotFoundError:\n    pass\n"
)


class SGLangIntrospectionError(RuntimeError):
    """The installed sglang could not be asked for its flags (the message carries its error output)."""


def cache_dir() -> Path:
    """Where flag lists are cached: ``$XDG_CACHE_HOME/datagen/sglang-flags`` (``~/.cache`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / CACHE_SUBDIR


def sglang_version(python: str | None = None) -> str | None:
    """The sglang version installed for ``python`` (this interpreter when None); None when absent."""
    # Not resolved: a venv's python is a symlink to the base interpreter, but its packages differ.
    if python is None or os.path.abspath(python) == os.path.abspath(sys.executable):
        import importlib.metadata

        try:
            return importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            return None
    result = subprocess.run(
        [python, "-c", _VERSION_CODE], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S, check=False
    )
    return result.stdout.strip() or None


def run_introspection(python: str, mode: str, request: object | None = None) -> dict[str, object]:
    """Run the introspection script in ``python`` and return its JSON answer.

    Args:
        python: The serving interpreter.
        mode: ``flags`` or ``check``.
        request: The JSON request of ``check``.

    Returns:
        The decoded answer.

    Raises:
        SGLangIntrospectionError: The script failed or printed no JSON.

    """
    result = subprocess.run(
        [python, str(INTROSPECT_SCRIPT), mode],
        input=json.dumps(request) if request is not None else "",
        capture_output=True,
        text=True,
        timeout=INTROSPECT_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise SGLangIntrospectionError(
            f"asking sglang in {python} for its {INTROSPECT_WHAT.get(mode, mode)} failed "
            f"(exit {result.returncode}): {tail}; run `{python} {INTROSPECT_SCRIPT} flags` to see the whole "
            "error"
        )
    try:
        answer = json.loads(result.stdout)
    except json.JSONDecodeError as error:
        raise SGLangIntrospectionError(f"sglang introspection in {python} printed no JSON: {error}") from None
    if not isinstance(answer, dict):
        raise SGLangIntrospectionError(f"sglang introspection in {python} printed {type(answer).__name__}")
    return answer


def flags_from_answer(answer: dict[str, object]) -> list[str]:
    """Every option string of the ``flags`` answer, sorted."""
    actions = answer.get("actions")
    if not isinstance(actions, list):
        raise SGLangIntrospectionError("sglang introspection answer has no 'actions' list")
    return sorted({option for action in actions for option in action["option_strings"]})


def sglang_flags(python: str | None = None, *, use_cache: bool = True) -> list[str] | None:
    """The launch flags the sglang of ``python`` accepts, from its own parser (cached).

    Args:
        python: The serving interpreter; this one when None.
        use_cache: Read and write the per-interpreter-and-version cache.

    Returns:
        The sorted flags, None when sglang is not installed for ``python``.

    Raises:
        SGLangIntrospectionError: sglang is installed but its parser could not be read.

    """
    interpreter = python or sys.executable
    version = sglang_version(interpreter)
    if version is None:
        return None
    key = hashlib.sha256(f"{os.path.abspath(interpreter)}\0{version}".encode()).hexdigest()[:16]
    cached = cache_dir() / f"{version}-{key}.json"
    if use_cache and cached.is_file():
        try:
            return list(json.loads(cached.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            logger.warning("sglang flag cache unreadable path=%s: asking sglang again", cached)
    flags = flags_from_answer(run_introspection(interpreter, "flags"))
    logger.info("sglang flags read version=%s flags=%d python=%s", version, len(flags), interpreter)
    if use_cache:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            temporary = cached.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(flags), encoding="utf-8")
            temporary.replace(cached)
        except OSError as error:
            logger.warning("sglang flag cache not written path=%s error=%s", cached, error)
    return flags
