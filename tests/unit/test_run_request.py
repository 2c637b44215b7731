"""A run's parameters pick a box config by name and set only the allowed choices; the box decides the rest."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml

from datagen.app.run_request import (
    HostPartRequest,
    HostRequest,
    RunRequest,
    bind_request,
    config_names,
    continue_open_series_run,
    parse_run_request,
    resolve_config_file,
    resolve_request,
    resolve_run,
)
from datagen.config import RunConfig, TrainingJobConfig
from datagen.errors import ConfigError
from datagen.output.runs import RunOrigin, StoredRunConfig, open_run, read_stored_config
from datagen.output.store import Store
from datagen.prompts.ledger import ledger_key, open_series_entry


def _write(folder: Path, name: str = "run", **changes: Any) -> Path:
    data: dict[str, Any] = {
        "model": {"path": "/models/m"},
        "datasets": [
            {"name": "a", "format": "metamath", "path": "a.json", "max_prompts": 50, "category": "math"},
            {"name": "b", "format": "metamath", "path": "b.json", "category": "chat"},
        ],
        "output": "out",
        **changes,
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _request(**parameters: Any) -> RunRequest:
    return RunRequest.model_validate({"config": "run", **parameters})


def test_a_config_by_name_with_the_allowed_choices(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    _write(configs, sampling={"temperature": 0.7, "max_tokens": 100})
    config = resolve_request(
        _request(
            run_id="r1",
            max_prompts=10,
            series="nightly",
            sampling={"temperature": 0.2},
            datasets=["b"],
        ),
        configs,
    )
    assert config.run_id == "r1"
    assert config.series == "nightly"
    assert [(d.name, d.max_prompts) for d in config.datasets] == [("b", 10)]
    assert (config.sampling.temperature, config.sampling.max_tokens) == (0.2, 100)
    # The file's own values: relative paths against its folder.
    assert config.output == str(configs / "out")
    assert config.datasets[0].path == str(configs / "b.json")


def test_config_names_are_the_yaml_files_of_the_folder(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    _write(configs, "alpha")
    _write(configs, "beta")
    (configs / "notes.txt").write_text("not a config")
    assert config_names(configs) == ["alpha", "beta"]
    with pytest.raises(
        ConfigError, match=r"config: no config named 'gamma' on this box; pick one of: alpha, beta"
    ):
        resolve_request(RunRequest(config="gamma"), configs)


def test_output_is_allowed_under_the_configs_output_and_its_output_roots_only(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    scratch = tmp_path / "scratch"
    _write(configs, output=str(tmp_path / "store"), output_roots=[str(scratch), "s3://bucket/runs"])
    assert resolve_request(_request(output=str(tmp_path / "store" / "a")), configs).output == str(
        tmp_path / "store" / "a"
    )
    assert resolve_request(_request(output=str(scratch / "b")), configs).output == str(scratch / "b")
    assert resolve_request(_request(output="s3://bucket/runs/x"), configs).output == "s3://bucket/runs/x"
    for outside in (
        str(tmp_path / "elsewhere"),
        str(scratch / ".." / "elsewhere"),
        str(tmp_path / "store-2"),
        "s3://bucket/runs/../other",
        "s3://bucket/runsx",
        "relative/folder",
    ):
        with pytest.raises(ConfigError) as refused:
            resolve_request(_request(output=outside), configs)
        assert str(refused.value).startswith("Run parameters refused, nothing started: output: ")
        assert "\n" not in str(refused.value)


def test_output_under_an_allowed_root_but_at_a_protected_prefix_is_refused(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    corpus = tmp_path / "data" / "corpus"
    _write(configs, output=str(tmp_path / "data"), protected_prefixes=[str(corpus)])
    for chosen in (corpus, corpus / "sub", tmp_path / "data" / "x" / ".." / "corpus"):
        with pytest.raises(ConfigError, match="output: overlaps a protected prefix"):
            resolve_request(_request(output=str(chosen)), configs)


def _create(configs: Path, request: RunRequest) -> RunConfig:
    """Create a run as a deployment's run does: resolved from the box config, its origin recorded."""
    config, origin = bind_request(request, configs)
    open_run(Store(config.output), config, origin)
    return config


