"""``datagen tune`` against real CPU ``transformers serve`` servers (no /metrics: measured client-side)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from datagen.app.history import history_dir
from datagen.app.terminal import EXIT_REFUSED, EXIT_RUN_FAILED
from datagen.app.tune import choose_best, parse_prometheus, tune_setting_by_restart, with_setting
from datagen.config import RunConfig
from datagen.engines.tune_result import TunePoint, TuneResult, load_tune_result
from datagen.errors import TuneFailedError
from datagen.host.plan import plan_servers
from datagen.host.probe import build_report
from tests.support.fault_server import FaultPlan, FaultServer
from tests.support.transformers_servers import TransformersServer, TransformersServerPool, free_port
from tests.support.workers import worker_port

REPO = Path(__file__).resolve().parents[2]
LEVELS = (1, 2, 4)
MAX_TOKENS = 8


def test_tune_sweeps_live_cpu_servers_and_the_plan_takes_its_result(
    transformers_pool: TransformersServerPool, tmp_path: Path
) -> None:
    output = tmp_path / "tune.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli_entry",
            "tune",
            *[arg for url in transformers_pool.urls for arg in ("--url", url)],
            "--model",
            transformers_pool.model,
            "--engine",
            "transformers",
            "--levels",
            ",".join(str(level) for level in LEVELS),
            "--max-tokens",
            str(MAX_TOKENS),
            "--output",
            str(output),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )

    tuned = load_tune_result(output)
    assert [point.inflight_per_server for point in tuned.curve] == list(LEVELS)
    assert all(point.failed == 0 and point.output_tokens > 0 for point in tuned.curve)
    assert tuned.measured_with == "client"  # transformers serve has no /metrics
    assert tuned.best_inflight_per_server in LEVELS
    assert "<- best" in result.stdout and "best:" in result.stdout
    config = RunConfig.model_validate(
        {
            "model": {"path": "/models/target"},
            "datasets": [{"name": "chat", "format": "sharegpt", "path": "/data/chat.jsonl"}],
            "output": str(tmp_path / "out"),
            "fleet": {"device": "cpu", "base_port": worker_port(34500), "tune_result": str(output)},
        }
    )
    env = build_report(query_gpu=None, topo=None, smi=None, apps=None, nvcc=None, packages={}, hostname="cpu")
    plan = plan_servers(env, config, tmp_path)
    assert plan.dispatcher_inflight == tuned.best_inflight_per_server
    assert any("datagen tune" in reason for reason in plan.reasons)


def _tune_cli(urls: list[str], model: str, output: Path, state_dir: Path) -> subprocess.CompletedProcess[str]:
    """``datagen tune`` as a user runs it, on the tiny levels, with its own history folder."""
    argv = [
        sys.executable, "-m", "flows.cli_entry", "tune", *[arg for url in urls for arg in ("--url", url)],
        "--model", model, "--engine", "transformers", "--levels", "1,2", "--max-tokens", str(MAX_TOKENS),
        "--output", str(output),
    ]  # fmt: skip
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, DATAGEN_STATE_DIR=str(state_dir)),
    )


def test_a_sweep_whose_every_request_is_refused_exits_1_naming_the_answer_and_writes_nothing(
    tmp_path: Path,
) -> None:
    # As on the H200: a server pinned to its model answers HTTP 400 to a request naming another one, and its
    # model list is unusable (here 404; transformers serve 5.17 answers 500 offline), so only the sweep tells.
    with FaultServer(FaultPlan(pinned_to="/models/Qwen3-1.7B")) as server:
        result = _tune_cli([server.url], "", tmp_path / "tune.json", tmp_path / "state")
        requests = len(server.chat_requests())

    assert result.returncode == EXIT_RUN_FAILED, result.stderr
    assert requests == 3 * (1 + 2)  # every level was tried before giving up
    message = result.stderr
    assert "3 of 3 failed at 1 in flight, 6 of 6 failed at 2 in flight" in message
    assert f"first failure: HTTP 400 from {server.url}" in message
    assert "pinned to '/models/Qwen3-1.7B'" in message
    assert "check --model" in message and "best:" not in result.stdout
    assert not (tmp_path / "tune.json").exists()
    assert not history_dir(tmp_path / "state").exists()  # nothing for `datagen plan` to read


def test_a_server_listing_another_model_is_refused_before_any_request_naming_what_it_serves(
    transformers_pool: TransformersServerPool, tmp_path: Path
) -> None:
    # The first server lists the name asked for and the second does not: nothing is sent to either.
    with FaultServer() as first:
        first.models = ["other"]
        result = _tune_cli([first.url, transformers_pool.urls[0]], "other", tmp_path / "tune.json", tmp_path)
        assert first.chat_requests() == []

    assert result.returncode == EXIT_REFUSED, result.stderr
    assert (
        f"{transformers_pool.urls[0]} serves {transformers_pool.model!r}, not 'other': "
        "give --model the name it serves"
    ) in result.stderr
    assert not (tmp_path / "tune.json").exists()


def test_best_level_is_the_smallest_within_reach_of_the_top_throughput() -> None:
    def point(level: int, tokens_per_s: float, failed: int = 0) -> TunePoint:
        return TunePoint(
            inflight_per_server=level,
            requests=10,
            failed=failed,
            output_tokens=100,
            wall_s=1.0,
            output_tokens_per_s=tokens_per_s,
        )

    curve = [point(1, 100), point(4, 370), point(8, 398), point(16, 400), point(32, 500, failed=3)]

    assert choose_best(curve).inflight_per_server == 8


def test_a_curve_without_a_token_raises_and_one_that_only_lost_too_many_still_chooses() -> None:
    def point(level: int, failed: int, output_tokens: int) -> TunePoint:
        return TunePoint(
            inflight_per_server=level,
            requests=3 * level,
            failed=failed,
            output_tokens=output_tokens,
            wall_s=1.0,
            output_tokens_per_s=float(output_tokens),
        )

    with pytest.raises(TuneFailedError, match=r"48 of 48 failed at 16 in flight.*first failure: HTTP 400"):
        choose_best([point(16, 48, 0), point(64, 192, 0)], "HTTP 400 from http://x: bad model")
    with pytest.raises(TuneFailedError, match=r"every answer carried no output tokens"):
        choose_best([point(16, 0, 0)])
    # Every level lost more than 1% (random weights: HTTP 500 at any load), but they produced: still a result.
    assert choose_best([point(16, 5, 300), point(64, 20, 900), point(128, 40, 0)]).inflight_per_server == 64


def test_a_rare_failure_does_not_hide_a_faster_level_and_a_rising_curve_says_so() -> None:
    # As measured on an H200 with transformers serve: 2 of 768 requests at 256 got its HTTP 500 on random text.
    def point(level: int, tokens_per_s: float, failed: int = 0) -> TunePoint:
        return TunePoint(
            inflight_per_server=level,
            requests=3 * level,
            failed=failed,
            output_tokens=100,
            wall_s=1.0,
            output_tokens_per_s=tokens_per_s,
        )

    curve = [point(64, 719.4), point(128, 1062.4), point(256, 1435.3, failed=2)]
    best = choose_best(curve)
    assert best.inflight_per_server == 256
    result = TuneResult(
        engine="transformers",
        urls=["http://x"],
        max_tokens=64,
        best_inflight_per_server=256,
        best_output_tokens_per_s=1435.3,
        curve=curve,
        measured_with="client",
    )
    assert result.still_rising
    # Over 1% failed: not a candidate, and the table says why.
    curve[-1] = point(256, 1435.3, failed=9)
    assert choose_best(curve).inflight_per_server == 128
    table = result.model_copy(update={"curve": curve, "best_inflight_per_server": 128}).to_table()
    assert "(not a candidate: 9 of 768 failed)" in table


def test_sglang_metrics_are_read_from_prometheus_text_and_summed_over_ranks() -> None:
    text = (
        "# HELP sglang:num_running_reqs running\n"
        'sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="0"} 60.0\n'
        'sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="1"} 12.0\n'
        'sglang:num_queue_reqs{model_name="m"} 3.0\n'
        'sglang:token_usage{model_name="m"} 0.81\n'
        'sglang:gen_throughput{model_name="m"} 2450.5\n'
        'sglang:generation_tokens_total{model_name="m"} 9.0e6\n'
    )

    values = parse_prometheus(
        text,
        {
            "running": "sglang:num_running_reqs",
            "queued": "sglang:num_queue_reqs",
            "token_usage": "sglang:token_usage",
            "gen_throughput": "sglang:gen_throughput",
        },
    )

    assert values == {"running": 72.0, "queued": 3.0, "token_usage": 0.81, "gen_throughput": 2450.5}
    assert json.dumps(values)


def test_restart_sweep_starts_one_server_per_value_and_records_each(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # On CPU the swept flag is the paged cache size; on SGLang hosts it is --max-running-requests.
    server = TransformersServer(tiny_model_dir, free_port(), tmp_path / "server.log")
    argv = server.argv()
    # "--cb-num-blocks 256" sits in the middle: the sweep replaces its value (and appends absent flags).
    assert with_setting(argv, "--cb-num-blocks", 64)[argv.index("--cb-num-blocks") + 1] == "64"
    assert with_setting(["x"], "--flag", 3) == ["x", "--flag", "3"]

    best, points = tune_setting_by_restart(
        argv,
        server.url,
        server.model,
        "transformers",
        "--cb-num-blocks",
        (64, 128),
        inflight=2,
        max_tokens=MAX_TOKENS,
        ready_timeout_s=180,
        log_path=tmp_path / "server.log",
    )

    assert [point.setting for point in points] == [64, 128]
    assert all(point.failed == 0 and point.output_tokens > 0 for point in points)
    assert best in (64, 128)
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)  # stopped after the sweep


# --- a restarted server is measured only when it is ours and serves the model asked for -------------------


def _standin_argv(port: int, model: str) -> list[str]:
    """A launched stand-in (tests/support/standin_server.py) that loads briefly, then serves ``model``."""
    return [
        sys.executable, "-m", "tests.support.standin_server",
        "--port", str(port), "--load-s", "1", "--model", model,
    ]  # fmt: skip


def test_a_restart_whose_port_another_program_took_is_refused_naming_it_and_never_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    foreign = FaultServer(port=free_port())
    foreign.models = ["sim"]  # it even answers /health and lists the model: only its socket tells it apart
    foreign.start()
    try:
        with pytest.raises(RuntimeError, match=rf"another program listens on port {foreign.port} \(pid="):
            tune_setting_by_restart(
                _standin_argv(foreign.port, "sim"), foreign.url, "sim", "transformers", "--load-s", (1,),
                inflight=1, max_tokens=MAX_TOKENS, ready_timeout_s=60, log_path=tmp_path / "server.log",
            )  # fmt: skip
        assert foreign.chat_requests() == []
    finally:
        foreign.stop()


def test_a_restarted_server_that_serves_another_model_is_refused_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    port = free_port()
    with pytest.raises(
        RuntimeError, match=r"tune started serves 'other', not 'sim'.*give --model the name its"
    ):
        tune_setting_by_restart(
            _standin_argv(port, "other"), f"http://127.0.0.1:{port}", "sim", "transformers", "--load-s", (1,),
            inflight=1, max_tokens=MAX_TOKENS, ready_timeout_s=60, log_path=tmp_path / "server.log",
        )  # fmt: skip
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)  # stopped all the same


def test_a_restarted_stand_in_that_is_ours_and_serves_the_model_is_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    port = free_port()
    best, points = tune_setting_by_restart(
        _standin_argv(port, "sim"), f"http://127.0.0.1:{port}", "sim", "transformers", "--load-s", (1, 2),
        inflight=1, max_tokens=MAX_TOKENS, ready_timeout_s=60, log_path=tmp_path / "server.log",
    )  # fmt: skip
    assert [point.setting for point in points] == [1, 2]
    assert all(point.failed == 0 for point in points)
    assert best in (1, 2)
