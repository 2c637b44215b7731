"""``datagen deploy``: Prefect's own ``prefect deploy --all`` from the checkout, with the commit as version.

It runs from the checkout's root whatever the caller's folder, so the entrypoints resolve; it names the
checkout's commit as the deployments' version (checked by the flow on the worker: see
:mod:`datagen.app.codeversion`); and it creates or updates the process work pool the deployments name with
the checkout's ``deployments/work-pool.json`` as its base job template.

That template is the box's, not the run's: the command the worker starts, its environment and its working
folder are fixed in ``job_configuration`` and left out of the per-run ``variables`` schema, which allows no
other keys. So the server refuses (HTTP 422) a run that sends job variable ``command``, ``env`` or
``working_dir``, and the flow refuses one that reached a worker some other way (:func:`refused_job_variables`).

The deployments' parameters are the run's choices and nothing else: after ``prefect deploy`` each deployment's
parameter schema is closed (``"additionalProperties": false``, which Prefect's deploy leaves out) with its
enforcement on, so the server refuses (HTTP 409, naming the parameter) a run that sends one the flow does not
have (``training``, ``fleet``, ``config_path``...) or names a config the checkout lacks (``config`` is an enum
of the checkout's configs, refreshed on every deploy) before any flow run exists.
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
from datagen.app.run_request import CONFIGS_FOLDER, config_names
from datagen.errors import ConfigError

PREFECT_FILE = Path("deployments") / "prefect.yaml"
# The work pool's base job template: what the worker runs and with which environment (the operator's).
POOL_TEMPLATE = Path("deployments") / "work-pool.json"
PREFECT_TIMEOUT_S = 600.0
# The deployments of the flow whose runs pick one of the box's configs by name.
EXPAND_ENTRYPOINT = "flows/expand.py:expand"
# How a parameter schema refers to one of its models.
DEFINITIONS_REF = "#/definitions/"


def _deployments(prefect_file: Path) -> list[tuple[str, str | None, str]]:
    """(name, work pool name, entrypoint) of every deployment in the file."""
    data = yaml.safe_load(prefect_file.read_text()) or {}
    return [
        (str(entry["name"]), (entry.get("work_pool") or {}).get("name"), str(entry.get("entrypoint") or ""))
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

    The work pool first (its template), then ``prefect deploy``, then each deployment's parameter schema
    closed to the flow's own parameters (:func:`closed_schema`).

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
    unknown = sorted(set(names or []) - {name for name, _, _ in known})
    if unknown:
        raise ConfigError(
            f"{prefect_file} has no deployment named {', '.join(unknown)}; it has: "
            + ", ".join(name for name, _, _ in known)
        )
    chosen = [entry for entry in known if not names or entry[0] in names]
    output: list[str] = []
    template = str(root / POOL_TEMPLATE)
    for pool in sorted({pool for _, pool, _ in chosen if pool}):
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
        for name, _, _ in chosen:
            args += ["--name", name]
        result = _prefect(args, root)
    output.append(result.stdout + result.stderr)
    if result.returncode != 0:
        return result.returncode, "".join(output)
    code, said = _close_parameter_schemas({(name, entrypoint) for name, _, entrypoint in chosen}, root)
    output.append(said)
    return code, "".join(output)


def closed_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` (a deployment's parameter schema) allowing no top-level parameter it does not list."""
    return {**schema, "additionalProperties": False}


def _close_parameter_schemas(chosen: set[tuple[str, str]], root: Path) -> tuple[int, str]:
    """Close the parameter schema of the deployments ``prefect deploy`` just wrote, enforcement on.

    The schema stored is also the one the run form draws (:func:`form_schema`).

    Prefect builds a deployment's schema from the flow's signature without ``additionalProperties``, so its
    server takes any extra parameter at create-flow-run, and Prefect on the worker then crashes the run on
    it. With the schema closed and ``enforce_parameter_schema`` on, the server refuses such a run at once.
    ``chosen`` holds (name, entrypoint) pairs: a name alone may also be another flow's deployment.
    """
    names = sorted({name for name, _ in chosen})
    listed = _prefect(
        [
            "api",
            "POST",
            "/deployments/filter",
            "--data",
            json.dumps({"deployments": {"name": {"any_": names}}}),
        ],
        root,
    )
    if listed.returncode != 0:
        return listed.returncode, f"listing the deployments failed: {listed.stdout}{listed.stderr}"
    found = [entry for entry in json.loads(listed.stdout) if (entry["name"], entry["entrypoint"]) in chosen]
    missing = chosen - {(entry["name"], entry["entrypoint"]) for entry in found}
    if missing:
        return 1, "prefect deploy left no deployment " + ", ".join(sorted(name for name, _ in missing)) + "\n"
    said = []
    names = config_names(root / CONFIGS_FOLDER)
    for entry in found:
        schema = with_config_choices(form_schema(entry["parameter_openapi_schema"] or {}), names)
        update = {"parameter_openapi_schema": closed_schema(schema), "enforce_parameter_schema": True}
        patched = _prefect(
            ["api", "PATCH", f"/deployments/{entry['id']}", "--data", json.dumps(update)], root
        )
        if patched.returncode != 0:
            return patched.returncode, f"closing the parameters of {entry['name']} failed: {patched.stderr}"
        said.append(f"deployment={entry['name']} parameters=closed (no parameter but the flow's own)\n")
    return 0, "".join(said)


