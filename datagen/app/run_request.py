"""What a run's parameters may choose, and the one config they resolve to: the box decides, the run chooses.

Whoever may start a run (the Prefect UI's Run button, ``prefect deployment run``, CI, a schedule) is not the
box's operator. So a run's parameters (:class:`RunRequest`) only *pick* one of the box's configs by name (a
file ``configs/<name>.yaml`` of the worker's checkout) and set a short typed allow-list of choices: ``run_id``,
``max_prompts``, ``series``, ``sampling``, which of the config's ``datasets`` to run, and ``output`` under a
root the config allows. Everything that executes, names a place on the box or leaves it (training commands and
targets, the fleet's environment and arguments, model locations, server URLs, dataset paths, protected
prefixes, output roots) comes from that file alone. ``datagen run --config FILE`` on the box takes any config:
whoever runs the CLI there is its operator (see docs/security.md).

Every refusal is one line that names the parameter and the fix, never a file's content or a sent value.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Generic, TypeVar, cast
from uuid import UUID

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from datagen.app.run_ceilings import choice_problems
from datagen.config import (
    RunConfig,
    Slug,
    check_run_id_option,
    config_folder,
    is_valid_slug,
    parse_run_config,
    read_config_data,
    resolve_relative_paths,
)
from datagen.engines import exact_tokens_enabled
from datagen.errors import ConfigError
from datagen.output.layout import LAYOUT_FOLDERS
from datagen.output.runs import RunOrigin, StoredRunConfig, make_run_id, open_store, read_stored_config
from datagen.output.store import Store
from datagen.prompts.ledger import find_open_series_run
from datagen.prompts.mix import validate_mix

logger = logging.getLogger(__name__)

# What the engines take: the OpenAI chat API's range of temperatures (SGLang, vLLM and transformers serve it),
# and a top_k their int32 request fields hold (the model's vocabulary bounds it further: run_ceilings).
TEMPERATURE_MAX: Final = 2.0
TOP_K_MAX: Final = 2**31 - 1
# The folder of a checkout that holds the configs a run may pick by name.
CONFIGS_FOLDER: Final = "configs"
CONFIG_SUFFIX: Final = ".yaml"


def _yaml_key(name: str, _info: Any) -> str:
    """Form titles are the parameter's own key (what ``--param`` and the YAML use), not a prettified one."""
    return name


