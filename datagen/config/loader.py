"""Loading a run config: from YAML or parsed data, relative paths resolved, errors one line per problem."""

from __future__ import annotations

import copy
import os
import posixpath
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from datagen.config.run import RunConfig
from datagen.errors import ConfigError


def format_validation_error(error: ValidationError, source: str) -> str:
    """Turn a pydantic error into one line per problem: the dotted field, what is wrong, how to fix it.

    Args:
        error: The validation error.
        source: Where the config came from (file name), for the first line.

    Returns:
        A message a user can act on without reading a traceback.
    """
    lines = [f"Invalid run configuration in {source}:"]
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(top level)"
        kind = item["type"]
        if kind == "extra_forbidden":
            hint = "unknown key: remove it or check its spelling against docs/configuration.md"
        elif kind == "missing":
            hint = "required: add this key"
        else:
            hint = item["msg"]
            if item.get("input") is not None and kind != "value_error":
                hint += f" (got {item['input']!r})"
        lines.append(f"  - {field}: {hint}")
    return "\n".join(lines)


def parse_run_config(data: Any, source: str = "<config>") -> RunConfig:
    """Validate already-parsed config data.

    Args:
        data: A mapping (from YAML, JSON, or a Prefect parameter).
        source: Where the data came from, quoted in errors.

    Returns:
        The validated config.

    Raises:
        ConfigError: The data is not a valid run configuration; the message lists every problem.
    """
    if not isinstance(data, dict):
        raise ConfigError(
            f"Invalid run configuration in {source}: expected a mapping at the top level, "
            f"got {type(data).__name__}",
            source=source,
        )
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, source), source=source) from None


# --- relative paths -----------------------------------------------------------------------------
# A config is written once and run from anywhere: by the CLI in some shell, by a Prefect worker in its
# checkout, from an s3:// URL. So a relative location in a config file means "next to this file", never
# "next to whoever runs it".

# Fields holding a location that is always a path (never a hub id or a store key).
_TOP_LEVEL_PATHS = ("output",)
_TRAINING_PATHS = ("pidfile", "checkpoint_glob", "checkpoint_marker")
# Model locations may also be hub ids (``Qwen/Qwen3-8B``): only rewritten when that path exists.
_MODEL_PATHS = ("path", "tokenizer_path")


def _is_relative(value: object) -> bool:
    return isinstance(value, str) and bool(value) and "://" not in value and not value.startswith(("/", "~"))


def _join(base: str, value: str) -> str:
    if "://" in base:
        scheme, _, rest = base.partition("://")
        return f"{scheme}://{posixpath.normpath(posixpath.join(rest, value))}"
    return os.path.normpath(os.path.join(base, value))


def config_folder(location: str | Path) -> str:
    """The folder relative paths of the config at ``location`` (a local path or URL) resolve against."""
    text = str(location)
    if "://" in text and not text.startswith("file://"):
        return text.rstrip("/").rpartition("/")[0]
    return str(Path(text.removeprefix("file://")).expanduser().resolve().parent)


def resolve_relative_paths(data: dict[str, Any], base: str) -> dict[str, Any]:
    """Return a copy of raw config data whose relative locations are joined to ``base``.

    Rewritten: ``output``, ``output_roots``, ``protected_prefixes``, ``datasets[].path``,
    ``existing_corpus.dedupe_against[].path``, ``training.pidfile`` / ``checkpoint_glob`` /
    ``checkpoint_marker``, and ``model.path`` / ``model.tokenizer_path`` when they start with ``./`` or
    ``../`` or the joined local path exists (otherwise they are hub ids such as ``Qwen/Qwen3-8B``).
    Left alone: absolute paths, URLs, and ``tokenize.base_version`` (a key in the output store when
    relative).

    Args:
        data: Parsed config data (not validated yet; unknown shapes are left for validation to report).
        base: The config file's folder: a local directory or an ``s3://`` URL.

    Returns:
        The rewritten copy.
    """
    result = copy.deepcopy(data)

    def rewrite(holder: Any, key: str, must_exist: bool = False) -> None:
        if not isinstance(holder, dict) or not _is_relative(holder.get(key)):
            return
        joined = _join(base, holder[key])
        explicit = holder[key].startswith(("./", "../"))
        if must_exist and not explicit and ("://" in joined or not Path(joined).exists()):
            return
        holder[key] = joined

    for key in _TOP_LEVEL_PATHS:
        rewrite(result, key)
    for key in ("protected_prefixes", "output_roots"):
        locations = result.get(key)
        if isinstance(locations, list):
            result[key] = [_join(base, p) if _is_relative(p) else p for p in locations]
    for dataset in result.get("datasets") or []:
        rewrite(dataset, "path")
    corpus = result.get("existing_corpus")
    if isinstance(corpus, dict):
        for source in corpus.get("dedupe_against") or []:
            rewrite(source, "path")
    for key in _TRAINING_PATHS:
        rewrite(result.get("training"), key)
    for key in _MODEL_PATHS:
        rewrite(result.get("model"), key, must_exist=True)
    return result


def load_run_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Load a run configuration from a YAML (or JSON) file.

    Relative locations in the file resolve against the file's folder (:func:`resolve_relative_paths`);
    override values are taken as given.

    Args:
        path: The file.
        overrides: Top-level keys replacing those in the file (e.g. ``run_id``, ``output`` from the CLI).

    Returns:
        The validated config.

    Raises:
        ConfigError: The file is missing, is not YAML, or does not validate.
    """
    data = read_config_data(path)
    if isinstance(data, dict) and overrides:
        data = {**data, **{key: value for key, value in overrides.items() if value is not None}}
    return parse_run_config(data, source=str(path))


def read_config_data(path: str | Path) -> Any:
    """The raw data of a config file, its relative locations resolved against the file's folder.

    Raises:
        ConfigError: The file is missing or is not YAML.
    """
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"Config file {file} does not exist; pass an existing YAML file to --config.")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"Config file {file} is not valid YAML: {error}") from None
    if isinstance(data, dict):
        data = resolve_relative_paths(data, config_folder(file))
    return data
