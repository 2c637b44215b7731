"""Every argv the planner can produce, and every body we send, checked by SGLang's REAL parser and models.

Per pinned sglang release (``tests/support/sglang_venv.py``: the wheel installed ``--no-deps`` in a cached
venv), the plan matrix (dense and hybrid models, SM90 and SM120, data and tensor parallel, MTP on and off,
radix cache off and on with ``no_buffer``, router) is planned with the flags that release's parser reports, and
the argvs are parsed by ``ServerArgs.add_cli_args`` / ``sglang_router.launch_router.parse_router_args``.
Chat bodies are validated by ``ChatCompletionRequest``, ``/generate`` bodies by ``GenerateReqInput`` and
``SamplingParams``. One introspection subprocess per release answers everything (a few seconds).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from datagen.config import RunConfig, SamplingParams
from datagen.engines.sglang_flags import run_introspection, sglang_flags
from datagen.generation.generate_api import build_generate_payload
from datagen.generation.wire import GenerationRequest, build_chat_payload
from datagen.host.plan import ServerPlan, plan_servers, router_launch
from datagen.host.probe import EnvReport, probe_from_dir
from datagen.records import Message, PromptRecord
from tests.support.sglang_venv import SGLANG_VERSIONS, ensure_venv

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MODELS = {
    "dense-qwen3-27b": FIXTURES / "models" / "qwen3-27b-shaped",
    "hybrid-qwen3.6-27b": FIXTURES / "models" / "qwen3.6-27b-shaped",
}
# SM90 NVLink pair (DP and TP 2) and the 8 x SM120 PCIe box (DP).
HOSTS = {"h200x2-nvlink": (None, 2), "pcie-8x-sm120-sglang-0.5.23": (None,)}
BASE_PORT = 43000
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def _config(model: Path, **fleet: Any) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"path": str(model)},
            "datasets": [{"name": "chat", "format": "sharegpt", "path": "/data/chat.jsonl"}],
            "output": "/tmp/out",
            "fleet": {"engine": "sglang", "base_port": BASE_PORT, **fleet},
        }
    )


def _fleet_variants(model: str) -> list[dict[str, Any]]:
    variants: list[dict[str, Any]] = [
        {},
        {"sglang": {"disable_radix_cache": False, "mamba_cache_strategy": "no_buffer"}},
        {"sglang": {"disable_radix_cache": False, "mamba_cache_strategy": "extra_buffer"}},
        {"extra_args": ["--random-seed", "7"], "sglang": {"tool_call_parser": "qwen25"}},
    ]
    if model.startswith("hybrid"):
        variants.append({"speculative": "mtp"})
    return variants


def _plans(flags: list[str], tmp_path: Path) -> list[ServerPlan]:
    plans = []
    for host, tensor_parallels in HOSTS.items():
        env: EnvReport = probe_from_dir(FIXTURES / "probe" / host, packages={})
        env = env.model_copy(update={"sglang_flags": flags})
        for model_name, model in MODELS.items():
            for variant in _fleet_variants(model_name):
                for tp in tensor_parallels:
                    fleet = {**variant, **({"tensor_parallel": tp} if tp else {})}
                    plans.append(plan_servers(env, _config(model, **fleet), tmp_path))
    return plans


def _requests() -> list[GenerationRequest]:
    prompt = PromptRecord(
        prompt_id="p1",
        dataset="chat",
        messages=[
            Message(role="system", content="Be brief."),
            Message(role="user", content="Weather in Oslo?"),
        ],
        tools=TOOLS,
    )
    plain = prompt.model_copy(update={"tools": None})
    samplings = [
        SamplingParams(),
        SamplingParams(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, max_tokens=4096, seed=1234),
        SamplingParams(temperature=0.0, enable_thinking=False, max_tokens=16),
        SamplingParams(enable_thinking=True, samples_per_prompt=4),
    ]
    return [
        GenerationRequest(prompt=record, sampling=sampling, dataset="chat")
        for record in (prompt, plain)
        for sampling in samplings
    ]


@pytest.fixture(scope="module", params=SGLANG_VERSIONS)
def sglang_python(request: pytest.FixtureRequest) -> str:
    return str(ensure_venv(request.param))


def test_every_planned_argv_and_body_is_accepted_by_the_real_sglang(
    sglang_python: str, tmp_path: Path
) -> None:
    flags = sglang_flags(sglang_python, use_cache=False)
    assert flags is not None and "--model-path" in flags
    plans = _plans(flags, tmp_path)
    server_argvs = [
        server.launch.argv[3:] for plan in plans for server in plan.servers if server.launch is not None
    ]
    router_argvs = [
        router_launch(plan.urls, "127.0.0.1", BASE_PORT + 100, policy).argv[3:]
        for plan in plans[:2]
        for policy in ("cache_aware", "round_robin", "power_of_two", "random")
    ]
    requests = _requests()
    chat_bodies = [build_chat_payload(request, "target") for request in requests]
    generate_bodies = [
        build_generate_payload([151644, 872, 198, 9707, 151645], request, rid=f"r{index}")
        for index, request in enumerate(requests)
    ]

    answer = run_introspection(
        sglang_python,
        "check",
        {
            "server_argvs": server_argvs,
            "router_argvs": router_argvs,
            "chat_bodies": chat_bodies,
            "generate_bodies": generate_bodies,
        },
    )

    rejected = {
        kind: [(item, error) for item, error in zip(sent, answer[kind], strict=True) if error is not None]
        for kind, sent in (
            ("server_argvs", server_argvs),
            ("router_argvs", router_argvs),
            ("chat_bodies", chat_bodies),
            ("generate_bodies", generate_bodies),
        )
    }
    assert rejected == {kind: [] for kind in rejected}, (
        f"sglang {answer['sglang_version']} rejects: {rejected}"
    )
    hybrid_argvs = [argv for argv in server_argvs if "qwen3.6" in argv[argv.index("--model-path") + 1]]
    assert any("--speculative-algorithm" in argv for argv in hybrid_argvs)
    assert any("--disable-overlap-schedule" in argv for argv in hybrid_argvs)
    assert len(server_argvs) >= 90  # 2 hosts x 2 models x 4-5 variants x DP/TP, 2-8 servers each


def test_a_misspelt_flag_and_a_misspelt_sampling_field_are_caught_by_the_real_models(
    sglang_python: str,
) -> None:
    answer = run_introspection(
        sglang_python,
        "check",
        {
            "server_argvs": [["--model-path", "m", "--mem-fraction-statik", "0.8"]],
            "generate_bodies": [{"input_ids": [1, 2], "sampling_params": {"max_tokens": 8}}],
            "chat_bodies": [{"model": "m", "messages": "not a list"}],
        },
    )

    assert answer["server_argvs"][0] is not None
    assert answer["generate_bodies"][0] is not None and "max_tokens" in answer["generate_bodies"][0]
    assert answer["chat_bodies"][0] is not None
