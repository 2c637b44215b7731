"""Run identity: run ids, the run's ``config.json``, and the refusal of a changed config.

A run is identified by its id; what it produces is defined by its config hash. ``config.json`` is written
once, before any output of the run (only preflight's write-once probe precedes it), with the resolved config,
its hash and, for a run started through a deployment, its origin (the box config and the choices it was made
from). Any later attempt under the same id must carry the same hash, or it is refused before anything is
stopped or started.
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from datagen.config import RunConfig, Slug, is_valid_slug
from datagen.errors import ConfigError, OutputExistsError, RunConfigMismatchError
from datagen.output.layout import RunLayout
from datagen.output.s3_client import S3Credentials
from datagen.output.store import Store
from datagen.records import utc_now

logger = logging.getLogger(__name__)

RUN_ID_RANDOM_HEX = 12
SHA256_PATTERN = r"^[0-9a-f]{64}$"


class RunOrigin(BaseModel):
    """How a run started through a deployment was made: the box config it picked by name, and its choices.

    Recorded in ``config.json`` when the run is created, so that a resume can make the config again from the
    box's own file instead of believing what the store holds.

    Attributes:
        config: The name of the box config (``configs/<name>.yaml`` of the worker's checkout).
        config_sha256: The sha256 of that file's bytes when the run was created.
        choices: The run's choices on top of it (``max_prompts``, ``series``, ``output``, ``sampling``,
            ``datasets``), as the request gave them (``output`` normalised).
    """

    model_config = ConfigDict(extra="forbid")

    config: Slug
    config_sha256: str = Field(pattern=SHA256_PATTERN)
    choices: dict[str, Any]


class StoredRunConfig(BaseModel):
    """The content of ``config.json``.

    Attributes:
        origin: The box config and choices the run was made from; None for a run of the box's operator
            (``datagen run --config``), which only the operator resumes.
    """

    model_config = ConfigDict(extra="forbid")

    run_id: str
    config_hash: str
    created_at: dt.datetime
    config: dict[str, Any]
    origin: RunOrigin | None = None


class RunHandle(BaseModel):
    """What every stage needs to find a run: its id, its store root, and its incarnation.

    Attributes:
        incarnation: The creation time of ``config.json``; part of cache keys so that a run folder that was
            deleted and recreated never reuses Prefect's cached results of the old one.
        resumed: True when ``config.json`` already existed (a rerun or a retry of this run).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str
    output: str
    config_hash: str
    incarnation: str
    resumed: bool

    @property
    def layout(self) -> RunLayout:
        """The run's object keys."""
        return RunLayout(self.run_id)


def make_run_id(seed: str | None = None, now: dt.datetime | None = None) -> str:
    """A new run id: ``YYYYMMDD-HHMMSS-<hex>``, sortable by time and collision-free in practice.

    Args:
        seed: A unique token to derive the suffix from (e.g. a Prefect flow run id, so a retried flow run
            keeps its run id); random when None.
        now: The time to stamp; the current UTC time when None.
    """
    stamp = (now or utc_now()).strftime("%Y%m%d-%H%M%S")
    suffix = (
        seed.replace("-", "")[:RUN_ID_RANDOM_HEX].lower()
        if seed
        else secrets.token_hex(RUN_ID_RANDOM_HEX // 2)
    )
    run_id = f"{stamp}-{suffix}"
    if not is_valid_slug(run_id):
        raise ConfigError(f"generated run id {run_id!r} is not a valid slug; pass --run-id explicitly")
    return run_id


def read_stored_config(store: Store, run_id: str) -> StoredRunConfig | None:
    """The stored ``config.json`` of ``run_id``, or None when the run does not exist yet.

    Raises:
        ConfigError: ``run_id`` is no valid run id: checked before any key is built from it, so an id such
            as ``../x`` never reads outside the run's folder; or the stored file is no ``config.json`` of
            datagen's.
    """
    if not is_valid_slug(run_id):
        raise ConfigError(
            "run_id: use 1-80 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit",
            run_id=run_id,
        )
    key = RunLayout(run_id).config
    if not store.exists(key):
        return None
    try:
        return StoredRunConfig.model_validate(store.read_json(key))
    except (ValidationError, ValueError):
        raise ConfigError(
            f"run_id: {store.url(key)} is not a config.json datagen writes: this run id cannot be resumed; "
            "start a new run id (the box's operator may look at that folder)",
            run_id=run_id,
        ) from None


def check_run_config(store: Store, config: RunConfig) -> StoredRunConfig | None:
    """Refuse a config that differs from the one stored under the same run id.

    Returns:
        The stored config when the run exists (same hash), None when it is new.

    Raises:
        RunConfigMismatchError: The run exists with another config.
    """
    assert config.run_id is not None, "resolve the run id before checking it"
    stored = read_stored_config(store, config.run_id)
    if stored is None:
        return None
    new_hash = config.config_hash()
    if stored.config_hash != new_hash:
        raise RunConfigMismatchError(
            f"Run {config.run_id!r} already exists at {store.url(RunLayout(config.run_id).root)} with a "
            f"different configuration (stored hash {stored.config_hash}, this one {new_hash}). A run's config "
            "never changes: resume it with its original config, or start a new run with another --run-id.",
            run_id=config.run_id,
            stored_hash=stored.config_hash,
            new_hash=new_hash,
        )
    return stored


def open_run(store: Store, config: RunConfig, origin: RunOrigin | None = None) -> RunHandle:
    """Create the run (write ``config.json`` first) or resume it after checking its config.

    Two processes opening the same new run at once cannot both create it: the exclusive create decides,
    and the loser re-reads and checks the winner's config.

    Args:
        store: The run's store.
        config: The run's resolved config.
        origin: What a deployment's run was made from, recorded in a new run's ``config.json`` (None: the
            box's operator's run).

    Raises:
        RunConfigMismatchError: The run exists with another config.
    """
    assert config.run_id is not None, "resolve the run id before opening the run"
    layout = RunLayout(config.run_id)
    stored = check_run_config(store, config)
    resumed = stored is not None
    if stored is None:
        candidate = StoredRunConfig(
            run_id=config.run_id,
            config_hash=config.config_hash(),
            created_at=utc_now(),
            config=config.model_dump(mode="json"),
            origin=origin,
        )
        try:
            store.write_json(layout.config, candidate)
            stored = candidate
            logger.info("created run run_id=%s url=%s", config.run_id, store.url(layout.root))
        except OutputExistsError:
            stored = check_run_config(store, config)
            assert stored is not None
            resumed = True
    if resumed:
        logger.info("resuming run run_id=%s created_at=%s", config.run_id, stored.created_at.isoformat())
    return RunHandle(
        run_id=config.run_id,
        output=config.output,
        config_hash=stored.config_hash,
        incarnation=stored.created_at.isoformat(),
        resumed=resumed,
    )


def open_store(config: RunConfig, credentials: S3Credentials | None = None) -> Store:
    """The write-once store of a run's output, refusing its protected prefixes.

    Args:
        config: The run config (``output``, ``protected_prefixes``).
        credentials: S3 credentials (None: the standard AWS chain); the store keeps them for the run's inputs.
    """
    return Store(config.output, protected_prefixes=config.protected_prefixes, credentials=credentials)
