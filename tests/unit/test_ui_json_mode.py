"""The Prefect UI's "Use JSON input" submits the run form unchanged (no field rejects the form's encoding).

The deployments' form is a config name and the run's choices; the whole config (the CLI's flow, whose runs
the UI shows) keeps accepting the form's encoding of its free-form mappings.

In JSON mode the UI sends the parameters as one ``{"__prefect_kind": "json", "value": "<text>"}`` whose text
still holds the form's encoding of every free-form mapping field (``fleet.env``, ``fleet.sglang.speculative``,
``mix.category_caps``, ``existing_corpus.category_counts``): ``{"__prefect_kind": "json", "value": "{}"}``.
The server parses the outer wrapper only (Prefect's ``hydrate``) and validates against the flow's schema;
recorded with headless Chromium against `prefect server start` (see the P7 report), reproduced here with
Prefect's own hydrate/validate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools.hydration import HydrationContext, hydrate
from prefect.utilities.schema_tools.validation import validate

from datagen.config import RunConfig
from flows.expand import expand, operator_flow

REPO = Path(__file__).resolve().parents[2]
FORM_EMPTY_MAPPING = {"__prefect_kind": "json", "value": "{}"}


def _as_the_form_encodes_it(config: dict[str, Any]) -> dict[str, Any]:
    data = json.loads(json.dumps(config))
    data["fleet"]["env"] = FORM_EMPTY_MAPPING
    data["fleet"]["sglang"]["speculative"] = FORM_EMPTY_MAPPING
    data["mix"]["category_caps"] = {
        "__prefect_kind": "json",
        "value": json.dumps(data["mix"]["category_caps"]),
    }
    data["existing_corpus"]["category_counts"] = FORM_EMPTY_MAPPING
    return data


def test_the_json_mode_body_passes_the_servers_validation_and_the_flow_reads_it() -> None:
    config = RunConfig.model_validate(
        yaml.safe_load((REPO / "configs" / "qwen36-27b-8xgpu.yaml").read_text())
    )
    parameters = {"config": _as_the_form_encodes_it(config.model_dump(mode="json")), "config_name": None}
    body = {"__prefect_kind": "json", "value": json.dumps(parameters)}
    schema = parameter_schema(operator_flow().fn).model_dump_for_openapi()

    hydrated = hydrate(body, HydrationContext(raise_on_error=True))
    errors = validate(hydrated, schema, preprocess=True, ignore_required=False)

    assert [error.message for error in errors] == []
    received = RunConfig.model_validate(hydrated["config"])
    assert received.mix.category_caps == config.mix.category_caps
    assert received.fleet.env == {} and received.existing_corpus.category_counts == {}
    assert received.fleet.sglang.speculative == {}


def test_the_deployments_json_body_passes_the_servers_validation_and_the_flows_check() -> None:
    parameters = {
        "config": "qwen36-27b-8xgpu",
        "run_id": None,
        "max_prompts": 10,
        "series": None,
        "output": None,
        "sampling": {"temperature": 0.5, "max_tokens": None},
        "datasets": ["metamath"],
    }
    body = {"__prefect_kind": "json", "value": json.dumps(parameters)}
    schema = parameter_schema(expand.fn).model_dump_for_openapi()

    hydrated = hydrate(body, HydrationContext(raise_on_error=True))
    assert [
        error.message for error in validate(hydrated, schema, preprocess=True, ignore_required=False)
    ] == []
    validated = expand.validate_parameters(hydrated)
    assert validated["sampling"].temperature == 0.5


def test_the_old_whole_config_and_unknown_sampling_keys_are_refused_by_the_servers_validation() -> None:
    config = yaml.safe_load((REPO / "configs" / "qwen36-27b-8xgpu.yaml").read_text())
    schema = parameter_schema(expand.fn).model_dump_for_openapi()
    errors = validate({"config": config}, schema, preprocess=True, ignore_required=False)
    assert [list(error.path) for error in errors] == [["config"]]
    sampling = {"config": "demo-worker", "sampling": {"restart_command": ["sh"]}}
    errors = validate(sampling, schema, preprocess=True, ignore_required=False)
    assert [list(error.path) for error in errors] == [["sampling"]]
