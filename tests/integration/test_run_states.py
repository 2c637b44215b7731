"""Every state of a `datagen run` obeys SIGINT and SIGTERM, and survives a SIGKILL (the crash matrix).

A real `datagen run` (its own process group, the CLI's temporary Prefect API server) is driven into each state
by real slowness from outside, never by hooks in the product:

=============  ==================================================================================
preflight      the dataset lives in S3 behind a proxy that holds its first read
preparing      the proxy holds the writes of the prompt shards
waiting        another process holds the host GPU lock file
halting        the stand-in trainer takes long over its checkpoint after the stop signal
probing        an ``nvidia-smi`` early on PATH sleeps before it prints a recorded H200 host
starting       the external server answers 503 on /health
generating     the external server answers slowly
merging        the proxy holds the writes of the tokenized parts
reporting      the proxy holds the write of manifest.json (the report is written)
=============  ==================================================================================

The state is known from outside (the proxy holds a request, the trainer got its signal, the fake
``nvidia-smi`` started, the server was asked for /health or a completion) and checked against the run's last
``stage=<name>`` log line.

* Signal: the run exits within 30 s with 130/143, nothing of it is left running (helper processes), and the
  training job is untouched (before the halt) or restarted once (from the halt on). These runs report to the
  worker's running Prefect API server.
* Crash: a run held in each state in turn is SIGKILLed with its whole process group, each run the printed resume
  command of the one killed before; the runs in preflight and reporting and the last resume
  start the CLI's own temporary Prefect API server (killed with the group, booted again by the resume), the
  others report to the worker's running one; the last resume finishes (exit 0), every request is answered exactly once,
  the training job was signalled once and restarted once (one trainer runs at the end), each resume sent its
  first request within 30 s of its flow run's start, and nothing of a killed run is left running.
  ``pytest -m matrix`` runs the matrix one state at a time instead, each resume left to finish (~8 min here).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.prefect_db import seed_prefect_home
from tests.support.run_states import REPO
from tests.support.s3_proxy import S3FaultProxy
from tests.support.state_box import (
    CRASH_CHECKPOINT_S,
    S3_ENV,
    STATES,
    Box,
    BoxFactory,
    check_training,
    enter_state,
    left_behind,
    sigkill_then_resume,
)

SIGNAL_EXIT_BUDGET_S = 30.0
# A trainer whose checkpoint outlasts the signal to the run that halted it: the run hands it back once it has
# exited (datagen.host.handback waits up to 15 s for that), within the 30 s budget.
SIGNAL_CHECKPOINT_S = 8.0


@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Prefect home for the module's runs, its database migrated already (the session's copy)."""
    return seed_prefect_home(tmp_path_factory.mktemp("prefect-home"))


@pytest.fixture(scope="module")
def s3_proxy(s3_endpoint: str) -> Iterator[S3FaultProxy]:
    """The proxy every run reaches S3 through (no faults: it only holds what a test asks it to)."""
    with pytest.MonkeyPatch.context() as patch, S3FaultProxy(s3_endpoint) as proxy:
        for name, value in S3_ENV.items():
            patch.setenv(name, value)  # the test's own reads of the bucket
        yield proxy


def _box_factory(
    tmp_path: Path, s3_endpoint: str, s3_proxy: S3FaultProxy, tiny_model_dir: Path, **prefect: str
) -> BoxFactory:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        **prefect,
    }
    if "PREFECT_API_URL" not in prefect:
        env.pop("PREFECT_API_URL", None)
    return BoxFactory(tmp_path, s3_endpoint, s3_proxy, tiny_model_dir, env)


@pytest.fixture()
def make_box(
    tmp_path: Path, s3_endpoint: str, s3_proxy: S3FaultProxy, prefect_home: Path, tiny_model_dir: Path
) -> Iterator[Callable[..., Box]]:
    """Boxes whose runs use the CLI's own temporary Prefect API server, as on a fresh host."""
    factory = _box_factory(tmp_path, s3_endpoint, s3_proxy, tiny_model_dir, PREFECT_HOME=str(prefect_home))
    try:
        yield factory.make
    finally:
        factory.close()


