"""Preflight: everything that can be checked before the training job is stopped.

Stopping training costs GPU hours; a run that then dies on a typo in a dataset path wastes them. So every
check that needs no GPU runs first, all of them (not stopping at the first problem), and the run refuses
to start with one message listing each problem and its fix.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from datagen.config import RunConfig
from datagen.errors import DatagenError, PreflightError
from datagen.output.layout import RunLayout
from datagen.output.runs import check_run_config, open_store, read_stored_config
from datagen.output.store import Store, normalise_url, overlaps
from datagen.prompts.mix import validate_mix

logger = logging.getLogger(__name__)


class Check(BaseModel):
    """One preflight check and its outcome."""

    model_config = ConfigDict(extra="forbid")

    name: str
    ok: bool
    detail: str = ""


class PreflightReport(BaseModel):
    """Every check that ran, in order."""

    model_config = ConfigDict(extra="forbid")

    run_id: str
    checks: list[Check] = Field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        """One line per failed check."""
        return [f"{check.name}: {check.detail}" for check in self.checks if not check.ok]

    def to_markdown(self) -> str:
        """A checklist for a Prefect artifact."""
        lines = [f"# Preflight of run `{self.run_id}`", ""]
        lines += [f"- {'✅' if check.ok else '❌'} **{check.name}** {check.detail}" for check in self.checks]
        return "\n".join(lines) + "\n"


def _check_mix(config: RunConfig) -> str:
    plan = validate_mix(config)
    if plan.capped_categories:
        return f"category caps hold; capped: {', '.join(plan.capped_categories)}"
    return "quotas planned"


def _check_output_location(config: RunConfig) -> str:
    # What matters is where this run writes: its run folder and its dataset's version folder. An output root
    # that merely contains a protected prefix (s3://bucket beside s3://bucket/train) is fine, since the store
    # refuses every write under a protected prefix; an output inside one, or a run that would write into one,
    # is refused here, before anything is stopped.
    assert config.run_id is not None
    store = Store(config.output, protected_prefixes=config.protected_prefixes)
    write_roots = [
        config.output,
        store.url(RunLayout(config.run_id).root),
        store.url(f"datasets/{config.tokenize.dataset_name}"),
    ]
    for prefix in config.protected_prefixes:
        for root in write_roots:
            inside = normalise_url(root) == normalise_url(prefix) or normalise_url(root).startswith(
                normalise_url(prefix).rstrip("/") + "/"
            )
            if inside or (root != config.output and overlaps(root, prefix)):
                raise DatagenError(
                    f"this run would write under {root}, which overlaps the protected prefix {prefix}; "
                    "choose an `output` outside the existing data (e.g. s3://bucket/expansion)"
                )
    if config.output.startswith("s3://"):
        backend = store.backend
        client = getattr(backend, "client", None)
        bucket = getattr(backend, "bucket", None)
        if client is not None and bucket is not None:
            try:
                client.head_bucket(Bucket=bucket)
            except Exception as error:
                raise DatagenError(
                    f"bucket {bucket} is not reachable ({error}); check credentials (AWS_* env, profile, "
                    "DATAGEN_AWS_CREDENTIALS_BLOCK) and DATAGEN_S3_ENDPOINT_URL"
                ) from None
        return f"bucket {bucket} reachable"
    path = Path(normalise_url(config.output))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DatagenError(f"cannot create output directory {path}: {error}") from None
    if not os.access(path, os.W_OK):
        raise DatagenError(
            f"output directory {path} is not writable; fix its permissions or choose another --output"
        )
    return f"writable directory {path}"


def _check_run_identity(config: RunConfig) -> str:
    store = Store(config.output, protected_prefixes=config.protected_prefixes)
    stored = check_run_config(store, config)
    return "new run" if stored is None else f"resuming run created {stored.created_at.isoformat()}"


def _check_datasets(config: RunConfig) -> str:
    # Read the first row of every source: a wrong path, an unreachable bucket or Hub, a file that is not its
    # layout's type all fail here, before training is stopped, instead of hours into the run.
    from datagen.errors import DatasetError
    from datagen.prompts.datasets import iter_rows

    problems = []
    for dataset in config.datasets:
        try:
            next(iter(iter_rows(dataset.path, limit=1)), None)
        except DatasetError as error:
            problems.append(f"{dataset.name}: {error}")
    if problems:
        raise DatagenError("; ".join(problems) + " (fix `datasets[].path`)")
    return f"{len(config.datasets)} dataset source(s) readable"


def _check_model(config: RunConfig) -> str:
    model_path = Path(config.model.path)
    if config.fleet.engine != "external" and not (model_path / "config.json").is_file():
        raise DatagenError(
            f"model directory {model_path} has no config.json; set `model.path` to a local model directory "
            "(download it before the run: GPU hosts may not reach the hub)"
        )
    from datagen.output.tokenize import load_tokenizer

    tokenizer = load_tokenizer(config.model.tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise DatagenError(
            f"tokenizer {config.model.tokenizer} has no chat template; the training data must be rendered with "
            "the target's own template: point `model.tokenizer_path` at the target tokenizer"
        )
    return f"model {config.model.path}; tokenizer with chat template"


def _check_engine(config: RunConfig) -> str:
    from datagen.engines import get_engine
    from datagen.host.plan import router_problems

    problems = get_engine(config.fleet.engine).check_available() + router_problems(config.fleet)
    if problems:
        raise DatagenError("; ".join(problems))
    return f"engine {config.fleet.engine} available"


def _check_training(config: RunConfig) -> str:
    from datagen.host.training import validate_training_job

    problems = validate_training_job(config.training)
    pidfile = config.training.pidfile
    assert config.run_id is not None
    existing = read_stored_config(
        Store(config.output, protected_prefixes=config.protected_prefixes), config.run_id
    )
    if problems and existing is not None and pidfile and not Path(pidfile).exists():
        # An earlier attempt of this run halted the trainer, which may have removed its pidfile: nothing to stop.
        return f"pidfile {pidfile} is gone: the trainer was halted by an earlier attempt of this run"
    if problems:
        raise DatagenError("; ".join(problems))
    return f"training job: {config.training.kind}"


def _check_base_version(config: RunConfig) -> str:
    if not config.tokenize.base_version:
        return "none (a first dataset version)"
    from datagen.output.merge import read_base_version

    url, version = read_base_version(open_store(config), config.tokenize.base_version)
    return f"extends {url} ({version.rows} rows)"


CHECKS: list[tuple[str, Callable[[RunConfig], str]]] = [
    ("mix", _check_mix),
    ("output location", _check_output_location),
    ("run identity", _check_run_identity),
    ("datasets readable", _check_datasets),
    ("model and tokenizer", _check_model),
    ("engine", _check_engine),
    ("base dataset version", _check_base_version),
    ("training job", _check_training),
]


def run_preflight(config: RunConfig) -> PreflightReport:
    """Run every check and raise one error listing all failures.

    Args:
        config: The run config with its run id resolved.

    Returns:
        The report (all checks passed).

    Raises:
        PreflightError: At least one check failed; ``problems`` has one line per failure with its fix.
    """
    assert config.run_id is not None
    report = PreflightReport(run_id=config.run_id)
    for name, check in CHECKS:
        try:
            detail, ok = check(config), True
        except DatagenError as error:
            detail, ok = str(error), False
        except Exception as error:
            detail, ok = f"{type(error).__name__}: {error}", False
        report.checks.append(Check(name=name, ok=ok, detail=detail))
        logger.info("preflight check=%r ok=%s %s", name, ok, detail)
    if report.problems:
        raise PreflightError(report.problems)
    return report
