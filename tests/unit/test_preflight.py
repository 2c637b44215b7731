"""Preflight lists every problem, each with its fix, before anything is stopped."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from datagen.app.preflight import check_output_reachable, check_prompts, run_preflight
from datagen.config import RunConfig
from datagen.errors import PreflightError
from datagen.records import PreparedDataset
from datagen.samples import sample_path


def _config(tmp_path: Path, model_dir: Path, **changes: object) -> RunConfig:
    data: dict[str, object] = {
        "run_id": "pre-1",
        "model": {"path": str(model_dir)},
        "datasets": [{"name": "metamath", "format": "metamath", "path": sample_path("metamath")}],
        "output": str(tmp_path / "out"),
        "protected_prefixes": [str(tmp_path / "train")],
        **changes,
    }
    return RunConfig.model_validate(data)


def test_a_good_config_passes_every_check(tmp_path: Path, tiny_model_dir: Path) -> None:
    report = run_preflight(_config(tmp_path, tiny_model_dir))
    assert all(check.ok for check in report.checks)
    assert {check.name for check in report.checks} >= {"output location", "datasets readable", "engine"}


def test_all_problems_are_reported_at_once_with_their_fixes(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = _config(
        tmp_path,
        tmp_path / "no-model",
        output=str(tmp_path / "train" / "expansion"),
        datasets=[
            {
                "name": "metamath",
                "format": "metamath",
                "path": str(tmp_path / "missing.json"),
                "category": "math",
                "max_prompts": 3,
            }
        ],
        mix={"category_caps": {"math": 0.5}},
        training={"kind": "pidfile", "pidfile": str(tmp_path / "trainer.pid")},
    )
    with pytest.raises(PreflightError) as raised:
        run_preflight(config)
    problems = raised.value.problems
    joined = "\n".join(problems)
    assert "protected prefix" in joined and "choose an `output`" in joined
    assert "missing.json" in joined and "datasets[].path" in joined
    assert "no config.json" in joined
    assert "mix: mix.category_caps cannot all hold" in joined
    assert len(problems) >= 3
    assert not (tmp_path / "train").exists(), "preflight must not write under a protected prefix"


def test_changed_config_for_an_existing_run_fails_preflight(tmp_path: Path, tiny_model_dir: Path) -> None:
    from datagen.output.runs import open_run, open_store

    config = _config(tmp_path, tiny_model_dir)
    open_run(open_store(config), config)
    changed = config.model_copy(update={"seed": 42})
    with pytest.raises(PreflightError, match="different configuration"):
        run_preflight(changed)


def _prepared(dataset: str, prompts: int, **fields: object) -> PreparedDataset:
    return PreparedDataset.model_validate({"dataset": dataset, "rows_read": 3, "prompts": prompts, **fields})


def test_a_dataset_without_prompts_is_refused_naming_it_its_rejections_and_a_row(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = _config(tmp_path, tiny_model_dir)
    prepared = _prepared(
        "metamath",
        0,
        rejections={"malformed": 2, "no_user_turn": 1},
        rejection_samples=[{"reason": "malformed", "detail": "missing field 'query'", "source_index": 0}],
    )
    with pytest.raises(PreflightError) as raised:
        check_prompts(config, [prepared])
    (problem,) = raised.value.problems
    assert "dataset 'metamath'" in problem and "yields 0 prompt(s)" in problem and "min_prompts 1" in problem
    assert "malformed=2, no_user_turn=1" in problem and "row 0 (malformed: missing field 'query')" in problem
    assert "datagen datasets inspect --format metamath" in problem
    assert "\n" not in str(raised.value), "one problem is one line"


def test_min_prompts_is_a_per_dataset_minimum_that_does_not_change_the_run_identity(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    strict = _config(
        tmp_path,
        tiny_model_dir,
        datasets=[
            {"name": "metamath", "format": "metamath", "path": sample_path("metamath"), "min_prompts": 5}
        ],
    )
    assert strict.config_hash() == _config(tmp_path, tiny_model_dir).config_hash()
    with pytest.raises(PreflightError, match="yields 4 prompt"):
        check_prompts(strict, [_prepared("metamath", 4)])
    assert check_prompts(strict, [_prepared("metamath", 5)]).ok


def test_a_dataset_that_could_not_be_prepared_is_refused_with_its_cause(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    with pytest.raises(PreflightError, match="dataset 'metamath' could not be prepared: No dataset files"):
        check_prompts(_config(tmp_path, tiny_model_dir), [], {"metamath": "No dataset files found"})


def test_an_unreachable_s3_output_is_one_problem_found_in_seconds(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from datagen.settings import get_settings

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("DATAGEN_S3_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    get_settings.cache_clear()
    try:
        config = _config(
            tmp_path,
            tiny_model_dir,
            output="s3://datagen-out/expansion",
            protected_prefixes=["s3://datagen-out/train"],
            datasets=[{"name": "metamath", "format": "metamath", "path": str(tmp_path / "missing.json")}],
        )
        started = time.monotonic()
        with pytest.raises(PreflightError) as raised:
            run_preflight(config)
        elapsed_s = time.monotonic() - started
        with pytest.raises(PreflightError, match="unreachable"):
            check_output_reachable(config)
    finally:
        get_settings.cache_clear()
    assert elapsed_s < 15
    problems = raised.value.problems
    unreachable = [problem for problem in problems if "S3 endpoint" in problem]
    assert len(unreachable) == 1 and unreachable[0].startswith("output location: S3 endpoint")
    assert not any("run identity" in problem or "base dataset" in problem for problem in problems)
    assert any("missing.json" in problem for problem in problems), "checks that need no storage still run"


def test_a_model_folder_without_tokenizer_files_says_so(tmp_path: Path, tiny_model_dir: Path) -> None:
    bare = tmp_path / "bare-model"
    bare.mkdir()
    shutil.copy(tiny_model_dir / "config.json", bare / "config.json")
    with pytest.raises(PreflightError) as raised:
        run_preflight(_config(tmp_path, bare))
    (problem,) = raised.value.problems
    assert "has no tokenizer files" in problem and "model.path" in problem
    assert "chat template" not in problem


def test_a_training_job_that_is_not_running_passes_with_a_warning(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    pidfile = tmp_path / "trainer.pid"
    pidfile.write_text(f"{dead.pid}\n")
    config = _config(tmp_path, tiny_model_dir, training={"kind": "pidfile", "pidfile": str(pidfile)})
    with caplog.at_level(logging.WARNING, logger="datagen.app.preflight"):
        report = run_preflight(config)
    (training,) = [check for check in report.checks if check.name == "training job"]
    assert training.ok and "NOT running" in training.detail
    assert any("training job named by the config is not running" in r.getMessage() for r in caplog.records)


def test_external_servers_that_do_not_answer_are_refused_in_seconds(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = _config(
        tmp_path,
        tiny_model_dir,
        fleet={"engine": "external", "external_urls": [f"http://127.0.0.1:{port}"]},
    )
    started = time.monotonic()
    with pytest.raises(PreflightError) as raised:
        run_preflight(config)
    assert time.monotonic() - started < 15
    (problem,) = raised.value.problems
    assert f"127.0.0.1:{port} (ConnectError)" in problem and "fleet.external_urls" in problem


def test_exact_tokens_against_external_servers_without_generate_are_refused_before_training_stops(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from tests.support.fault_server import FaultServer
    from tests.support.generate_server import GenerateServer

    with FaultServer() as chat_only, GenerateServer(tiny_model_dir) as sglang_like:
        config = _config(
            tmp_path,
            tiny_model_dir,
            fleet={"engine": "external", "external_urls": [chat_only.url, sglang_like.url]},
            generation={"exact_tokens": True},
        )
        with pytest.raises(PreflightError) as raised:
            run_preflight(config)
        report = run_preflight(
            config.model_copy(
                update={"fleet": config.fleet.model_copy(update={"external_urls": [sglang_like.url]})}
            )
        )

    (problem,) = raised.value.problems
    assert f"{chat_only.url} have no /generate endpoint" in problem and sglang_like.url not in problem
    assert "generation.exact_tokens: false" in problem
    (mode,) = [check for check in report.checks if check.name == "generation mode"]
    assert mode.ok and "exact tokens" in mode.detail


@pytest.mark.parametrize(
    ("fleet", "key", "said"),
    [
        ({"host": "0.0.0.0"}, None, "no API key is set: set DATAGEN_SERVER_API_KEY"),
        ({"host": "10.0.0.5"}, "k-1", "transformers cannot require an API key"),
        ({"engine": "sglang", "router": True}, "k-1", "the router does not send the key"),
        ({"engine": "sglang", "extra_args": ["--config", "mine.yaml"]}, "k-1", "passes --config"),
    ],
)
def test_servers_other_machines_can_reach_must_require_the_api_key(
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    fleet: dict[str, object],
    key: str | None,
    said: str,
) -> None:
    from datagen.settings import get_settings

    if key is not None:
        monkeypatch.setenv("DATAGEN_SERVER_API_KEY", key)
    get_settings.cache_clear()
    try:
        with pytest.raises(PreflightError) as raised:
            run_preflight(_config(tmp_path, tiny_model_dir, fleet=fleet))
    finally:
        get_settings.cache_clear()
    access = [problem for problem in raised.value.problems if problem.startswith("server access:")]
    assert len(access) == 1 and said in access[0], raised.value.problems


def test_a_key_with_loopback_servers_passes_and_says_what_guards_them(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from datagen.settings import get_settings

    monkeypatch.setenv("DATAGEN_SERVER_API_KEY", "k-1")
    get_settings.cache_clear()
    try:
        report = run_preflight(_config(tmp_path, tiny_model_dir))
    finally:
        get_settings.cache_clear()
    (access,) = [check for check in report.checks if check.name == "server access"]
    assert (
        access.ok and "loopback address only" in access.detail and "does not check API keys" in access.detail
    )


def test_a_corrupt_tokenizer_json_is_refused_before_anything_stops(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"')
    with pytest.raises(PreflightError) as raised:
        run_preflight(_config(tmp_path, broken))
    (problem,) = raised.value.problems
    assert problem.startswith("model and tokenizer:") and "tokenizer" in problem, problem
    written = [path for path in (tmp_path / "out").rglob("*") if path.is_file()]
    assert not written, f"a refused run wrote into the output: {written}"


def test_a_box_gpu_lock_this_user_cannot_open_is_refused_with_the_fix(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from datagen.settings import get_settings

    not_a_folder = tmp_path / "lock-file-in-the-way"
    not_a_folder.write_text("")
    monkeypatch.setenv("DATAGEN_LOCK_DIR", str(not_a_folder / "datagen"))
    get_settings.cache_clear()
    try:
        with pytest.raises(PreflightError) as raised:
            run_preflight(_config(tmp_path, tiny_model_dir))
    finally:
        get_settings.cache_clear()
    (problem,) = [line for line in raised.value.problems if "GPU lock" in line]
    assert str(not_a_folder / "datagen") in problem and "DATAGEN_LOCK_DIR" in problem


@pytest.fixture()
def s3_output(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A bucket of the session's moto server, with the environment that points the store at it."""
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    bucket = f"preflight-{time.monotonic_ns()}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return bucket