def with_config_choices(schema: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """``schema`` whose ``config`` parameter is one of ``names`` (the checkout's configs), as an enum.

    The run form then offers the box's configs as a list, and the server refuses any other name at
    create-flow-run (HTTP 409), before a flow run exists. Written on every deploy: a config the operator adds
    or removes reaches the form with the next ``datagen deploy``. A schema without a ``config`` parameter, or
    a checkout without configs, is left as it is (the flow still refuses an unknown name).
    """
    result = copy.deepcopy(dict(schema))
    field = (result.get("properties") or {}).get("config")
    if isinstance(field, dict) and field.get("type") == "string" and names:
        field["enum"] = list(names)
    return result


def form_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A flow's parameter schema as the run form should draw it: an optional field is one empty field.

    Pydantic writes a parameter ``x: str | None = None`` as ``anyOf: [string, null]`` with ``default: null``;
    Prefect's UI draws that as a ``str | None`` toggle set to None ("Property is type None") and the
    deployment page shows neither type nor default. Written as its plain type without a default, the form
    draws one field left empty, and the server still takes null for it (its validation makes a property with
    a type and no default nullable). An optional nested model (``sampling: SamplingChoice | None``) is written
    the same way: its model inlined as a plain ``object`` section, whose own optional fields are plain too
    (a bare ``$ref`` would not be made nullable, an inlined ``type: object`` is).
    """
    result = copy.deepcopy(schema)
    definitions = result.get("definitions") or {}
    for model in [result, *definitions.values()]:
        required = set(model.get("required") or [])
        for name, field in (model.get("properties") or {}).items():
            choices = field.get("anyOf")
            if name in required or field.get("default", ...) is not None or not isinstance(choices, list):
                continue
            kept = [choice for choice in choices if choice != {"type": "null"}]
            if len(kept) != 1 or len(choices) != 2:
                continue
            if "type" in kept[0]:
                del field["anyOf"], field["default"]
                field.update(kept[0])
            elif _inlinable(kept[0], definitions):
                del field["anyOf"], field["default"]
                inlined = definitions[kept[0]["$ref"].removeprefix(DEFINITIONS_REF)]
                field.update({key: value for key, value in inlined.items() if key not in field})
    referenced = json.dumps(result["properties"])
    for name in list(definitions):
        if f'"{DEFINITIONS_REF}{name}"' not in referenced:
            del definitions[name]
    if "definitions" in result and not definitions:
        del result["definitions"]
    return result


def _inlinable(choice: Mapping[str, Any], definitions: Mapping[str, Any]) -> bool:
    """True for a ``$ref`` to a flat object model (no model inside it): it can be drawn as a section."""
    reference = choice.get("$ref")
    if not isinstance(reference, str) or not reference.startswith(DEFINITIONS_REF):
        return False
    model = definitions.get(reference.removeprefix(DEFINITIONS_REF))
    return isinstance(model, dict) and model.get("type") == "object" and "$ref" not in json.dumps(model)


def configs_note(names: list[str]) -> str:
    """The sentence a deployment's description gets: the configs a run may pick (``config`` has no default).

    The same names are the ``config`` parameter's enum (:func:`with_config_choices`): a config added to the
    checkout is offered once ``datagen deploy`` runs again.
    """
    listed = ", ".join(names) if names else "none yet"
    return f"Configs of this commit (config): {listed}; `datagen deploy` again offers a config added since."


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
