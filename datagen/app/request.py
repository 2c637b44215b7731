"""What a human or CI passes to start or resume a run, resolved into one :class:`RunConfig`.

The `expand` flow (and so every deployment) takes, from simplest to most complete:

* ``run_id`` alone: resume that run with the config stored in its ``config.json`` (the output root comes
  from ``output`` or from the default config file);
* ``config_path``: a YAML file on the worker's box (relative to the worker's checkout) or an ``s3://`` URL;
  relative paths inside it resolve against its folder;
* small typed overrides on top: ``run_id``, ``output``, ``max_prompts``, ``series``;
* ``config``: the whole :class:`RunConfig` (the advanced form; it wins over ``config_path``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from datagen.config import RunConfig, config_folder, parse_run_config, resolve_relative_paths
from datagen.errors import ConfigError
from datagen.output.runs import read_stored_config
from datagen.output.store import Store


class RunOverrides(BaseModel):
    """Small typed changes to a config, for the Prefect form, ``--param`` and the CLI."""

    model_config = ConfigDict(extra="forbid")

    run_id: str | None = Field(default=None, description="Run id; an existing run's id resumes it.")
    output: str | None = Field(default=None, description="Output root: a directory or s3://bucket/prefix.")
    max_prompts: int | None = Field(
        default=None, gt=0, description="Cap every dataset's quota at this many prompts (a quick run)."
    )
    series: str | None = Field(default=None, description="Expansion series, e.g. nightly.")

    def changes_config(self) -> bool:
        """True when an override other than the run id and output is set (a resumed run refuses those)."""
        return self.max_prompts is not None or self.series is not None


def read_config_data(location: str) -> dict[str, Any]:
    """Read a YAML config from a local path or an ``s3://`` URL, relative paths resolved against its folder.

    Raises:
        ConfigError: Missing, unreadable, not YAML, or not a mapping.
    """
    if "://" in location and not location.startswith("file://"):
        folder, _, name = location.rstrip("/").rpartition("/")
        try:
            text = Store(folder).read_text(name)
        except FileNotFoundError:
            raise ConfigError(
                f"Config {location} does not exist; pass an existing YAML as config_path."
            ) from None
    else:
        file = Path(location.removeprefix("file://")).expanduser()
        if not file.is_file():
            raise ConfigError(
                f"Config file {file.resolve()} does not exist on this host (cwd {Path.cwd()}); pass a path "
                "relative to the checkout the worker runs in, an absolute path, or an s3:// URL.",
                config_path=location,
            )
        text = file.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"Config {location} is not valid YAML: {error}", config_path=location) from None
    if not isinstance(data, dict):
        raise ConfigError(f"Config {location} must hold a mapping at the top level.", config_path=location)
    return resolve_relative_paths(data, config_folder(location))


def _apply_max_prompts(data: dict[str, Any], max_prompts: int) -> dict[str, Any]:
    """Cap each dataset's ``max_prompts`` (and ``mix.total_prompts`` for share-based quotas)."""
    datasets = []
    for dataset in data.get("datasets") or []:
        dataset = dict(dataset)
        if dataset.get("share") is None:
            current = dataset.get("max_prompts")
            dataset["max_prompts"] = min(current, max_prompts) if current else max_prompts
        datasets.append(dataset)
    mix = dict(data.get("mix") or {})
    if mix.get("total_prompts") is not None:
        mix["total_prompts"] = min(mix["total_prompts"], max_prompts)
    return {**data, "datasets": datasets, **({"mix": mix} if mix else {})}


def resolve_run_config(
    *,
    config_path: str | None = None,
    config: RunConfig | dict[str, Any] | None = None,
    overrides: RunOverrides | None = None,
) -> RunConfig:
    """Turn what a caller passed into the config of the run to start or resume.

    Args:
        config_path: YAML on this host or an ``s3://`` URL (ignored when ``config`` is given).
        config: The whole config (the advanced form); used as given, so a changed config under an existing
            run id is refused when the run opens.
        overrides: Small changes; ``run_id`` of an existing run (without a whole ``config``) resumes it with
            its stored ``config.json``, whatever ``config_path`` holds now.

    Returns:
        The config; its ``run_id`` is None when neither the caller nor the file set one.

    Raises:
        ConfigError: Nothing to start from, a file that cannot be read, an invalid result, or overrides that
            would change a run that already exists.
    """
    overrides = overrides or RunOverrides()
    source = "the config parameter"
    if config is not None:
        data = config.model_dump(mode="json") if isinstance(config, RunConfig) else dict(config)
    elif config_path:
        data = read_config_data(config_path)
        source = config_path
    else:
        data = None
    run_id = overrides.run_id or (data or {}).get("run_id")
    output = overrides.output or (data or {}).get("output")
    # A whole `config` is the run's config exactly (a changed one is refused when the run opens); a config
    # file only says where to find one, so an existing run's stored config wins over it (resume by id).
    if run_id and output and config is None:
        stored = read_stored_config(Store(str(output)), str(run_id))
        if stored is not None:
            if overrides.changes_config():
                raise ConfigError(
                    f"Run {run_id!r} exists at {output}; a run's config never changes, so max_prompts and "
                    "series cannot be given when resuming it. Pass the run id alone, or pick a new run id.",
                    run_id=run_id,
                )
            return parse_run_config(stored.config, source=f"stored config.json of run {run_id}")
    if data is None:
        raise ConfigError(
            "Nothing to run: pass config_path (a YAML on the worker's host or an s3:// URL), the whole config, "
            f"or the id of an existing run{' together with output' if run_id else ''}.",
        )
    if overrides.max_prompts is not None:
        data = _apply_max_prompts(data, overrides.max_prompts)
    changes = {"run_id": overrides.run_id, "output": overrides.output, "series": overrides.series}
    data = {**data, **{key: value for key, value in changes.items() if value is not None}}
    return parse_run_config(data, source=source)


__all__ = ["RunOverrides", "read_config_data", "resolve_run_config"]
