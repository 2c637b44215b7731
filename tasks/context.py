"""What the flow hands every task of one run: its config, its open store and its identity.

The flow opens the run's store once (:func:`open_run_store`: the Prefect block's S3 credentials, if one is
named, go into it and stay there) and, once the run is open, builds one :class:`RunContext`. Tasks read the
store from it, as they read the live dispatcher they are handed: no task opens a store or passes credentials
on, so none can reach S3 without the run's credentials.
"""

from __future__ import annotations

import datagen.output.runs
from datagen.config import RunConfig
from datagen.output.layout import RunLayout
from datagen.output.runs import RunHandle
from datagen.output.store import Store
from tasks.credentials import load_s3_credentials


def open_run_store(config: RunConfig) -> Store:
    """The run's write-once store, with the S3 credentials of the Prefect block named in the settings.

    Raises:
        ConfigError: ``DATAGEN_AWS_CREDENTIALS_BLOCK`` names a block that does not exist.
    """
    return datagen.output.runs.open_store(config, load_s3_credentials())


class RunContext:
    """One run as every task sees it: its config, its open store, its handle and this flow attempt.

    A plain object, not a dataclass or model: Prefect hands it to tasks without looking inside (it visits
    dataclasses and models field by field on every submit), and no task's cache key reads it whole (the
    keys read ``context.run``; :mod:`tasks.common`).

    Attributes:
        config: The run's resolved config.
        store: The run's store (``store.credentials``: the run's S3 credentials, for inputs too).
        run: The open run: id, incarnation, config hash, whether it resumed.
        attempt_id: This flow attempt's id (its records go under ``attempts/<attempt_id>/``).
    """

    __slots__ = ("attempt_id", "config", "run", "store")

    def __init__(self, config: RunConfig, store: Store, run: RunHandle, attempt_id: str) -> None:
        self.config = config
        self.store = store
        self.run = run
        self.attempt_id = attempt_id

    @property
    def run_id(self) -> str:
        """The run's id."""
        return self.run.run_id

    @property
    def layout(self) -> RunLayout:
        """The run's object keys."""
        return self.run.layout

    def with_config(self, config: RunConfig) -> RunContext:
        """The same run and store with ``config`` (the merge's, whose base version the series fixed)."""
        return RunContext(config, self.store, self.run, self.attempt_id)

    def __repr__(self) -> str:
        return (
            f"RunContext(run_id={self.run_id!r}, output={self.store.root!r}, attempt_id={self.attempt_id!r})"
        )
