"""Every argv the planner can produce, and every body we send, checked by SGLang's REAL parser and models.

Per pinned sglang release (``tests/support/sglang_venv.py``: the wheel installed ``--no-deps`` in a cached
venv), the plan matrix (dense and hybrid models, SM90 and SM120, data and tensor parallel, MTP on and off,
radix cache off and on with ``no_buffer``, router) is planned with the flags that release's parser reports, and
the argvs are parsed by ``ServerArgs.add_cli_args`` / ``sglang_router.launch_router.parse_router_args``.
Chat bodies are validated by ``ChatCompletionRequest``, ``/generate`` bodies by ``GenerateReqInput`` and
``SamplingParams``. One introspection subprocess per release answers everything (a few seconds). In exact-token
mode the record's reasoning and tool calls are split from ``/generate``'s raw text: on the current release
they must come out as SGLang's own ``qwen3`` / ``qwen25`` / ``qwen3_coder`` parsers make them for chat.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import datagen.engines.sglang_introspect
from datagen.config import RunConfig, SamplingParams
from datagen.engines.router import router_launch
from datagen.engines.sglang_flags import run_introspection, sglang_flags
from datagen.generation.generate_api import build_generate_payload, parse_generate_completion
from datagen.generation.wire import (
    BadToolArgumentsError,
    GenerationRequest,
    PromptTokens,
    build_chat_payload,
    parse_chat_completion,
)
from datagen.host.fleet import Fleet
from datagen.host.plan import ServerPlan, plan_servers
from datagen.host.probe import EnvReport, probe_from_dir
from datagen.records import Message, PromptRecord
from tests.support import sglang_parsers
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


# What the checker must refuse (a misspelt flag, a sampling field sglang does not have, a malformed chat body):
# sent with the planned items in the same introspection call, so one sglang import per release answers both.
MISSPELT = {
    "server_argvs": ["--model-path", "m", "--mem-fraction-statik", "0.8"],
    "generate_bodies": {"input_ids": [1, 2], "sampling_params": {"max_tokens": 8}},
    "chat_bodies": {"model": "m", "messages": "not a list"},
}


@dataclass
class Contract:
    """What was sent to one sglang release's introspection (planned items first, :data:`MISSPELT` last)."""

    sent: dict[str, list[Any]]
    keyed_argvs: list[list[str]]
    key: str
    answer: dict[str, Any]


@pytest.fixture(scope="module")
def contract(sglang_python: str, tmp_path_factory: pytest.TempPathFactory) -> Contract:
    tmp_path = tmp_path_factory.mktemp("contract")
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

    # DATAGEN_SERVER_API_KEY: the argv a fleet launches a planned server with, read as sglang's
    # prepare_server_args reads it (the --config file), and sglang's auth rule on what datagen sends.
    key = f"dg-{secrets.token_hex(16)}"
    fleet = Fleet(plans[0], tmp_path / "state", api_key=key)
    keyed_argvs = [fleet.launch_argv(server)[3:] for server in plans[0].servers]
    bearer = f"Bearer {key}"  # what the dispatcher sends (tests/integration/test_server_api_key.py)
    auth_checks = [
        {"path": path, "authorization": authorization, "api_key": key}
        for path, authorization in (
            ("/health", None),  # the fleet's readiness probe and the dispatcher's health pool send no key
            ("/metrics", None),
            ("/v1/chat/completions", bearer),
            ("/generate", bearer),
            ("/v1/chat/completions", None),
            ("/generate", "Bearer wrong"),
        )
    ]
    sent: dict[str, list[Any]] = {
        "server_argvs": [*server_argvs, MISSPELT["server_argvs"]],
        "router_argvs": router_argvs,
        "chat_bodies": [*chat_bodies, MISSPELT["chat_bodies"]],
        "generate_bodies": [*generate_bodies, MISSPELT["generate_bodies"]],
    }
    answer = run_introspection(
        sglang_python, "check", {**sent, "keyed_argvs": keyed_argvs, "auth_checks": auth_checks}
    )
    return Contract(sent, keyed_argvs, key, answer)


def test_every_planned_argv_and_body_is_accepted_by_the_real_sglang(contract: Contract) -> None:
    answer = contract.answer
    rejected = {
        kind: [
            (item, error)
            for item, error in zip(sent, answer[kind], strict=True)
            if error is not None and not any(item is misspelt for misspelt in MISSPELT.values())
        ]
        for kind, sent in contract.sent.items()
    }
    assert rejected == {kind: [] for kind in rejected}, (
        f"sglang {answer['sglang_version']} rejects: {rejected}"
    )
    server_argvs = contract.sent["server_argvs"][:-1]
    hybrid_argvs = [argv for argv in server_argvs if "qwen3.6" in argv[argv.index("--model-path") + 1]]
    assert any("--speculative-algorithm" in argv for argv in hybrid_argvs)
    assert any("--disable-overlap-schedule" in argv for argv in hybrid_argvs)
    assert len(server_argvs) >= 90  # 2 hosts x 2 models x 4-5 variants x DP/TP, 2-8 servers each
    assert answer["api_keys"] == [contract.key] * len(contract.keyed_argvs), (
        "sglang reads the key from datagen's --config file"
    )
    assert answer["auth_checks"] == [True, True, True, True, False, False]
    assert all(contract.key not in " ".join(argv) for argv in contract.keyed_argvs)


def test_a_misspelt_flag_and_a_misspelt_sampling_field_are_caught_by_the_real_models(
    contract: Contract,
) -> None:
    # The last item of each list is the misspelt one (MISSPELT); the same call accepted every planned one.
    answer = contract.answer
    assert contract.sent["server_argvs"][-1] is MISSPELT["server_argvs"]
    assert answer["server_argvs"][-1] is not None
    assert answer["generate_bodies"][-1] is not None and "max_tokens" in answer["generate_bodies"][-1]
    assert answer["chat_bodies"][-1] is not None


SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer"},
                "ratio": {"type": "number"},
                "exact": {"type": "boolean"},
                "filters": {"type": "object"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "mode": {"enum": ["fast", "slow"]},
                "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
        },
    },
}
CALL = '{"name": "search", "arguments": {"query": "drafter", "limit": 3}}'
XML_CALL = (
    "<function=search>\n<parameter=query>\n42\n</parameter>\n<parameter=limit>\n5\n</parameter>\n"
    "<parameter=ratio>\n0.5\n</parameter>\n<parameter=exact>\nTrue\n</parameter>\n"
    '<parameter=filters>\n{"lang": "en"}\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n'
    "<parameter=mode>\nfast\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
    "<parameter=extra>\n7\n</parameter>\n</function>"
)
# (generated text, prompt left <think> open, the server's tool-call parser, tools offered)
PARSER_CASES: list[tuple[str, bool, str, bool]] = [
    ("<think>\nplan</think>\n\nanswer", False, "qwen25", False),
    ("plan</think>\n\nanswer", True, "qwen25", False),
    ("just an answer", False, "qwen25", False),
    ("<think>\ncut off mid-thought", False, "qwen25", False),
    ("still thinking", True, "qwen25", False),
    ("<think></think>answer", False, "qwen25", False),
    ("plan<tool_call>\n" + CALL + "\n</tool_call>", True, "qwen25", True),
    ("<think>\nR</think>\n\nLooking.\n\n<tool_call>\n" + CALL + "\n</tool_call>", False, "qwen25", True),
    (
        "Two.\n<tool_call>\n" + CALL + "\n</tool_call>\n<tool_call>\n" + CALL + "\n</tool_call>",
        False,
        "qwen25",
        True,
    ),
    (
        'Broken.\n<tool_call>\n{"name": "search", "arguments": {"query": x}}\n</tool_call>',
        False,
        "qwen25",
        True,
    ),
    ('Unknown.\n<tool_call>\n{"name": "fly", "arguments": {}}\n</tool_call>', False, "qwen25", True),
    ("List.\n<tool_call>\n[" + CALL + ", " + CALL + "]\n</tool_call>", False, "qwen25", True),
    ('Array.\n<tool_call>\n{"name": "search", "arguments": [1]}\n</tool_call>', False, "qwen25", True),
    ('Truncated.\n<tool_call>\n{"name": "search", "argu', False, "qwen25", True),
    ("No tools offered.\n<tool_call>\n" + CALL + "\n</tool_call>", False, "qwen25", False),
    ("Typed.\n\n<tool_call>\n" + XML_CALL + "\n</tool_call>", True, "qwen3_coder", True),
    (
        "R</think>\n\n<tool_call>\n" + XML_CALL + "\n</tool_call><tool_call>\n" + XML_CALL + "\n</tool_call>",
        True,
        "qwen3_coder",
        True,
    ),
    ("Open.\n<tool_call>\n<function=search>\n<parameter=query>\nabc", True, "qwen3_coder", True),
]


@pytest.fixture(scope="module")
def current_sglang_python() -> str:
    return str(ensure_venv(SGLANG_VERSIONS[0]))


def _sglang_chat_message(answer: dict[str, Any]) -> dict[str, Any]:
    """The chat completion SGLang's serving_chat builds from its parsers' output."""
    calls = [
        {"id": f"call_{index}", "type": "function", "function": call}
        for index, call in enumerate(answer["calls"])
    ]
    message = {
        "role": "assistant",
        "content": answer["content"] or "",
        "reasoning_content": answer["reasoning"] or None,
    }
    if calls:
        message["tool_calls"] = calls
    return {
        "choices": [{"message": message, "finish_reason": "tool_calls" if calls else "stop"}],
        "usage": {},
    }


def _outcome(parse: Any) -> Any:
    try:
        completion, finish_reason, _ = parse()
    except BadToolArgumentsError:
        return "final: invalid_tool_arguments"
    calls = [(call.function.name, call.function.arguments) for call in completion.tool_calls or []]
    return (completion.content or "", completion.reasoning_content, calls, finish_reason)


def test_exact_token_records_split_reasoning_and_tool_calls_as_sglangs_chat_api_does(
    current_sglang_python: str,
) -> None:
    request_body = {
        "cases": [
            {
                "text": text,
                "force_reasoning": open_,
                "tool_call_parser": parser,
                "tools": [SEARCH_TOOL] if tools else [],
            }
            for text, open_, parser, tools in PARSER_CASES
        ]
    }
    result = subprocess.run(
        [current_sglang_python, sglang_parsers.__file__, datagen.engines.sglang_introspect.__file__],
        input=json.dumps(request_body),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answers = json.loads(result.stdout)["answers"]

    mismatches = []
    for (text, open_, _, tools), answer in zip(PARSER_CASES, answers, strict=True):
        assert "error" not in answer, answer
        prompt = PromptRecord(
            prompt_id="p",
            dataset="d",
            messages=[Message(role="user", content="?")],
            tools=[SEARCH_TOOL] if tools else None,
        )
        request = GenerationRequest(
            prompt=prompt,
            sampling=SamplingParams(),
            dataset="d",
            prompt_tokens=PromptTokens(input_ids=[1], opens_reasoning=open_),
        )
        body = {"text": text, "output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "stop"}}}
        ours = _outcome(lambda body=body, request=request: parse_generate_completion(body, request))
        theirs = _outcome(lambda answer=answer: parse_chat_completion(_sglang_chat_message(answer)))
        if ours != theirs:
            mismatches.append((text, ours, theirs))
    assert mismatches == []