class SamplingChoice(BaseModel):
    """Sampling defaults a run may change; a dataset's own sampling in the config still wins."""

    # Titled by its key, not its class name: the run form shows the title as the section's heading.
    model_config = ConfigDict(extra="forbid", field_title_generator=_yaml_key, title="sampling")

    temperature: float | None = Field(
        default=None, ge=0, le=TEMPERATURE_MAX, description="Sampling temperature."
    )
    top_p: float | None = Field(default=None, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int | None = Field(default=None, gt=0, le=TOP_K_MAX, description="Sample among this many tokens.")
    min_p: float | None = Field(default=None, ge=0, le=1, description="Minimum token probability.")
    max_tokens: int | None = Field(default=None, gt=0, description="Longest answer, in tokens.")
    enable_thinking: bool | None = Field(
        default=None,
        description="Let the model think before answering (never switched: the config's choice).",
    )
    samples_per_prompt: int | None = Field(default=None, gt=0, le=64, description="Answers per prompt.")
    seed: int | None = Field(default=None, description="Sampling seed.")


class RunRequest(BaseModel):
    """Everything a run's parameters may say: a config of the box by name and the choices on top of it."""

    model_config = ConfigDict(extra="forbid", field_title_generator=_yaml_key)

    config: Slug = Field(
        description="Name of a config of the box: the file configs/<name>.yaml in the worker's checkout."
    )
    run_id: Slug | None = Field(default=None, description="Run id; an existing run's id resumes it.")
    max_prompts: int | None = Field(
        default=None, gt=0, description="Cap every dataset's quota at this many prompts (a quick run)."
    )
    series: Slug | None = Field(default=None, description="Expansion series, e.g. nightly.")
    output: str | None = Field(
        default=None,
        description="Output root instead of the config's: its `output` or one of its `output_roots`, or a "
        "new folder directly under one (a name, not runs, series or datasets).",
    )
    sampling: SamplingChoice | None = Field(default=None, description="Sampling defaults to change.")
    datasets: list[Slug] | None = Field(
        default=None, description="Run only these of the config's datasets (by name); all when unset."
    )
    retry_failed: bool | None = Field(
        default=None,
        description="With the run_id of a run that ended Failed: send again its failed requests whose reason "
        "was not the prompt's own (server errors, resets, timeouts, a wrong server or model).",
    )

    @field_validator("sampling", mode="after")
    @classmethod
    def _empty_sampling_changes_nothing(cls, value: SamplingChoice | None) -> SamplingChoice | None:
        """A sampling section with nothing set (the run form's untouched section, ``{}``) is no sampling choice."""
        return value if value is not None and value.model_dump(exclude_none=True) else None

    def changes_config(self) -> bool:
        """True when a choice other than the run id and output is set (a resumed run refuses those)."""
        return any(
            value is not None for value in (self.max_prompts, self.series, self.sampling, self.datasets)
        )


class HostRequest(RunRequest):
    """What a multi-host run's parent sends each host part: the box config's name and the run's choices.

    Each box resolves the config from its own checkout by this name (the code-version guard makes the
    checkouts agree); the parent never sends a config.
    """

    run_id: Slug = Field(description="The run's id (resolved by the parent).")

    @classmethod
    def of(cls, request: RunRequest, resolved: RunConfig) -> HostRequest:
        """The host parts' request of a run started with ``request`` and resolved to ``resolved``."""
        assert resolved.run_id is not None, "the parent resolves the run id first"
        return cls.model_validate(
            {
                # Retrying failures is the parent's (it sends the requests); a host part only serves.
                **request.model_dump(exclude_none=True, exclude={"retry_failed"}),
                "run_id": resolved.run_id,
                "output": resolved.output,
            }
        )


class HostPartRequest(HostRequest):
    """The parameters of one `expand-host` flow run: the run's request and this host part's place in it."""

    host: Slug = Field(description="This box's name in the config's `hosts`.")
    attempt_id: Slug = Field(
        description="The parent attempt this host part belongs to (its handshake folder)."
    )
    parent_flow_run_id: UUID = Field(
        description="The parent `expand` flow run that started this host part: it serves only a running "
        "parent that lists it, and stops when that parent ends."
    )

    def run_request(self) -> HostRequest:
        """The run's part of these parameters (what the config is resolved with)."""
        return HostRequest.model_validate(self.model_dump(include=set(HostRequest.model_fields)))


# The keys of each nested parameter, named when a caller sends another one.
_SUBFIELDS: Final = {"sampling": tuple(SamplingChoice.model_fields)}
Request = TypeVar("Request", bound=RunRequest)


def configs_folder(checkout: Path) -> Path:
    """The folder of ``checkout`` whose ``<name>.yaml`` files a run may pick."""
    return checkout / CONFIGS_FOLDER


def config_names(folder: Path) -> list[str]:
    """The names a run may pick in ``folder`` (its ``*.yaml`` files whose stem is a valid name)."""
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.glob(f"*{CONFIG_SUFFIX}") if p.is_file() and is_valid_slug(p.stem))


def _choices_hint(folder: Path) -> str:
    names = config_names(folder)
    return ", ".join(names) if names else f"none: the box's {CONFIGS_FOLDER}/ folder holds no config"


