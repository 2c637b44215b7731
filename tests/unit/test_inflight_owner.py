"""The dispatcher's in-flight cap has one owner: :func:`datagen.engines.capacity.decide_inflight_cap`.

The plan carries the owner's answer for every engine x tune result x explicit config, and the flows and
tasks pass no cap of their own (they read ``plan.dispatcher_inflight`` or a host's published cap).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from datagen.config import RunConfig
from datagen.engines.base import CapacityPlan
from datagen.engines.capacity import decide_inflight_cap, per_client_url
from datagen.engines.tune_result import TuneResult
from datagen.host.env_report import EnvReport
from datagen.host.plan import plan_servers
from datagen.host.probe import build_report, probe_from_dir

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
QWEN36_27B_DIR = FIXTURES / "models" / "qwen3.6-27b-shaped"
GPU_BUNDLE = FIXTURES / "probe" / "pcie-8x-sm120-sglang-0.5.23"
CONFIGURED = 24
TUNED = 135
ENGINES = ("sglang", "transformers", "external")
# The planner skips busy ports from here up; far from the defaults and from test_plan's range.
BASE_PORT = 43100


def _env(engine: str) -> EnvReport:
    if engine == "sglang":
        return probe_from_dir(GPU_BUNDLE, packages={})
    return build_report(
        query_gpu=None, topo=None, smi=None, apps=None, nvcc=None, packages={}, hostname="cpu"
    )


def _tune_result(per_server: int, output_tokens_per_s: float, *, engine: str = "sglang") -> TuneResult:
    return TuneResult(
        engine=engine,
        urls=["http://127.0.0.1:30000"],
        max_tokens=256,
        best_inflight_per_server=per_server,
        best_output_tokens_per_s=output_tokens_per_s,
        curve=[],
        measured_with="client",
    )


def _config(engine: str, tmp_path: Path, *, tuned: bool, explicit: bool) -> RunConfig:
    fleet: dict[str, Any] = {"engine": engine, "base_port": BASE_PORT}
    if engine == "external":
        fleet["external_urls"] = ["http://gpu-a:30000", "http://gpu-b:30000"]
    if engine == "transformers":
        fleet["cpu_servers"] = 2
    if explicit:
        fleet["max_inflight_per_server"] = CONFIGURED
    if tuned:
        result = _tune_result(TUNED, 1000.0, engine=engine)
        tune_file = tmp_path / f"tune-{engine}.json"
        tune_file.write_text(result.model_dump_json())
        fleet["tune_result"] = str(tune_file)
    return RunConfig.model_validate(
        {
            "model": {"path": str(QWEN36_27B_DIR)},
            "datasets": [{"name": "chat", "format": "sharegpt", "path": "/data/chat.jsonl"}],
            "output": "/tmp/out",
            "fleet": fleet,
        }
    )


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("tuned", [False, True], ids=["untuned", "tuned"])
@pytest.mark.parametrize("explicit", [False, True], ids=["default", "explicit"])
def test_the_plan_carries_the_owners_answer(engine: str, tuned: bool, explicit: bool, tmp_path: Path) -> None:
    # The engine's own cap: what the plan holds with neither a tune result nor an explicit number.
    sized = plan_servers(_env(engine), _config(engine, tmp_path, tuned=False, explicit=False), tmp_path)
    engine_caps = [server.max_inflight for server in sized.servers]
    config = _config(engine, tmp_path, tuned=tuned, explicit=explicit)

    plan = plan_servers(_env(engine), config, tmp_path)

    # Only SGLang on GPUs sizes its servers; CPU and external servers have no engine capacity.
    engine_sizes = engine == "sglang"
    for server, engine_cap in zip(plan.servers, engine_caps, strict=True):
        assert engine_cap is not None
        owner = decide_inflight_cap(
            CapacityPlan(max_inflight=engine_cap) if engine_sizes else None,
            configured=config.fleet.max_inflight_per_server,
            explicit=explicit,
            tuned=_tune_result(TUNED, 1000.0) if tuned else None,
        )
        assert server.max_inflight == owner.per_server
    expected = TUNED if tuned else CONFIGURED if explicit else None
    if expected is not None:
        assert {server.max_inflight for server in plan.servers} == {expected}
    assert plan.dispatcher_inflight == min(server.max_inflight or 0 for server in plan.servers)
    assert any("in flight per server" in reason for reason in plan.reasons)


def test_the_owner_orders_tuned_then_explicit_then_engine() -> None:
    engine = CapacityPlan(max_inflight=81, inflight_reason="engine says 81")
    tuned = _tune_result(135, 2000.0).model_copy(
        update={"setting_flag": "--max-running-requests", "best_setting": 120}
    )

    assert decide_inflight_cap(engine, configured=40, explicit=True, tuned=tuned).per_server == 135
    explicit = decide_inflight_cap(engine, configured=40, explicit=True, tuned=None)
    assert (explicit.per_server, explicit.source) == (40, "config")
    assert explicit.reasons[0] == "engine says 81"
    derived = decide_inflight_cap(engine, configured=40, explicit=False, tuned=None)
    assert (derived.per_server, derived.source, derived.reasons) == (81, "engine", ["engine says 81"])
    unsized = decide_inflight_cap(None, configured=40, explicit=False, tuned=None)
    assert (unsized.per_server, unsized.source) == (40, "config")


def test_a_router_carries_every_servers_share() -> None:
    assert per_client_url([72, 64, 72], router=False) == 64
    assert per_client_url([72, 64, 72], router=True) == 192
    with pytest.raises(ValueError, match="plan_servers"):
        per_client_url([], router=False)


def _orchestration_modules() -> list[Path]:
    return sorted([*(REPO / "flows").glob("*.py"), *(REPO / "tasks").glob("*.py")])


def _offences(source: str, where: str) -> list[str]:
    """Every place in ``source`` that computes or passes an in-flight cap instead of reading the plan's."""
    offences: list[str] = []
    for node in ast.walk(ast.parse(source)):
        line = f"{where}:{getattr(node, 'lineno', '?')}"
        # The config's number is an input of the owner, never of the dispatcher.
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "max_inflight_per_server"
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "fleet"
        ):
            offences.append(f"{line}: reads fleet.max_inflight_per_server")
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in {"max_inflight_per_server", "inflight_per_client_url", "decide_inflight_cap"}:
                offences.append(f"{line}: computes a cap with {name}()")
            for keyword in node.keywords:
                if keyword.arg in {"max_inflight_per_server", "max_inflight"} and not _is_carried(
                    keyword.value
                ):
                    offences.append(f"{line}: {keyword.arg}={ast.unparse(keyword.value)} is not the plan's")
    return offences


