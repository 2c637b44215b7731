"""The run configuration: one typed model per concept, loaded from YAML, hashed for run identity.

`RunConfig` is the flow parameter (Prefect renders it as a form), the content of ``config.json`` in every
run, and what the CLI loads from ``--config FILE``. Everything is ``extra="forbid"``: a misspelt key is an
error that names the key, never a silently ignored setting. Secrets never live here (see
:mod:`datagen.settings`).

One module per stage, named after it: :mod:`model` (the target model), :mod:`fleet` (servers and engines),
:mod:`prompts` (datasets, the mix, the existing corpus), :mod:`generation`, :mod:`training` (the job to halt),
:mod:`merge` (``tokenize:``), :mod:`multihost` (several boxes), :mod:`choices` (``run_choices:``, what a deployed
run may choose); :mod:`run` holds :class:`RunConfig` and the checks
across sections, :mod:`loader` reading a file or parsed data, :mod:`ui_json` the Prefect UI's JSON mode, and
:mod:`base` what every model shares. Every name is importable from ``datagen.config`` as before.
"""

from __future__ import annotations

from datagen.config.base import (
    CONFIG_SCHEMA_VERSION,
    RUN_ID_EXAMPLE,
    SLUG_PATTERN,
    Share,
    Slug,
    StrictModel,
    check_run_id_option,
    is_valid_slug,
)
from datagen.config.choices import RunChoicesConfig
from datagen.config.fleet import EngineKind, FleetConfig, RouterPolicy, SGLangOptions
from datagen.config.generation import GenerationConfig
from datagen.config.loader import (
    config_folder,
    format_validation_error,
    load_run_config,
    parse_run_config,
    read_config_data,
    resolve_relative_paths,
)
from datagen.config.merge import TokenizeConfig
from datagen.config.model import ModelConfig
from datagen.config.multihost import HOST_DEPLOYMENT, HOST_FIXED_FLEET_KEYS, HostConfig, MultiHostConfig
from datagen.config.prompts import (
    SHARE_SUM_TOLERANCE,
    UNCATEGORISED,
    CorpusKind,
    CorpusSource,
    DatasetConfig,
    DatasetFormat,
    ExistingCorpusConfig,
    MixConfig,
    MultiTurnPolicy,
    SamplingOverrides,
    SamplingSetting,
)
from datagen.config.run import RunConfig
from datagen.config.training import TrainingJobConfig, TrainingJobKind
from datagen.config.ui_json import (
    UI_JSON_KIND_KEY,
    UI_MAPPING,
    UI_MAPPING_SCHEMA,
    UI_OPTIONAL_MAPPING,
    UNWRAP_UI_JSON,
    unwrap_ui_json,
)
from datagen.config.window import WindowConfig
from datagen.records import SamplingParams

__all__ = [
    "CONFIG_SCHEMA_VERSION",
    "HOST_DEPLOYMENT",
    "HOST_FIXED_FLEET_KEYS",
    "RUN_ID_EXAMPLE",
    "SHARE_SUM_TOLERANCE",
    "SLUG_PATTERN",
    "UI_JSON_KIND_KEY",
    "UI_MAPPING",
    "UI_MAPPING_SCHEMA",
    "UI_OPTIONAL_MAPPING",
    "UNCATEGORISED",
    "UNWRAP_UI_JSON",
    "CorpusKind",
    "CorpusSource",
    "DatasetConfig",
    "DatasetFormat",
    "EngineKind",
    "ExistingCorpusConfig",
    "FleetConfig",
    "GenerationConfig",
    "HostConfig",
    "MixConfig",
    "ModelConfig",
    "MultiHostConfig",
    "MultiTurnPolicy",
    "RouterPolicy",
    "RunChoicesConfig",
    "RunConfig",
    "SGLangOptions",
    "SamplingOverrides",
    "SamplingParams",
    "SamplingSetting",
    "Share",
    "Slug",
    "StrictModel",
    "TokenizeConfig",
    "TrainingJobConfig",
    "TrainingJobKind",
    "WindowConfig",
    "check_run_id_option",
    "config_folder",
    "format_validation_error",
    "is_valid_slug",
    "load_run_config",
    "parse_run_config",
    "read_config_data",
    "resolve_relative_paths",
    "unwrap_ui_json",
]
