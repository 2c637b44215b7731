"""deployments/prefect.yaml is valid: Prefect's own model accepts it, the entrypoint loads, the configs the
deployments name validate, and `prefect deploy --all` against a real Prefect API creates both deployments with
no path baked in (the pull step enters the worker's own checkout)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from datagen.config import load_run_config

REPO = Path(__file__).resolve().parents[2]
PREFECT_FILE = REPO / "deployments" / "prefect.yaml"


def _load() -> dict[str, Any]:
    return yaml.safe_load(PREFECT_FILE.read_text())


def test_prefect_yaml_is_accepted_by_prefects_model_and_parameters_are_run_configs() -> None:
    from prefect.cli.deploy._models import PrefectYamlModel

    model = PrefectYamlModel.model_validate(_load())
    names = sorted(deployment.name or "" for deployment in model.deployments)
    assert names == ["expand-host", "expand-manual", "expand-nightly"]
    host = next(d for d in model.deployments if d.name == "expand-host")
    assert host.entrypoint == "flows/host_part.py:expand_host"
    for deployment in model.deployments:
        if deployment.name == "expand-host":
            continue
        assert deployment.entrypoint == "flows/expand.py:expand"
    # A click on expand-manual's Run must not start a run that halts training: `config` has no default.
    manual = next(d for d in model.deployments if d.name == "expand-manual")
    assert not manual.parameters
    nightly = next(d for d in model.deployments if d.name == "expand-nightly")
    nightly_config = load_run_config(REPO / "configs" / f"{nightly.parameters['config']}.yaml")
    assert nightly_config.series == "nightly"
    assert nightly_config.training.restart_after_run


def test_entrypoint_loads_the_expand_flow_with_a_config_name_and_the_runs_choices_only() -> None:
    from prefect.flows import load_flow_from_entrypoint

    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        flow = load_flow_from_entrypoint("flows/expand.py:expand")
    finally:
        os.chdir(cwd)
    assert flow.name == "expand"
    assert list(flow.parameters.properties) == [
        "config",
        "run_id",
        "max_prompts",
        "series",
        "output",
        "sampling",
        "datasets",
        "retry_failed",
    ]
    assert flow.parameters.required == ["config"]
    assert flow.parameters.properties["config"]["type"] == "string"
    sampling = flow.parameters.definitions["SamplingChoice"]
    assert sampling["additionalProperties"] is False
    assert sampling["properties"]["temperature"]["title"] == "temperature"


def test_deploy_all_creates_manual_and_nightly_deployments_without_a_baked_in_path(prefect_api: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    async def create_pool() -> None:
        async with get_client() as client:
            await client.create_work_pool(WorkPoolCreate(name="gpu-box", type="process"), overwrite=True)

    asyncio.run(create_pool())
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect",
            "--no-prompt",
            "deploy",
            "--all",
            "--prefect-file",
            str(PREFECT_FILE),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr

    async def read() -> dict[str, Any]:
        async with get_client() as client:
            manual = await client.read_deployment_by_name("expand/expand-manual")
            nightly = await client.read_deployment_by_name("expand/expand-nightly")
            return {"manual": manual, "nightly": nightly}

    deployments = asyncio.run(read())
    nightly = deployments["nightly"]
    assert [schedule.schedule.cron for schedule in nightly.schedules] == ["0 1 * * *"]
    for deployment in deployments.values():
        assert deployment.work_pool_name == "gpu-box"
        assert deployment.pull_steps == [{"datagen.app.pullstep.enter_checkout": {}}]
        # One rule for the GPUs is the host lock the flow holds, not a per-deployment limit.
        assert deployment.global_concurrency_limit is None
    assert deployments["manual"].parameters == {}
    load_run_config(REPO / "configs" / f"{nightly.parameters['config']}.yaml")
