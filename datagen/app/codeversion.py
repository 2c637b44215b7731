"""Which code a deployment names, and the check that a worker runs exactly that code.

``datagen deploy`` records the checkout's commit as the deployment's version (``git-<sha>``, with
``-dirty`` when the tree had uncommitted changes). A worker runs the flow from its own checkout, so before
anything is stopped or started the flow compares that checkout's commit with the version it was deployed
as, and refuses to run on a mismatch with the commands that update the box.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from datagen.errors import CodeVersionError

VERSION_PREFIX = "git-"
DIRTY_SUFFIX = "-dirty"
GIT_TIMEOUT_S = 30.0


def _git(repo: Path, *args: str) -> str | None:
    try:
        result = subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def checkout_root(start: Path) -> Path | None:
    """The top folder of the git checkout holding ``start`` (None: not in a checkout)."""
    found = _git(start if start.is_dir() else start.parent, "rev-parse", "--show-toplevel")
    return Path(found) if found else None


def code_version(repo: Path) -> str | None:
    """The deployment version of a checkout: ``git-<sha>``, plus ``-dirty`` with uncommitted changes.

    Returns:
        None when ``repo`` is not a git checkout (or git is missing).
    """
    sha = _git(repo, "rev-parse", "HEAD")
    if not sha:
        return None
    dirty = _git(repo, "status", "--porcelain", "--untracked-files=no")
    return f"{VERSION_PREFIX}{sha}{DIRTY_SUFFIX if dirty else ''}"


def check_code_version(expected: str | None, repo: Path) -> str | None:
    """Refuse to run when the checkout is not at the commit the deployment names.

    Args:
        expected: The deployment's version; only ``git-<sha>[-dirty]`` versions (from ``datagen deploy``)
            are checked, anything else (a plain ``prefect deploy``, a local run) passes.
        repo: The checkout the flow's code was loaded from.

    Returns:
        The checkout's version (None when it is not a checkout and nothing was expected).

    Raises:
        CodeVersionError: The commits differ, or a commit was expected but ``repo`` is no checkout.
    """
    actual = code_version(repo)
    if not expected or not expected.startswith(VERSION_PREFIX):
        return actual
    wanted = expected.removeprefix(VERSION_PREFIX).removesuffix(DIRTY_SUFFIX)
    have = (actual or "").removeprefix(VERSION_PREFIX).removesuffix(DIRTY_SUFFIX)
    if have != wanted:
        raise CodeVersionError(
            f"This deployment runs commit {wanted[:12]} but the worker's checkout {repo} is at "
            f"{have[:12] or 'no git commit'}: refusing to run other code than was deployed. Update the box: "
            f"`git -C {repo} fetch && git -C {repo} checkout {wanted}` (then restart the worker), or deploy "
            "the box's commit with `datagen deploy` from that checkout.",
            expected=wanted,
            actual=have,
        )
    return actual