def test_a_run_id_alone_resumes_the_config_made_again_from_the_box_file(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    _write(configs, output=str(tmp_path / "store"))
    original = _create(configs, _request(run_id="r1", max_prompts=7))

    resumed = resolve_request(_request(run_id="r1"), configs)
    assert resumed.config_hash() == original.config_hash()
    assert [d.max_prompts for d in resumed.datasets] == [7, 7]
    with pytest.raises(ConfigError, match="config never changes"):
        resolve_request(_request(run_id="r1", max_prompts=3), configs)


def test_a_run_resumed_after_its_box_config_changed_is_refused_naming_the_file_and_what_changed(
    tmp_path: Path,
) -> None:
    configs = tmp_path / "configs"
    _write(configs, output=str(tmp_path / "store"))
    _create(configs, _request(run_id="r1"))
    _write(configs, output=str(tmp_path / "store"), seed=99)

    with pytest.raises(ConfigError) as refused:
        resolve_request(_request(run_id="r1"), configs)
    message = str(refused.value)
    assert message.startswith("Run parameters refused, nothing started: config: configs/run.yaml changed")
    assert "fields that now resolve differently: seed" in message and "\n" not in message
    # A host part takes its serving config from its own box's file, not from the store.
    fresh = resolve_request(HostRequest(config="run", run_id="r1"), configs, resume=False)
    assert fresh.seed == 99


def _plant(store: Path, run_id: str, config: RunConfig, origin: RunOrigin | None) -> None:
    """A config.json written by anyone who can write under the root: a hash that matches what it holds."""
    folder = store / "runs" / run_id
    folder.mkdir(parents=True)
    stored = StoredRunConfig(
        run_id=run_id,
        config_hash=config.config_hash(),
        created_at=dt.datetime.now(dt.UTC),
        config=config.model_dump(mode="json"),
        origin=origin,
    )
    (folder / "config.json").write_text(stored.model_dump_json())


def test_a_stored_config_the_box_config_does_not_make_is_never_believed(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    store = tmp_path / "store"
    _write(configs, output=str(store))
    honest, origin = bind_request(_request(run_id="forged"), configs)
    restart = {"kind": "none", "restart_after_run": True, "restart_command": ["touch", "/tmp/x"]}
    forged = honest.model_copy(update={"training": TrainingJobConfig.model_validate(restart)})

    # No origin: what the operator's CLI writes, or a file planted by hand.
    _plant(store, "no-origin", forged.model_copy(update={"run_id": "no-origin"}), None)
    with pytest.raises(ConfigError, match=r"refused, nothing started: run_id: run no-origin was not started"):
        resolve_request(_request(run_id="no-origin"), configs)
    # An origin copied from an honest run, but a config of its own.
    _plant(store, "forged", forged, origin)
    with pytest.raises(ConfigError) as refused:
        resolve_request(_request(run_id="forged"), configs)
    assert str(refused.value).startswith(
        "Run parameters refused, nothing started: run_id: the stored config.json of run forged is not what "
        "configs/run.yaml with its recorded choices makes here (training.restart_after_run, "
        "training.restart_command differ)"
    )
    # Another config's name, or choices no run may make.
    _plant(
        store,
        "other",
        honest.model_copy(update={"run_id": "other"}),
        origin.model_copy(update={"config": "x"}),
    )
    with pytest.raises(ConfigError, match="config: run other was made from config x"):
        resolve_request(_request(run_id="other"), configs)
    wild = origin.model_copy(update={"choices": {"fleet": {"env": {"LD_PRELOAD": "x"}}}})
    _plant(store, "wild", honest.model_copy(update={"run_id": "wild"}), wild)
    with pytest.raises(ConfigError, match=r"run_id: the choices recorded in the config\.json of run wild"):
        resolve_request(_request(run_id="wild"), configs)
    (store / "runs" / "junk").mkdir()
    (store / "runs" / "junk" / "config.json").write_text('{"run_id": "junk"}')
    with pytest.raises(ConfigError, match=r"run_id: .* is not a config\.json datagen writes"):
        resolve_request(_request(run_id="junk"), configs)


def test_output_is_never_inside_a_roots_layout(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    root = tmp_path / "store"
    _write(configs, output=str(root), output_roots=["s3://bucket/shared"])
    for inside in (
        root / "runs" / "victim" / "completions",
        root / "series" / "nightly" / "ledger",
        root / "datasets" / "drafter-expansion",
        root / "runs",
        root / "a" / "b",
        root / "Upper",
        root / "new\n12:00:00.000 | INFO | forged",
        "s3://bucket/shared/runs/victim",
        "s3://bucket/shared/x/y",
    ):
        with pytest.raises(ConfigError) as refused:
            resolve_request(_request(output=str(inside)), configs)
        assert str(refused.value).startswith(
            "Run parameters refused, nothing started: output: choose an output root itself or one folder"
        ), inside
    assert resolve_request(_request(output=str(root)), configs).output == str(root)
    assert resolve_request(_request(output="s3://bucket/shared/x"), configs).output == "s3://bucket/shared/x"


def test_unknown_datasets_and_empty_subsets_are_refused_naming_the_configs_datasets(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    _write(configs)
    with pytest.raises(ConfigError, match="datasets: the config has no dataset named c; its datasets: a, b"):
        resolve_request(_request(datasets=["a", "c"]), configs)
    with pytest.raises(ConfigError, match="datasets: name one or more"):
        resolve_request(_request(datasets=[]), configs)


def test_a_subset_drops_the_caps_of_categories_it_leaves_out(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    _write(
        configs,
        datasets=[
            {"name": "a", "format": "metamath", "path": "a.json", "max_prompts": 5, "category": "math"},
            {"name": "b", "format": "metamath", "path": "b.json", "max_prompts": 5, "category": "chat"},
        ],
        mix={"category_caps": {"math": 0.5, "chat": 0.5}},
    )
    config = resolve_request(_request(datasets=["a"]), configs)
    assert config.mix.category_caps == {"math": 0.5}


def test_a_config_file_that_is_not_yaml_is_named_by_line_never_quoted(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "broken.yaml").write_text("model:\n  path: TOPSECRET-VALUE: [unclosed\n")
    with pytest.raises(ConfigError) as refused:
        resolve_request(RunRequest(config="broken"), configs)
    message = str(refused.value)
    assert message.startswith("config: configs/broken.yaml on this box is not valid YAML at line 2")
    assert "TOPSECRET" not in message and "\n" not in message


def test_an_invalid_box_config_names_fields_without_their_values(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    _write(configs, fleet={"engine": "TOPSECRET-ENGINE"})
    with pytest.raises(ConfigError) as refused:
        resolve_request(RunRequest(config="run"), configs)
    message = str(refused.value)
    assert "fleet.engine" in message
    assert "TOPSECRET" not in message and "\n" not in message


def test_a_host_part_request_keeps_only_the_runs_choices(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    _write(configs, output=str(tmp_path / "store"))
    parameters = {
        "config": "run",
        "run_id": "r1",
        "host": "box-1",
        "attempt_id": "20261204-010203-abcdef12",
        "parent_flow_run_id": "6f1c1d4e-8d8e-4b61-9b48-9f4f1d9c2a11",
        "max_prompts": 4,
    }
    request = parse_run_request(parameters, configs, HostPartRequest)
    assert request.run_request() == HostRequest(config="run", run_id="r1", max_prompts=4)
    for bad in ({"attempt_id": "../../x"}, {"host": "a/b"}, {"config": {"model": {}}}, {"fleet": {}}):
        with pytest.raises(ConfigError) as refused:
            parse_run_request({**parameters, **bad}, configs, HostPartRequest)
        assert "\n" not in str(refused.value)
        assert str(refused.value).split(": ")[1].split(".")[0] == next(iter(bad))


def test_the_cli_choices_change_a_config_file_as_a_deployments_parameters_do(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    path = _write(configs)
    by_cli = resolve_config_file(path, run_id="r1", max_prompts=10, datasets=["b"])
    deployed = resolve_request(_request(run_id="r1", max_prompts=10, datasets=["b"]), configs)
    assert by_cli.model_dump() == deployed.model_dump()
    assert [(d.name, d.max_prompts) for d in by_cli.datasets] == [("b", 10)]
    whole = resolve_config_file(path, run_id="r1")
    assert [(d.name, d.max_prompts) for d in whole.datasets] == [("a", 50), ("b", None)]
    with pytest.raises(ConfigError, match="datasets: the config has no dataset named c; its datasets: a, b"):
        resolve_config_file(path, datasets=["c"])


def _open_series_run(configs: Path, run_id: str) -> Store:
    """A run of the series that took prompts (its entry and ledger) and published nothing (no manifest)."""
    run = resolve_run(_request(run_id=run_id), configs, "unused")
    store = Store(run.config.output)
    open_run(store, run.config, run.origin)
    open_series_entry(store, run.config)
    store.write_text(ledger_key("nightly", run_id), "")
    return store


def test_the_series_next_run_continues_its_open_run_and_a_complete_series_takes_new_prompts(
    tmp_path: Path,
) -> None:
    configs = tmp_path / "configs"
    _write(configs, series="nightly", output=str(tmp_path / "store"))
    store = Store(str(tmp_path / "store"))
    fresh = resolve_run(_request(), configs, "night-2")
    assert continue_open_series_run(fresh, _request(), configs, store) is fresh  # nothing open

    _open_series_run(configs, "night-1")
    continued = continue_open_series_run(fresh, _request(), configs, store)
    assert (continued.run_id, continued.continues_series) == ("night-1", "nightly")
    assert continued.config.config_hash() == read_stored_config(store, "night-1").config_hash  # type: ignore[union-attr]
    assert continued.origin is not None and continued.origin.config == "run"
    # A request naming a run id is that run, whatever the series holds.
    named = resolve_run(_request(run_id="other"), configs, "unused")
    assert continue_open_series_run(named, _request(run_id="other"), configs, store) is named
    # Choosing prompts for a new run while the series has an open one is refused, naming the way out.
    chosen = resolve_run(_request(max_prompts=3), configs, "night-2")
    with pytest.raises(
        ConfigError, match=r"series: run night-1 of series nightly took prompts .* run_id=night-1"
    ):
        continue_open_series_run(chosen, _request(max_prompts=3), configs, store)
    # Once its manifest exists, the series' next run takes new prompts again.
    store.write_json("runs/night-1/manifest.json", {"objects": []})
    assert continue_open_series_run(fresh, _request(), configs, store) is fresh


def test_the_operators_series_run_without_a_run_id_continues_the_open_run(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    path = _write(configs, series="nightly", output=str(tmp_path / "store"))
    assert resolve_config_file(path, continue_series=True).run_id != "night-1"
    _open_series_run(configs, "night-1")
    assert resolve_config_file(path, continue_series=True).run_id == "night-1"
    assert resolve_config_file(path, run_id="night-9", continue_series=True).run_id == "night-9"
    assert resolve_config_file(path).run_id != "night-1"  # `datagen plan` continues nothing