@pytest.fixture()
def make_signal_box(
    tmp_path: Path, s3_endpoint: str, s3_proxy: S3FaultProxy, prefect_api: str, tiny_model_dir: Path
) -> Iterator[Callable[..., Box]]:
    """Boxes whose runs talk to the worker's running Prefect API server (``PREFECT_API_URL``).

    A state obeys a signal the same way whichever API server the run reports to; what the CLI's own temporary
    server adds (it is stopped with the run) is checked by the crash chain below, by
    test_failure_behaviour's signal mid-generation and by test_gpu_lock_crash's signal while waiting. Each
    run here saves that server's start-up (~4 s of CPU), nine times over.
    """
    factory = _box_factory(tmp_path, s3_endpoint, s3_proxy, tiny_model_dir, PREFECT_API_URL=prefect_api)
    try:
        yield factory.make
    finally:
        factory.close()


SIGNAL_CASES = [
    ("preflight", signal.SIGTERM),
    ("preparing", signal.SIGINT),
    ("waiting", signal.SIGINT),
    ("halting", signal.SIGTERM),
    ("probing", signal.SIGINT),
    ("starting", signal.SIGTERM),
    ("generating", signal.SIGINT),
    ("merging", signal.SIGTERM),
    ("reporting", signal.SIGINT),
]


@pytest.mark.parametrize(("state", "signum"), SIGNAL_CASES, ids=[state for state, _ in SIGNAL_CASES])
def test_a_signal_in_each_state_stops_the_run_within_30s_leaving_nothing_running(
    make_signal_box: Callable[..., Box], state: str, signum: signal.Signals
) -> None:
    box = make_signal_box(checkpoint_delay_s=SIGNAL_CHECKPOINT_S if state == "halting" else 0.0)
    run, slowness = enter_state(box, state, "sig")

    sent = run.send(signum)
    code = run.wait(SIGNAL_EXIT_BUDGET_S + 30)
    exit_s = time.monotonic() - sent
    slowness.release()

    assert code is not None, f"still running {exit_s:.0f}s after {signum.name}:\n{run.tail()}"
    assert code == 128 + signum, run.tail()
    assert exit_s < SIGNAL_EXIT_BUDGET_S, f"{state}: exit took {exit_s:.1f}s after {signum.name}"
    left = left_behind(box, run)
    assert not left, f"{state}: left running after the run exited:\n{left}"
    last = run.text.strip().splitlines()[-1]
    assert f"interrupted by {signum.name}" in last and "--run-id sig" in last, run.tail()
    assert "Traceback" not in run.text
    check_training(box, halted=STATES[state][1])


# The links of the chain whose run boots the CLI's own temporary API server (killed with the group, booted
# again by the next run): the first state, killed while its server may still be booting, and the last, where
# the server holds most of the run. The other links report to the worker's running server, each saving the
# boot (~6 s of CPU); the final resume always boots its own, as on a fresh host.
OWN_API_LINKS = frozenset({"preflight", "reporting"})


def test_a_sigkill_in_every_state_in_turn_then_the_printed_resume_finishes_exactly_once(
    make_box: Callable[..., Box], prefect_api: str
) -> None:
    # One run killed per state, each the printed resume of the one before: every state is crashed in once, and
    # every resume starts from what the kills before it left (lock, halt record, parts, tokenized parts).
    sigkill_then_resume(
        make_box(checkpoint_delay_s=CRASH_CHECKPOINT_S),
        list(STATES),
        shared_api=prefect_api,
        own_api_in=OWN_API_LINKS,
    )


@pytest.mark.matrix
@pytest.mark.parametrize("state", list(STATES))
def test_a_sigkill_in_each_state_then_the_printed_resume_finishes_exactly_once(
    make_box: Callable[..., Box], state: str
) -> None:
    # The matrix one state at a time (each resume left to finish): opt-in, `pytest -m matrix` (~8 min here).
    sigkill_then_resume(
        make_box(checkpoint_delay_s=CRASH_CHECKPOINT_S if state == "halting" else 0.0), [state]
    )
