"""Shared fixtures (a tiny model built once per session, a fresh output store per test) and the parallel plan.

`make test` runs the suite on pytest-xdist workers (``-n``): every module is one unit of work (its module
fixtures, such as a Prefect stack, start once) except the modules in :data:`SPREAD`, whose
tests are independent whole runs and go to whichever worker is free. Units are handed out heaviest first
(:data:`HEAVIEST_FIRST`), so the long ones start at once and the short ones fill the end.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.prefect_db import TEMPLATE_ENV, seed_prefect_home, session_folder, start_building
from tests.support.workers import WORKER_ID

pytest_plugins = ["tests.support.fixtures"]

# The session's migrated Prefect database (tests/support/prefect_db.py): the first pytest process names its
# folder and removes it at exit; xdist workers inherit the name.
if TEMPLATE_ENV not in os.environ:
    atexit.register(shutil.rmtree, session_folder(), ignore_errors=True)

# Each worker (and a plain `pytest` run) gets its own host state, its own "box" lock folder (GPU lock file,
# halt records) and Prefect home: runs on two workers never wait on one lock or share one SQLite database,
# and no test touches the user's ~/.datagen, the box's /run/lock/datagen or ~/.prefect. Tests that need a
# state or a box of their own still set DATAGEN_STATE_DIR or DATAGEN_LOCK_DIR.
_WORKER_ROOT = Path(tempfile.mkdtemp(prefix=f"datagen-tests-{WORKER_ID}-"))
atexit.register(shutil.rmtree, _WORKER_ROOT, ignore_errors=True)
os.environ["DATAGEN_STATE_DIR"] = str(_WORKER_ROOT / "state")
os.environ["DATAGEN_LOCK_DIR"] = str(_WORKER_ROOT / "box-locks")
os.environ["PREFECT_HOME"] = str(_WORKER_ROOT / "prefect-home")

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 model + tokenizer, built once for the whole session."""
    from datagen.app.tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture()
def store_root(tmp_path: Path) -> Path:
    """An empty local output root."""
    root = tmp_path / "store"
    root.mkdir()
    return root


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """Prefect's real test harness (a temporary API server on SQLite); yields its API URL."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    # The harness puts its database in a fresh `mkdtemp()` folder: hand it one holding the session's migrated
    # database under the harness's file name, so its server does not migrate an empty one (~6 s of CPU).
    def seeded_mkdtemp() -> str:
        return str(seed_prefect_home(Path(tempfile.mkdtemp(prefix="prefect-harness-")), "prefect-test.db"))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("prefect.testing.utilities.mkdtemp", seeded_mkdtemp)
        with prefect_test_harness(server_startup_timeout=120):
            yield str(PREFECT_API_URL.value())


@pytest.fixture(autouse=True)
def _seeded_worker_prefect_home(request: pytest.FixtureRequest) -> None:
    """Integration tests start servers on this worker's Prefect home: give it the migrated database first."""
    if "/integration/" in str(request.node.path):
        seed_prefect_home(Path(os.environ["PREFECT_HOME"]))


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, the controller builds the migrated Prefect database while the workers start."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        start_building()


# Modules whose tests each start whole runs of their own and share nothing costly: spread test by test.
SPREAD = {
    "tests/integration/test_run_states.py",
    "tests/integration/test_failure_behaviour.py",
    "tests/integration/test_chaos.py",
    "tests/integration/test_gpu_lock_crash.py",
    "tests/integration/test_launched_trainers.py",
}
# Modules that share a costly per-worker fixture go to one worker together: the session's two
# `transformers serve` processes (tests/support/fixtures.py, ~14 s of CPU to start) then start on one worker only.
TOGETHER = {
    "tests/integration/test_generate.py": "transformers-pool",
    "tests/integration/test_tune.py": "transformers-pool",
}
# The longest tests and modules (`pytest --durations`, 2 cores), longest first; the rest keep their order. Units
# are handed out in this order to whichever worker is free (longest first: the short ones fill the end). The
# outage tests wait out their outages (S3 90 s, the API 60 s) whatever the load, so they start early too.
HEAVIEST_FIRST = [
    "tests/integration/test_run_states.py::test_a_sigkill_in_every_state",
    "tests/integration/test_operations.py",
    "tests/integration/test_s3_outage.py",
    "tests/integration/test_api_outage.py",
    "tests/integration/test_run_states_prefect.py",
    "tests/integration/test_multihost.py",
    "tests/integration/test_run_origin.py",
    "tests/integration/test_failure_behaviour.py::test_a_signal_to_the_process_group_mid_generation",
    "tests/integration/test_chaos.py::test_flow_killed_at_random_moments",
    "tests/integration/test_fleet.py",
    "tests/integration/test_sglang_contract.py",
    "tests/integration/test_trainer_loaders.py",
    # Before test_generate (one unit, TOGETHER): test_generate's kill test is then the pool's last user, and the
    # pool does not start the killed server again (~7 CPU-s) for test_tune's live sweep.
    "tests/integration/test_tune.py",
    "tests/unit/test_loss_mask_qwen.py",
    "tests/integration/test_mix_run.py",
    "tests/integration/test_export.py",
    "tests/integration/test_exact_tokens_run.py",
    "tests/unit/test_tokenize_template.py",
    "tests/integration/test_expand_flow.py",
    "tests/integration/test_gpu_lock_crash.py",
    "tests/integration/test_failure_behaviour.py",
    "tests/integration/test_run_states.py",
    "tests/integration/test_launched_trainers.py",
    "tests/integration/test_honest_end.py",
    # Whole runs, two or three each (a window that ends, a series continued after a kill).
    "tests/integration/test_window_run.py",
    "tests/integration/test_series_continuation.py",
    "tests/integration/test_on_policy_run.py",
    "tests/integration/test_sampling_mix_run.py",
    "tests/integration/test_terminal_view.py",
    "tests/integration/test_full_disk.py",
    "tests/integration/test_s3_faults.py",
    "tests/integration/test_api_server.py",
    "tests/unit/test_cli.py",
    "tests/integration/test_trainer_environment.py",
    "tests/integration/test_cost_history.py",
]


def _rank(nodeid: str) -> int:
    return next(
        (rank for rank, prefix in enumerate(HEAVIEST_FIRST) if nodeid.startswith(prefix)), len(HEAVIEST_FIRST)
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the heaviest units first; the sort is stable, so a module's tests keep their order."""
    items.sort(key=lambda item: _rank(item.nodeid))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Hand out whole modules (one unit each, but :data:`SPREAD`: test by test; :data:`TOGETHER`: as one) in order.

    xdist's own ``loadgroup`` does not group under pytest 9.2 (it renames ``item._nodeid``, which pytest no
    longer reads), so the grouping is this scheduler's ``_split_scope``.
    """
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return nodeid if module in SPREAD else TOGETHER.get(module, module)

    config.option.loadscopereorder = False  # keep HEAVIEST_FIRST, not "most tests first"
    return ModuleScheduling(config, log)
