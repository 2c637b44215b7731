"""``datagen deploy``: Prefect's own ``prefect deploy --all`` from the checkout, with the commit as version.

It runs from the checkout's root whatever the caller's folder, so the entrypoints resolve; it names the
checkout's commit as the deployments' version (checked by the flow on the worker: see
:mod:`datagen.app.codeversion`); and it creates the process work pool the deployments name when missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
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
    with tempfile.TemporaryDirectory(prefix="datagen-deploy-") as folder:
        # One `prefect deploy` for all of them (each call costs seconds of Prefect imports). With several
        # deployments it ignores --version, so the version goes into a copy of the file, outside the checkout
        # (which must stay clean: a changed file there would make the version "-dirty").
        deploy_file = _with_version(prefect_file, version, Path(folder)) if version else prefect_file
        args = ["--no-prompt", "deploy", "--prefect-file", str(deploy_file)]
        for name, _ in chosen:
            args += ["--name", name]
        result = _prefect(args, root)
    output.append(result.stdout + result.stderr)
    return result.returncode, "".join(output)


def _with_version(prefect_file: Path, version: str, folder: Path) -> Path:
    """A copy of ``prefect_file`` in ``folder`` whose every deployment has ``version``."""
    data = yaml.safe_load(prefect_file.read_text())
    for entry in data.get("deployments") or []:
        entry["version"] = version
    copy = folder / prefect_file.name
    copy.write_text(yaml.safe_dump(data, sort_keys=False))
    return copy
