"""deployments/work-pool.json is Prefect's own process-worker template with the command, environment and
working folder fixed, and :func:`refused_job_variables` names what a run may not send."""

from __future__ import annotations

from pathlib import Path

from datagen.app.deploy import pool_template, refused_job_variables

REPO = Path(__file__).resolve().parents[2]
FIXED = ("command", "env", "working_dir")


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
    assert ours["job_configuration"]["env"]["PREFECT_LOGGING_EXTRA_LOGGERS"] == "datagen"
    expected = {key: value for key, value in default["variables"]["properties"].items() if key not in FIXED}
    assert ours["variables"]["properties"] == expected
    assert ours["variables"]["additionalProperties"] is False


def test_a_run_may_send_the_offered_variables_and_nothing_else() -> None:
    template = pool_template(REPO)

    assert refused_job_variables(None, template) == []
    assert refused_job_variables({"name": "x", "labels": {"a": "b"}, "stream_output": False}, template) == []
    assert refused_job_variables(
        {"command": "touch /tmp/x", "env.LD_PRELOAD": "/tmp/x.so", "working_dir": "/tmp", "name": "x"},
        template,
    ) == ["command", "env.LD_PRELOAD", "working_dir"]