def _problem(item: Mapping[str, Any], folder: Path, model: type[RunRequest]) -> str:
    """One pydantic error of the run parameters as ``field: what is wrong, how to fix it`` (no sent value)."""
    field = ".".join(str(part) for part in item["loc"]) or "parameters"
    kind = item["type"]
    top = str(item["loc"][0]) if item["loc"] else ""
    if kind == "extra_forbidden" and len(item["loc"]) == 1:
        choices = ", ".join(name for name in model.model_fields if name != "config")
        return (
            f"{field}: not a run parameter; the box's config file alone sets it. A run picks a config by name "
            f"(config) and may set only {choices}"
        )
    if kind == "extra_forbidden":
        return f"{field}: unknown key; {top} takes only {', '.join(_SUBFIELDS.get(top, ()))}"
    if kind == "missing" and top == "config":
        return f"{field}: required: pass the name of one of the box's configs ({_choices_hint(folder)})"
    if kind == "missing":
        return f"{field}: required"
    if top == "config":
        return (
            f"config: must be the name of one of the box's configs ({_choices_hint(folder)}), not a config; "
            "the config file alone sets the model, fleet, training, datasets' paths and every other setting"
        )
    if top == "datasets" and len(item["loc"]) == 2:
        return f"{field}: a name of one of the config's datasets (its path and format are the file's)"
    if kind == "string_pattern_mismatch":
        return (
            f"{field}: use 1-80 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return f"{field}: {item['msg']}"


def _refusal(problems: list[str]) -> ConfigError:
    return ConfigError("Run parameters refused, nothing started: " + "; ".join(problems), problems=problems)


def parse_run_request(parameters: Mapping[str, Any], folder: Path, model: type[Request]) -> Request:
    """Validate a run's parameters (as Prefect hands them to the flow) before anything else happens.

    Args:
        parameters: The flow run's parameters; parameters left unset may be absent or None.
        folder: The box's configs folder, to name the configs a run may pick.
        model: The parameters' model (:class:`HostPartRequest` for a host part).

    Raises:
        ConfigError: One line naming each refused parameter and the fix (a config name the box lacks
            included); never the value sent.
    """
    given = {key: value for key, value in parameters.items() if value is not None}
    try:
        request = model.model_validate(given)
    except ValidationError as error:
        raise _refusal([_problem(item, folder, model) for item in error.errors()]) from None
    if request.config not in config_names(folder):
        raise _refusal(_unknown_config(request.config, folder))
    return request


@dataclass(frozen=True)
class CheckedParameters(Generic[Request]):
    """What a flow body receives as its ``config`` parameter once the run's parameters were checked.

    A deployment's flow checks its parameters before Prefect calls the body (``flows/checked_flow.py``) and
    hands the body the outcome in place of the config's name, so the parameters are parsed once: either the
    parsed ``request`` or the ``refusal``, which the body raises inside its own failure reporting (one
    ``run failed:`` line under the flow's own run name).
    """

    request: Request | None = None
    refusal: ConfigError | None = None

    def checked(self) -> Request:
        """The parsed request.

        Raises:
            ConfigError: The parameters were refused.
        """
        if self.refusal is not None:
            raise self.refusal
        assert self.request is not None, "checked parameters hold a request or a refusal"
        return self.request


def checked_request(
    config: object, parameters: Mapping[str, Any], folder: Path, model: type[Request]
) -> Request:
    """A flow body's parsed run request: from its checked ``config`` parameter, else parsed here.

    Raises:
        ConfigError: The parameters are refused.
    """
    if isinstance(config, CheckedParameters):
        return cast(Request, config.checked())
    return parse_run_request(parameters, folder, model)


def _unknown_config(name: str, folder: Path) -> list[str]:
    return [f"config: no config named {name!r} on this box; pick one of: {_choices_hint(folder)}"]


def read_box_config(name: str, folder: Path) -> dict[str, Any]:
    """The raw data of the box's config ``name`` (``folder/<name>.yaml``), relative paths resolved.

    Raises:
        ConfigError: No such config, unreadable, not YAML (its line and column named, never its text), or
            not a mapping.
    """
    return _read_box_file(name, folder)[0]


def _box_file(name: str) -> str:
    return f"{CONFIGS_FOLDER}/{name}{CONFIG_SUFFIX}"


def _read_box_file(name: str, folder: Path) -> tuple[dict[str, Any], str]:
    """The data of the box's config ``name`` (relative paths resolved) and the sha256 of the bytes it came from.

    One read: the hash a run records is the hash of exactly what it was resolved from.
    """
    if not is_valid_slug(name) or name not in config_names(folder):
        raise _refusal(_unknown_config(name, folder))
    file = folder / f"{name}{CONFIG_SUFFIX}"
    raw = file.read_bytes()
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(
            f"config: {_box_file(name)} on this box is not valid YAML{where}: its operator must fix the file",
            config=name,
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"config: {_box_file(name)} on this box must hold a mapping at the top level", config=name
        )
    return resolve_relative_paths(data, config_folder(file)), hashlib.sha256(raw).hexdigest()


def _normalised_location(location: str) -> str | None:
    """``location`` without ``.``/``..`` steps and trailing slashes, or None when it is no absolute place.

    Local paths are made absolute by resolving symlinks (a link cannot lead out of a root); URLs must not
    climb (``..``) at all, since the store joins keys textually.
    """
    if "://" in location and not location.startswith("file://"):
        scheme, _, rest = location.partition("://")
        parts = rest.split("/")
        if not scheme or not parts[0] or any(part in {".", ".."} for part in parts):
            return None
        return f"{scheme}://{posixpath.normpath(rest)}".rstrip("/")
    path = location.removeprefix("file://")
    if not os.path.isabs(path):
        return None
    return str(Path(path).resolve())


def _is_under(location: str, root: str) -> bool:
    return location == root or location.startswith(root.rstrip("/") + "/")


def _is_root_or_folder_of(location: str, root: str) -> bool:
    """Whether ``location`` is ``root`` or a slug folder directly under it that is none of the layout's own."""
    if location == root:
        return True
    if not _is_under(location, root):
        return False
    name = location[len(root.rstrip("/")) + 1 :]
    return is_valid_slug(name) and name not in LAYOUT_FOLDERS


def check_output_choice(output: str, config: RunConfig) -> str:
    """The ``output`` a run chose, normalised, when it is a root the config allows or a new folder of one.

    Allowed: the config's ``output`` and its ``output_roots``, or one folder directly under one of them whose
    name is a slug and none of the layout's top-level folders (``runs``, ``series``, ``datasets``): so a run's
    output never lies inside another run's folder, a series' ledger or a dataset's versions. Never at, under
    or above a ``protected_prefixes`` entry (the existing training data).

    Raises:
        ConfigError: Not an absolute path or URL, outside every allowed root, inside a root's layout, or
            overlapping a protected prefix.
    """
    chosen = _normalised_location(output)
    if chosen is None:
        raise _refusal(["output: give an absolute path or an s3:// URL without '.' or '..' steps"])
    roots = [
        root for root in (_normalised_location(r) for r in [config.output, *config.output_roots]) if root
    ]
    if not any(_is_under(chosen, root) for root in roots):
        raise _refusal(
            [
                "output: not under an output root this box allows; choose the config's output, or one of "
                f"these roots or a folder directly under one: {', '.join(roots)} (its operator adds roots to output_roots)"
            ]
        )
    for prefix in config.protected_prefixes:
        protected = _normalised_location(prefix)
        if protected is not None and (_is_under(chosen, protected) or _is_under(protected, chosen)):
            raise _refusal(
                [
                    "output: overlaps a protected prefix of the config (the existing training data): choose another"
                ]
            )
    if not any(_is_root_or_folder_of(chosen, root) for root in roots):
        # Deeper would reach into a root's layout: another run's folder, a series' ledger, a dataset's versions.
        raise _refusal(
            [
                "output: choose an output root itself or one folder directly under it (a name of lowercase "
                f"letters, digits, '.', '_' or '-', other than {', '.join(LAYOUT_FOLDERS)}), never a folder "
                "inside a root's runs, series or datasets"
            ]
        )
    return chosen


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


def _apply_datasets(data: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Keep only the named datasets (config order); caps of categories left without a dataset go too."""
    datasets = [d for d in data.get("datasets") or [] if isinstance(d, dict)]
    known = [str(d.get("name")) for d in datasets]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise _refusal(
            [f"datasets: name one or more of the config's datasets: {', '.join(known)}"]
            if not unknown
            else [
                f"datasets: the config has no dataset named {', '.join(unknown)}; its datasets: {', '.join(known)}"
            ]
        )
    kept = [d for d in datasets if d.get("name") in names]
    mix = dict(data.get("mix") or {})
    caps = mix.get("category_caps")
    if isinstance(caps, dict):
        categories = {d.get("category") or "uncategorised" for d in kept}
        mix["category_caps"] = {key: value for key, value in caps.items() if key in categories}
    return {**data, "datasets": kept, **({"mix": mix} if mix else {})}


def _parse_box_config(data: dict[str, Any], name: str) -> RunConfig:
    """Validate a box config (with a run's choices applied): one line, fields named, no values quoted."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        problems = [
            f"{'.'.join(str(part) for part in item['loc']) or '(top level)'}: {item['msg']}"
            for item in error.errors()
        ]
        raise ConfigError(
            f"config {name} with this run's choices is invalid: {'; '.join(problems)}", config=name
        ) from None


# The request's fields that are choices on top of the box config (what a run's origin records).
CHOICE_FIELDS: Final = ("max_prompts", "series", "output", "sampling", "datasets")


def resolve_request(request: RunRequest, folder: Path, *, resume: bool = True) -> RunConfig:
    """The config a run request names: the box's config file, with the request's choices applied.

    Args:
        request: The validated run parameters.
        folder: The box's configs folder (``configs/`` of the worker's checkout).
        resume: When the run id exists under the output root, make its config again from the box config and
            the choices its ``config.json`` recorded, refusing a run not made that way (see
            :func:`bind_request`). False for a multi-host run's host part, which takes its serving config
            from its own box's file.

    Returns:
        The config; its ``run_id`` is None when neither the request nor the file set one.

    Raises:
        ConfigError: One line naming the parameter and the fix (unknown config, output outside the allowed
            roots, inside a root's layout or at a protected prefix, an unknown dataset, choices that would
            change an existing run, a stored run the box config does not make, a choice over a ceiling of the
            config's ``run_choices``).
    """
    return bind_request(request, folder, resume=resume)[0]


def bind_request(request: RunRequest, folder: Path, *, resume: bool = True) -> tuple[RunConfig, RunOrigin]:
    """The config a run request names and the origin its ``config.json`` records (:func:`resolve_request`).

    A run id that exists is resumed only when its ``config.json`` says it was made from the same box config,
    by name, whose file is unchanged (its sha256), and when that file with the recorded choices makes the
    same config again (its hash). The config returned is then the one made from the box's file, never the one
    in the store: what executes, names a place or leaves the box comes from the operator's file alone.
    """
    data, sha256 = _read_box_file(request.config, folder)
    base = _parse_box_config(data, request.config)
    if request.output is not None:
        data = {**data, "output": check_output_choice(request.output, base)}
    run_id = request.run_id or data.get("run_id")
    if resume and run_id:
        stored = read_stored_config(Store(str(data["output"])), str(run_id))
        if stored is not None:
            if request.changes_config():
                raise _refusal(
                    [
                        f"run_id: run {run_id} exists; a run's config never changes, so max_prompts, series, "
                        "sampling and datasets cannot be given when resuming it: pass the run id alone, or a "
                        "new run id"
                    ]
                )
            return _rebind(request, folder, str(run_id), stored, sha256), _stored_origin(stored)
    choices = request.model_dump(mode="json", include=set(CHOICE_FIELDS), exclude_none=True)
    if "output" in choices:
        choices["output"] = data["output"]
    origin = RunOrigin(config=request.config, config_sha256=sha256, choices=choices)
    if request.datasets is not None:
        data = _apply_datasets(data, request.datasets)
    if request.max_prompts is not None:
        data = _apply_max_prompts(data, request.max_prompts)
    if request.sampling is not None:
        data = {
            **data,
            "sampling": {**(data.get("sampling") or {}), **request.sampling.model_dump(exclude_none=True)},
        }
    changes = {"run_id": request.run_id, "series": request.series}
    data = {**data, **{key: value for key, value in changes.items() if value is not None}}
    resolved = _parse_box_config(data, request.config)
    sampling = request.sampling or SamplingChoice()
    problems = choice_problems(
        base,
        resolved,
        max_tokens=sampling.max_tokens,
        top_k=sampling.top_k,
        samples_per_prompt=sampling.samples_per_prompt,
    )
    if problems:
        raise _refusal(problems)
    return resolved, origin


def _stored_origin(stored: StoredRunConfig) -> RunOrigin:
    assert stored.origin is not None, "checked by _rebind"
    return stored.origin


def _rebind(
    request: RunRequest, folder: Path, run_id: str, stored: StoredRunConfig, sha256: str
) -> RunConfig:
    """An existing run's config made again from the box's file and its recorded choices, or a refusal."""
    origin = stored.origin
    if origin is None or stored.run_id != run_id:
        raise _refusal(
            [
                f"run_id: run {run_id} was not started from one of the box's configs by name (its config.json "
                "records none): only the box's operator resumes it, with datagen run --config on the box; "
                "start a new run id"
            ]
        )
    if origin.config != request.config:
        raise _refusal(
            [f"config: run {run_id} was made from config {origin.config}: resume it with that config"]
        )
    again = _recorded_request(origin, run_id)
    if origin.config_sha256 != sha256:
        changed = _changed_fields(again, folder, stored)
        raise _refusal(
            [
                f"config: {_box_file(origin.config)} changed since run {run_id} was created (sha256 "
                f"{origin.config_sha256[:12]} then, {sha256[:12]} now; "
                + (
                    f"fields that now resolve differently: {', '.join(changed)}"
                    if changed
                    else "no field of the run's config resolves differently"
                )
                + "): a run's config never changes; restore the file to resume the run, or start a new run id"
            ]
        )
    config = bind_request(again, folder, resume=False)[0]
    if config.config_hash() != stored.config_hash:
        changed = _changed_fields(again, folder, stored)
        raise _refusal(
            [
                f"run_id: the stored config.json of run {run_id} is not what {_box_file(origin.config)} with "
                f"its recorded choices makes here ({', '.join(changed) or 'its hash'} differ): it was written "
                "elsewhere (another checkout or box, or by hand), so it is not resumed; start a new run id"
            ]
        )
    return config


def _recorded_request(origin: RunOrigin, run_id: str) -> RunRequest:
    """The request a run was made with, from its recorded origin (refused when no request could say it)."""
    try:
        return RunRequest.model_validate({**origin.choices, "config": origin.config, "run_id": run_id})
    except ValidationError:
        raise _refusal(
            [
                f"run_id: the choices recorded in the config.json of run {run_id} are no run's choices: this "
                "box did not write it; start a new run id"
            ]
        ) from None


def _changed_fields(request: RunRequest, folder: Path, stored: StoredRunConfig) -> list[str]:
    """The config fields where ``request`` made from the box's file now differs from the stored config.

    Only field names of the freshly made config are named (a stored file's own keys never reach a message).
    """
    try:
        fresh = bind_request(request, folder, resume=False)[0].model_dump(mode="json")
    except ConfigError:
        return []
    return _differences(fresh, stored.config, "")


def _differences(fresh: Any, stored: Any, path: str) -> list[str]:
    if isinstance(fresh, dict) and isinstance(stored, dict) and path.count(".") < 1:
        found: list[str] = []
        for key, value in fresh.items():
            if key in {"run_id", "output_roots", "hosts", "multi_host"}:
                continue
            found += _differences(value, stored.get(key), f"{path}.{key}" if path else key)
        return found
    return [] if fresh == stored else [path]


@dataclass(frozen=True)
class ResolvedRun:
    """A run's config, resolved once by its entry point, and what the flow body needs beside it.

    Both entry points end here: a deployment's run from its :class:`RunRequest` (:func:`resolve_run`), the
    box's operator from a whole config (:func:`operator_run`). The flow body never resolves anything again.

    Attributes:
        config: The run's config; its ``run_id`` is set.
        hosts: What a multi-host run's host parts are sent (each box resolves the same config by its name);
            None when the config is no box config by name, so hosts could not resolve it.
        retry_failed: Send the run's retryable failures again.
        origin: The box config and choices a deployment's run was made from (recorded in a new run's
            ``config.json``); None for the box operator's run.
        continues_series: The series whose open run this run continues (:func:`continue_open_series_run`):
            the run was asked for as the series' next run and resumes its unfinished one instead.
    """

    config: RunConfig
    hosts: HostRequest | None = None
    retry_failed: bool = False
    origin: RunOrigin | None = None
    continues_series: str | None = None

    def __post_init__(self) -> None:
        if self.config.run_id is None:
            raise ValueError("a resolved run has its run id: fix it with with_run_id first")

    @property
    def run_id(self) -> str:
        """The run's id."""
        assert self.config.run_id is not None
        return self.config.run_id


def with_run_id(config: RunConfig, generated: str | None = None) -> RunConfig:
    """``config`` with its run id fixed: its own, else ``generated``, else a new one (:func:`make_run_id`)."""
    if config.run_id is not None:
        return config
    return config.model_copy(update={"run_id": generated or make_run_id()})


def resolve_run(request: RunRequest, folder: Path, generated_run_id: str) -> ResolvedRun:
    """A deployment's run: the box config ``request`` names, its choices applied, its run id fixed.

    Args:
        request: The validated run parameters.
        folder: The box's configs folder.
        generated_run_id: The run id when neither the request nor the config gives one (the flow run's own).

    Raises:
        ConfigError: As :func:`resolve_request`.
    """
    config, origin = bind_request(request, folder)
    config = with_run_id(config, generated_run_id)
    return ResolvedRun(
        config=config,
        hosts=HostRequest.of(request, config),
        retry_failed=bool(request.retry_failed),
        origin=origin,
    )


def continue_open_series_run(
    run: ResolvedRun, request: RunRequest, folder: Path, store: Store
) -> ResolvedRun:
    """A deployment's new run of a series, made the continuation of the series' open run when there is one.

    The series' next run (the nightly) finishes the series' unfinished run before any run takes new prompts:
    a run that took prompts and did not publish them (a window ended, it was interrupted or failed) is resumed
    by its run id, as ``run_id=<id>`` would, so its stored answers are not sent again and its ledger, its place
    in the series and its version stay as they were fixed when it opened. A request that names a run id, or
    whose config sets none of a series, is returned as it is.

    Args:
        run: The run as :func:`resolve_run` resolved it (its run id a new one).
        request: The run's parameters.
        folder: The box's configs folder.
        store: The run's store, opened with the run's credentials (the series' ledger is read through it).

    Returns:
        ``run``, or the resolved resume of the series' open run (``continues_series`` set).

    Raises:
        ConfigError: The request chooses prompts or sampling (``max_prompts``, ``sampling``, ``datasets``)
            while the series has an open run: those would be a new run's, and the open run comes first; or
            the open run cannot be resumed from this box config (as :func:`resolve_run` with its run id).
    """
    series = run.config.series
    if request.run_id is not None or series is None or read_box_config(request.config, folder).get("run_id"):
        return run
    if read_stored_config(store, run.run_id) is not None:
        return run  # this flow run's own run id exists already: a retried flow run resumes its run
    open_run_id = find_open_series_run(store, series)
    if open_run_id is None:
        return run
    if any(value is not None for value in (request.max_prompts, request.sampling, request.datasets)):
        raise _refusal(
            [
                f"series: run {open_run_id} of series {series} took prompts it has not published yet, and the "
                "series' next run continues it first: start this run without max_prompts, sampling and "
                f"datasets to continue it, or resume it with run_id={open_run_id}"
            ]
        )
    logger.info("continuing the open run of the series series=%s run_id=%s", series, open_run_id)
    again = RunRequest(
        config=request.config, run_id=open_run_id, output=request.output, retry_failed=request.retry_failed
    )
    resolved = resolve_run(again, folder, open_run_id)
    return ResolvedRun(
        config=resolved.config,
        hosts=resolved.hosts,
        retry_failed=resolved.retry_failed,
        origin=resolved.origin,
        continues_series=series,
    )


def continue_series_config(config: RunConfig, store: Store) -> RunConfig:
    """The box operator's config with no run id of its own, given the run id of its series' open run if any.

    The command line's counterpart of :func:`continue_open_series_run`: ``datagen run --config FILE`` of a
    series, without ``--run-id``, continues the series' unfinished run (its config must be the same: the run
    refuses a changed one when it opens, naming the fields).

    Args:
        config: The resolved config, its ``run_id`` None (neither ``--run-id`` nor the file set one).
        store: The store of the config's output root.
    """
    if config.run_id is not None or config.series is None:
        return config
    open_run_id = find_open_series_run(store, config.series)
    if open_run_id is None:
        return config
    logger.info("continuing the open run of the series series=%s run_id=%s", config.series, open_run_id)
    return config.model_copy(update={"run_id": open_run_id})


def resolve_config_file(
    path: Path,
    *,
    run_id: str | None = None,
    output: str | None = None,
    max_prompts: int | None = None,
    datasets: list[str] | None = None,
    continue_series: bool = False,
) -> RunConfig:
    """The box operator's run config (``datagen run --config``): the file, the options on top, its run id fixed.

    Fixed here, before any flow starts, so an interrupted or failed run can say how to resume it. The dataset
    choice and the prompt cap change the file's data the way a deployment's parameters do
    (:func:`resolve_request`).

    Args:
        path: The config file.
        run_id: ``--run-id``; a new run id when None and the file sets none.
        output: ``--output``, replacing the file's output root.
        max_prompts: ``--max-prompts``, capping every dataset's quota (a smoke run).
        datasets: ``--datasets``, the config's datasets to run (by name); all when None.
        continue_series: Continue the series' open run when neither ``--run-id`` nor the file gives a run id
            (:func:`continue_series_config`, reading the output root with the environment's credentials);
            False: a new run id (``datagen plan``).

    Raises:
        ConfigError: A bad ``--run-id``, a dataset the file does not name, an invalid file (one line per field),
            a mix whose caps cannot hold, or exact tokens on an engine without ``/generate``.
    """
    check_run_id_option(run_id)
    data = read_config_data(path)
    if isinstance(data, dict):
        if datasets is not None:
            data = _apply_datasets(data, datasets)
        if max_prompts is not None:
            data = _apply_max_prompts(data, max_prompts)
        data = {
            **data,
            **{
                key: value for key, value in {"run_id": run_id, "output": output}.items() if value is not None
            },
        }
    config = parse_run_config(data, source=str(path))
    validate_mix(config)
    exact_tokens_enabled(config)
    if continue_series and config.run_id is None and config.series is not None:
        config = continue_series_config(config, open_store(config))
    return with_run_id(config)


def operator_run(config: RunConfig, config_name: str | None, retry_failed: bool = False) -> ResolvedRun:
    """The box operator's run of a whole config whose run id is fixed (:func:`resolve_config_file`).

    Args:
        config: The run's config.
        config_name: Its name when it is one of the checkout's configs: a multi-host run's hosts resolve it
            by that name (None: it is not, and a multi-host run is refused).
        retry_failed: Send the run's retryable failures again.
    """
    hosts = None
    if config_name is not None and config.run_id is not None:
        hosts = HostRequest(config=config_name, run_id=config.run_id, output=config.output)
    return ResolvedRun(config=config, hosts=hosts, retry_failed=retry_failed)


def box_config_name(path: Path, checkout: Path) -> str | None:
    """The name a run would pick ``path`` by, when it is one of ``checkout``'s configs; else None."""
    folder = configs_folder(checkout).resolve()
    file = path.resolve()
    if file.parent == folder and file.suffix == CONFIG_SUFFIX and file.stem in config_names(folder):
        return file.stem
    return None


__all__ = [
    "CONFIGS_FOLDER",
    "HostPartRequest",
    "HostRequest",
    "ResolvedRun",
    "RunRequest",
    "SamplingChoice",
    "bind_request",
    "box_config_name",
    "check_output_choice",
    "config_names",
    "configs_folder",
    "continue_open_series_run",
    "continue_series_config",
    "operator_run",
    "parse_run_request",
    "read_box_config",
    "resolve_config_file",
    "resolve_request",
    "resolve_run",
    "with_run_id",
]
