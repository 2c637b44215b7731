"""A run's parameters pick a box config by name and set only the allowed choices; the box decides the rest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from datagen.app.run_request import (
    HostPartRequest,
    HostRequest,
    RunRequest,
    config_names,
    parse_run_request,
    resolve_config_file,
    resolve_request,
)
from datagen.errors import ConfigError
from datagen.output.runs import open_run
from datagen.output.store import Store


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


def test_a_run_id_alone_resumes_the_stored_config(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    _write(configs, output=str(tmp_path / "store"))
    original = resolve_request(_request(run_id="r1", max_prompts=7), configs)
    open_run(Store(original.output), original)
    # The file changed since, but the run keeps its stored config.
    _write(configs, output=str(tmp_path / "store"), seed=99)

    resumed = resolve_request(_request(run_id="r1"), configs)
    assert resumed.config_hash() == original.config_hash()
    assert [d.max_prompts for d in resumed.datasets] == [7, 7]
    with pytest.raises(ConfigError, match="config never changes"):
        resolve_request(_request(run_id="r1", max_prompts=3), configs)
    # A host part takes its serving config from its own box's file, not from the store.
    fresh = resolve_request(HostRequest(config="run", run_id="r1"), configs, resume=False)
    assert fresh.seed == 99


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
