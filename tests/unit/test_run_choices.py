"""The box's ceilings on a run's choices, where a run may run from, and whom a host part serves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from datagen.app.deploy import with_config_choices
from datagen.app.host_parent import ParentRun, parent_problem, started_problem
from datagen.app.run_origin import RunOrigin, retries_problem, work_queue_problem
from datagen.app.run_request import RunRequest, resolve_request
from datagen.config import parse_run_config
from datagen.errors import ConfigError
from datagen.output.multihost import HostsStarted


def _configs(tmp_path: Path, **changes: Any) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    shape = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 1000, "num_attention_heads": 4}
    (model / "config.json").write_text(json.dumps({**shape, "max_position_embeddings": 4096}))
    folder = tmp_path / "configs"
    folder.mkdir(exist_ok=True)
    data = {
        "model": {"path": str(model)},
        "sampling": {"max_tokens": 256, "samples_per_prompt": 2},
        "datasets": [{"name": "a", "format": "metamath", "path": "a.json"}],
        "output": str(tmp_path / "out"),
        **changes,
    }
    (folder / "box.yaml").write_text(yaml.safe_dump(data))
    return folder


def _refusal(folder: Path, **choices: Any) -> str:
    with pytest.raises(ConfigError) as refused:
        resolve_request(RunRequest.model_validate({"config": "box", **choices}), folder)
    return str(refused.value)


def test_choices_under_every_ceiling_pass_unchanged(tmp_path: Path) -> None:
    folder = _configs(tmp_path)
    config = resolve_request(
        RunRequest(config="box", sampling={"max_tokens": 4096, "samples_per_prompt": 2, "top_k": 1000}),
        folder,
    )
    assert (config.sampling.max_tokens, config.sampling.samples_per_prompt) == (4096, 2)


def test_a_choice_over_a_ceiling_is_refused_naming_the_ceiling(tmp_path: Path) -> None:
    folder = _configs(tmp_path)
    assert "sampling.max_tokens: at most 4096" in _refusal(folder, sampling={"max_tokens": 10**9})
    assert "sampling.samples_per_prompt: at most 2" in _refusal(folder, sampling={"samples_per_prompt": 3})
    assert "sampling.top_k: at most 1000" in _refusal(folder, sampling={"top_k": 1001})
    with pytest.raises(ValueError, match="less than or equal to 2"):
        RunRequest.model_validate({"config": "box", "sampling": {"temperature": 1e300}})


def test_the_operator_sets_the_ceilings_and_the_prompt_budget(tmp_path: Path) -> None:
    choices = {"max_samples_per_prompt": 8, "max_tokens": 1024, "max_prompts": 100}
    folder = _configs(tmp_path, run_choices=choices)
    assert "sampling.max_tokens: at most 1024" in _refusal(folder, sampling={"max_tokens": 2048})
    assert "budget of 100" in _refusal(folder)  # a dataset without a quota: unbounded
    config = resolve_request(
        RunRequest(config="box", max_prompts=100, sampling={"samples_per_prompt": 8}), folder
    )
    assert config.sampling.samples_per_prompt == 8
    assert "budget of 100" in _refusal(folder, max_prompts=101)


def _origin(**changes: Any) -> RunOrigin:
    return RunOrigin.model_validate(
        {
            "retries": 0,
            "flow_retries": 0,
            "work_queue": "default",
            "deployment_work_queue": "default",
            **changes,
        }
    )


def test_only_the_deployments_retries_and_the_allowed_queues_pass(tmp_path: Path) -> None:
    config = parse_run_config(yaml.safe_load((_configs(tmp_path) / "box.yaml").read_text()))
    assert retries_problem(_origin()) is None and retries_problem(_origin(retries=None)) is None
    assert (retries_problem(_origin(retries=3)) or "").startswith("empirical_policy.retries: ")
    assert work_queue_problem(_origin(), config) is None
    assert (work_queue_problem(_origin(work_queue="box-2"), config) or "").startswith("work_queue_name: ")
    assert (
        work_queue_problem(_origin(work_queue="x", deployment_work_queue=None), config) is None
    )  # no deployment
    allowed = config.model_copy(
        update={"run_choices": config.run_choices.model_copy(update={"work_queues": ["b"]})}
    )
    assert work_queue_problem(_origin(work_queue="b"), allowed) is None
    assert work_queue_problem(_origin(), allowed) is not None


def test_a_host_part_serves_only_a_running_expand_parent_that_lists_it() -> None:
    parent = ParentRun(flow_name="expand", running=True, parameters={"config": "box", "run_id": "r1"})
    assert parent_problem(parent, config="box", run_id="r1") is None
    assert "no such flow run" in (parent_problem(None, config="box", run_id="r1") or "")
    other_flow = parent.model_copy(update={"flow_name": "expand-host"})
    assert "not a flow run of `expand`" in (parent_problem(other_flow, config="box", run_id="r1") or "")
    ended = parent.model_copy(update={"running": False})
    assert "not running" in (parent_problem(ended, config="box", run_id="r1") or "")
    assert (parent_problem(parent, config="box", run_id="r2") or "").startswith("run_id: ")
    started = HostsStarted(parent_flow_run_id="p", flow_runs={"box-a": "f1"})
    assert started_problem(started, parent="p", host="box-a", flow_run_id="f1") is None
    assert started_problem(started, parent="p", host="box-a", flow_run_id="f2") is not None
    assert started_problem("did not appear", parent="p", host="box-a", flow_run_id="f1") is not None


def test_the_config_parameter_is_an_enum_of_the_checkouts_configs() -> None:
    schema = {"properties": {"config": {"type": "string"}, "run_id": {"type": "string"}}}
    assert with_config_choices(schema, ["a", "b"])["properties"]["config"]["enum"] == ["a", "b"]
    assert "enum" not in with_config_choices(schema, [])["properties"]["config"]
    assert "enum" not in schema["properties"]["config"]  # a copy


def test_a_lease_holder_record_is_gone_only_when_its_process_on_this_box_is(tmp_path: Path) -> None:
    import subprocess

    from datagen.host.run_holder import RunLeaseHolder, holder_path, read_holder, remove_holder, write_holder

    path = holder_path(tmp_path / "locks", "datagen-run-r1.v2")
    assert path.name == "datagen-run-r1.v2.holder.json"
    mine = RunLeaseHolder.this_process("r1.v2", "lease-1", None)
    write_holder(path, mine)
    assert read_holder(path) == mine and not mine.is_gone()
    child = subprocess.Popen(["true"])
    child.wait()
    assert mine.model_copy(update={"pid": child.pid}).is_gone()  # exited
    assert mine.model_copy(update={"start_ticks": -1}).is_gone()  # the pid names another process now
    assert not mine.model_copy(
        update={"pid": child.pid, "host": "another-box"}
    ).is_gone()  # never judged here
    remove_holder(path, "lease-2")
    assert path.exists()  # another lease's holder keeps its record
    remove_holder(path, "lease-1")
    assert read_holder(path) is None
