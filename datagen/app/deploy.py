"""``datagen deploy``: Prefect's own ``prefect deploy --all`` from the checkout, with the commit as version.

It runs from the checkout's root whatever the caller's folder, so the entrypoints resolve; it names the
checkout's commit as the deployments' version (checked by the flow on the worker: see
:mod:`datagen.app.codeversion`); and it creates or updates the process work pool the deployments name with
the checkout's ``deployments/work-pool.json`` as its base job template.

That template is the box's, not the run's: the command the worker starts, its environment and its working
folder are fixed in ``job_configuration`` and left out of the per-run ``variables`` schema, which allows no
other keys. So the server refuses (HTTP 422) a run that sends job variable ``command``, ``env`` or
``working_dir``, and the flow refuses one that reached a worker some other way (:func:`refused_job_variables`).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from datagen.app.codeversion import checkout_root, code_version
from datagen.app.request import CONFIGS_FOLDER, config_names
from datagen.errors import ConfigError

PREFECT_FILE = Path("deployments") / "prefect.yaml"
# The work pool's base job template: what the worker runs and with which environment (the operator's).
POOL_TEMPLATE = Path("deployments") / "work-pool.json"
PREFECT_TIMEOUT_S = 600.0
# The deployments of the flow whose runs pick one of the box's configs by name.
EXPAND_ENTRYPOINT = "flows/expand.py:expand"


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
    template = str(root / POOL_TEMPLATE)
    for pool in sorted({pool for _, pool in chosen if pool}):
        # `update` changes the template alone (a paused pool stays paused, its concurrency limit stays);
        # `create --overwrite` would reset them.
        if _prefect(["work-pool", "inspect", pool], root).returncode == 0:
            written = _prefect(["work-pool", "update", pool, "--base-job-template", template], root)
        else:
            written = _prefect(
                ["work-pool", "create", pool, "--type", "process", "--base-job-template", template], root
            )
        output.append(written.stdout + written.stderr)
        if written.returncode != 0:
            return written.returncode, "".join(output)
    version = code_version(root)
    with tempfile.TemporaryDirectory(prefix="datagen-deploy-") as folder:
        # One `prefect deploy` for all of them (each call costs seconds of Prefect imports). With several
        # deployments it ignores --version, so the version goes into a copy of the file, outside the checkout
        # (which must stay clean: a changed file there would make the version "-dirty"), with the configs a
        # run may pick named in the description of each deployment that leaves `config` to the run.
        deploy_file = _deploy_copy(prefect_file, version, config_names(root / CONFIGS_FOLDER), Path(folder))
        args = ["--no-prompt", "deploy", "--prefect-file", str(deploy_file)]
        for name, _ in chosen:
            args += ["--name", name]
        result = _prefect(args, root)
    output.append(result.stdout + result.stderr)
    if result.returncode == 0:
        _store_form_schemas([name for name, _ in chosen])
    return result.returncode, "".join(output)


def form_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A flow's parameter schema as the run form should draw it: an optional field is one empty field.

    Pydantic writes a parameter ``x: str | None = None`` as ``anyOf: [string, null]`` with ``default: null``;
    Prefect's UI draws that as a ``str | None`` toggle set to None ("Property is type None") and the
    deployment page shows neither type nor default. Written as its plain type without a default, the form
    draws one field left empty, and the server still takes null for it (its validation makes a property with
    a type and no default nullable). An optional nested model (``sampling``) keeps its ``anyOf``: a bare
    ``$ref`` would not be made nullable.
    """
    result = copy.deepcopy(schema)
    for model in [result, *(result.get("definitions") or {}).values()]:
        required = set(model.get("required") or [])
        for name, field in (model.get("properties") or {}).items():
            choices = field.get("anyOf")
            if name in required or field.get("default", ...) is not None or not isinstance(choices, list):
                continue
            kept = [choice for choice in choices if choice != {"type": "null"}]
            if len(kept) == len(choices) - 1 == 1 and "type" in kept[0]:
                del field["anyOf"], field["default"]
                field.update(kept[0])
    return result


def _store_form_schemas(names: list[str]) -> None:
    """Give the deployments just deployed their :func:`form_schema` (Prefect stores the pydantic one)."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    async def store() -> None:
        async with get_client() as client:
            found = await client.read_deployments(
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=names))
            )
            for deployment in found:
                schema = deployment.parameter_openapi_schema or {}
                drawn = form_schema(schema)
                if drawn != schema:
                    await client.update_deployment(
                        deployment.id, DeploymentUpdate(parameter_openapi_schema=drawn)
                    )

    asyncio.run(store())


def configs_note(names: list[str]) -> str:
    """The sentence a deployment's description gets: the configs a run may pick (``config`` has no default).

    Not an enum in the parameter schema: the schema is the deploying checkout's, and the box's operator may
    add a config to its own ``configs/`` folder without a new deployment.
    """
    listed = ", ".join(names) if names else "none yet"
    return (
        f"Configs of this commit (config): {listed}; or another configs/<name>.yaml the box's operator added."
    )


def _deploy_copy(prefect_file: Path, version: str | None, names: list[str], folder: Path) -> Path:
    """A copy of ``prefect_file`` in ``folder``, each deployment with ``version`` and, when it gives no config, ``names``.

    The expand deployments that leave ``config`` to the run get the checkout's configs in their description.
    """
    data = yaml.safe_load(prefect_file.read_text())
    for entry in data.get("deployments") or []:
        if version:
            entry["version"] = version
        if entry.get("entrypoint") == EXPAND_ENTRYPOINT and "config" not in (entry.get("parameters") or {}):
            entry["description"] = f"{str(entry.get('description') or '').rstrip()}\n\n{configs_note(names)}"
    copy = folder / prefect_file.name
    copy.write_text(yaml.safe_dump(data, sort_keys=False))
    return copy


def pool_template(root: Path) -> dict[str, Any]:
    """The base job template ``datagen deploy`` gives the checkout's work pool (``deployments/work-pool.json``)."""
    template: dict[str, Any] = json.loads((root / POOL_TEMPLATE).read_text())
    return template


def refused_job_variables(job_variables: Mapping[str, Any] | None, template: Mapping[str, Any]) -> list[str]:
    """The job variables a run sent that the pool's template does not offer it, sorted.

    The server refuses these at create-flow-run for a pool ``datagen deploy`` wrote; a run still carrying them
    reached the worker through a pool with another template (Prefect's default lets a run replace the command
    the worker starts) or through an API call that skips the check, and must not go on.
    """
    offered = set((template.get("variables") or {}).get("properties") or {})
    return sorted(set(job_variables or {}) - offered)