def _point_store_at(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from datagen.settings import get_settings

    monkeypatch.setenv("DATAGEN_S3_ENDPOINT_URL", endpoint)
    get_settings.cache_clear()


def test_preflight_proves_the_store_refuses_an_overwrite_before_anything_is_halted(
    tmp_path: Path, tiny_model_dir: Path, s3_endpoint: str, s3_output: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3

    from datagen.output.layout import RunLayout
    from datagen.settings import get_settings
    from tests.support.s3_proxy import S3FaultProxy

    output = f"s3://{s3_output}/expansion"
    config = _config(tmp_path, tiny_model_dir, output=output)
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    probes = f"expansion/{RunLayout('pre-1').root}/probes/"
    try:
        # moto's real behaviour: the second conditional put is answered 412, and the run may go on.
        _point_store_at(s3_endpoint, monkeypatch)
        report = run_preflight(config)
        (check,) = [check for check in report.checks if check.name == "write-once"]
        assert check.ok and "was refused" in check.detail
        listed = client.list_objects_v2(Bucket=s3_output, Prefix=probes).get("Contents", [])
        assert len(listed) == 1, "the probe object stays, for the manifest to list"

        # A store that ignores If-None-Match (the proxy drops it): the second put overwrites, the run is refused.
        with S3FaultProxy(s3_endpoint, drop_headers=frozenset({"if-none-match"})) as ignoring:
            _point_store_at(ignoring.url, monkeypatch)
            with pytest.raises(PreflightError) as raised:
                run_preflight(config)
    finally:
        get_settings.cache_clear()
    (problem,) = raised.value.problems
    assert problem.startswith("write-once: the store overwrote s3://")
    assert "use a store that honours them" in problem and "\n" not in problem


def test_a_local_output_proves_exclusive_create_the_same_way(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = _config(tmp_path, tiny_model_dir)
    report = run_preflight(config)
    (check,) = [check for check in report.checks if check.name == "write-once"]
    assert check.ok, check.detail
    (probe,) = (tmp_path / "out" / "runs" / "pre-1" / "probes").iterdir()
    assert probe.read_text().count('"write": 1') == 1
