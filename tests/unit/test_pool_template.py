"""deployments/work-pool.json is Prefect's own process-worker template with the command, environment, working
folder and output streaming fixed, and :func:`refused_job_variables` names what a run may not send."""

from __future__ import annotations

from pathlib import Path

import pytest

from datagen.app.deploy import closed_schema, pool_template, refused_job_variables

REPO = Path(__file__).resolve().parents[2]
FIXED = ("command", "env", "working_dir", "stream_output")


def test_the_template_is_prefects_default_with_command_env_and_folder_fixed() -> None:
    from prefect.workers.process import ProcessWorker

    default = ProcessWorker.get_default_base_job_template()
    ours = pool_template(REPO)

    # A Prefect upgrade that changes its template (a new per-run variable, say) shows here.
    assert set(ours["job_configuration"]) == set(default["job_configuration"])
    for key in set(default["job_configuration"]) - set(FIXED):
        assert ours["job_configuration"][key] == default["job_configuration"][key]
    assert ours["job_configuration"]["command"] is None  # Prefect's engine command, always
    assert ours["job_configuration"]["working_dir"] is None
    assert ours["job_configuration"]["stream_output"] is True  # the box's log keeps every run's output
    assert ours["job_configuration"]["env"]["PREFECT_LOGGING_EXTRA_LOGGERS"] == "datagen"
    expected = {key: value for key, value in default["variables"]["properties"].items() if key not in FIXED}
    assert ours["variables"]["properties"] == expected
    assert ours["variables"]["additionalProperties"] is False


def test_a_run_may_send_the_offered_variables_and_nothing_else() -> None:
    template = pool_template(REPO)

    assert refused_job_variables(None, template) == []
    assert refused_job_variables({"name": "x", "labels": {"a": "b"}}, template) == []
    assert refused_job_variables({"stream_output": False}, template) == ["stream_output"]
    assert refused_job_variables(
        {"command": "touch /tmp/x", "env.LD_PRELOAD": "/tmp/x.so", "working_dir": "/tmp", "name": "x"},
        template,
    ) == ["command", "env.LD_PRELOAD", "working_dir"]


def test_a_closed_parameter_schema_refuses_a_parameter_the_flow_does_not_have() -> None:
    # The schema `prefect deploy` gives the flow, closed as `datagen deploy` closes it, checked by the function
    # the server's create-flow-run calls (test_operations sends the same through a real server).
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import ValidationError, validate

    from flows.expand import expand
    from flows.host_part import expand_host

    schema = parameter_schema(expand).model_dump_for_openapi()
    assert "additionalProperties" not in schema  # what Prefect's deploy sends: any extra key passes
    validate({"config": "demo-worker", "training": {}}, schema, raise_on_error=True)

    for flow, allowed in (
        (expand, {"config": "demo-worker", "run_id": "a-run", "sampling": {"seed": 1}}),
        (
            expand_host,
            {
                "config": "demo-worker",
                "run_id": "a-run",
                "host": "a",
                "attempt_id": "b",
                "parent_flow_run_id": "6f1c1d4e-8d8e-4b61-9b48-9f4f1d9c2a11",
            },
        ),
    ):
        closed = closed_schema(parameter_schema(flow).model_dump_for_openapi())
        validate(allowed, closed, raise_on_error=True)
        with pytest.raises(ValidationError) as refused:
            validate({**allowed, "training": {}, "config_path": "/x"}, closed, raise_on_error=True)
        assert str(refused.value) == (
            "Validation failed. Failure reason: Additional properties are not allowed "
            "('config_path', 'training' were unexpected)"
        )
