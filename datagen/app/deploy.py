"""``datagen deploy``: Prefect's own ``prefect deploy --all`` from the checkout, with the commit as version.

It runs from the checkout's root whatever the caller's folder, so the entrypoints resolve; it names the
checkout's commit as the deployments' version (checked by the flow on the worker: see
:mod:`datagen.app.codeversion`); and it creates the process work pool the deployments name when missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from datagen.app.codeversion import checkout_root, code_version
from datagen.errors import ConfigError

PREFECT_FILE = Path("deployments") / "prefect.yaml"
PREFECT_TIMEOUT_S = 600.0


def _deployments(prefect_file: Path) -> list[tuple[str, str | None]]:
    """(name, work pool name) of every deployment in the file."""
    data = yaml.safe_load(prefect_file.read_text()) or {}
    return [
        (str(entry["name"]), (entry.get("work_pool") or {}).get("name"))
        for entry in data.get("deployments") or []
        if entry.get("name")
    ]


def _prefect(args: list[str], repo: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        cwd=repo,
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=PREFECT_TIMEOUT_S,
    )


def deploy(repo: Path | None = None, names: list[str] | None = None) -> tuple[int, str]:
    """Create or update the deployments of ``deployments/prefect.yaml`` against the configured Prefect API.

    Args:
        repo: The checkout; the one holding the installed datagen package when None.
        names: Deployment names to deploy (all when None).

    Returns:
        Prefect's exit code and its output.

    Raises:
        ConfigError: ``repo`` is not a datagen checkout.
    """
    from datagen.app.pullstep import default_checkout

    root = checkout_root(repo or default_checkout()) or (repo or default_checkout())
    prefect_file = root / PREFECT_FILE
    if not prefect_file.is_file():
        raise ConfigError(f"{root} has no {PREFECT_FILE}: run datagen deploy from a datagen checkout.")
    known = _deployments(prefect_file)
    unknown = sorted(set(names or []) - {name for name, _ in known})
    if unknown:
        raise ConfigError(
            f"{prefect_file} has no deployment named {', '.join(unknown)}; it has: "
            + ", ".join(name for name, _ in known)
        )
    chosen = [(name, pool) for name, pool in known if not names or name in names]
    output: list[str] = []
    for pool in sorted({pool for _, pool in chosen if pool}):
        if _prefect(["work-pool", "inspect", pool], root).returncode != 0:
            created = _prefect(["work-pool", "create", pool, "--type", "process"], root)
            output.append(created.stdout + created.stderr)
            if created.returncode != 0:
                return created.returncode, "".join(output)
    version = code_version(root)
    # One call per deployment: `prefect deploy --all` ignores --version.
    for name, _ in chosen:
        args = ["--no-prompt", "deploy", "--prefect-file", str(prefect_file), "--name", name]
        if version:
            args += ["--version", version]
        result = _prefect(args, root)
        output.append(result.stdout + result.stderr)
        if result.returncode != 0:
            return result.returncode, "".join(output)
    return 0, "".join(output)
