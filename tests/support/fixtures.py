"""Session-scoped pytest fixtures over the support servers.

Register once for the whole suite with ``pytest_plugins = ["tests.support.fixtures"]`` in the top
conftest (then every module shares one pool), or import the fixtures into a test module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.s3_server import S3Server
from tests.support.transformers_servers import TransformersServerPool

POOL_SIZE = 2


@pytest.fixture(scope="session")
def transformers_pool_session(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TransformersServerPool]:
    """Two real ``transformers serve`` processes on the tiny model, started once per session."""
    with TransformersServerPool(tiny_model_dir, POOL_SIZE, tmp_path_factory.mktemp("server-logs")) as pool:
        yield pool


@pytest.fixture()
def transformers_pool(transformers_pool_session: TransformersServerPool) -> TransformersServerPool:
    """The shared pool with every server running (a server an earlier test killed is restarted)."""
    transformers_pool_session.ensure_running()
    return transformers_pool_session


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3-protocol server (moto's S3 server) on loopback, for the whole session."""
    with S3Server() as server:
        yield server.endpoint