def _is_carried(value: ast.expr) -> bool:
    """``plan.dispatcher_inflight`` or a host's published ``max_inflight_per_server``."""
    return isinstance(value, ast.Attribute) and value.attr in {
        "dispatcher_inflight",
        "max_inflight_per_server",
    }


def test_flows_and_tasks_pass_no_cap_of_their_own() -> None:
    offences = [
        offence
        for path in sorted([*(REPO / "flows").glob("*.py"), *(REPO / "tasks").glob("*.py")])
        for offence in _offences(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    ]

    assert offences == []


@pytest.mark.parametrize(
    "source",
    [
        "Dispatcher(urls, max_inflight_per_server=plan.inflight_per_client_url(8))",
        "Dispatcher(urls, max_inflight_per_server=config.fleet.max_inflight_per_server)",
        "HostFleet(max_inflight_per_server=64)",
        "cap = plan.max_inflight_per_server(local.fleet.max_inflight_per_server)",
    ],
)
def test_the_check_catches_a_flow_that_decides_a_cap(source: str) -> None:
    assert _offences(source, "flows/example.py")


def test_the_check_accepts_the_plans_cap() -> None:
    assert (
        _offences("Dispatcher(urls, max_inflight_per_server=plan.dispatcher_inflight)", "flows/example.py")
        == []
    )
