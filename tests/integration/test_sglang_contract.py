"""Every argv the planner can produce, and every body we send, checked by SGLang's REAL parser and models.

Per pinned sglang release (``tests/support/sglang_venv.py``: the wheel installed ``--no-deps`` in a cached
venv), the plan matrix (dense and hybrid models, SM90 and SM120, data and tensor parallel, MTP on and off,
radix cache off and on with ``no_buffer``, router) is planned with the flags that release's parser reports, and
the argvs are parsed by ``ServerArgs.add_cli_args`` / ``sglang_router.launch_router.parse_router_args``.
Chat bodies are validated by ``ChatCompletionRequest``, ``/generate`` bodies by ``GenerateReqInput`` and
``SamplingParams``. In exact-token mode the record's reasoning and tool calls are split from ``/generate``'s
raw text: on the current release they must come out as SGLang's own ``qwen3`` / ``qwen25`` / ``qwen3_coder``
parsers make them for chat.

One sglang import per release answers everything (importing sglang costs ~6 s of CPU): the plans are built
with the flag list recorded from that release's real parser (the probe bundle ``build_sglang_bundles.py``
writes), the ``check`` answer carries the flags the live parser has, and the plans must have been built with
exactly those (a stale recording is re-planned and checked again, with a warning). The older release goes
through ``run_introspection`` (the script run as datagen runs it); the current release's check rides in the
parser process (``tests/support/sglang_parsers.py``), which runs the same script's ``check``.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from datagen.config import RunConfig, SamplingParams
from datagen.engines.router import router_launch
from datagen.engines.sglang_flags import (
    INTROSPECT_SCRIPT,
    SGLangIntrospectionError,
    flags_from_answer,
    run_introspection,
    sglang_flags,
    sglang_version,
)
from datagen.errors import PlanError
from datagen.generation.openai_chat import (
    BadToolArgumentsError,
    GenerationRequest,
    PromptTokens,
    build_chat_payload,
    parse_chat_completion,
)
from datagen.generation.sglang_generate import build_generate_payload, parse_generate_completion
from datagen.host.env_report import EnvReport
from datagen.host.fleet import Fleet
from datagen.host.plan import ServerPlan, plan_servers
from datagen.host.probe import probe_from_dir
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
# Written by tests/fixtures/probe/build_sglang_bundles.py from each pinned release's real parser.
RECORDED_FLAGS = "pcie-8x-sm120-sglang-{version}/sglang-flags.txt"
# The parser process imports sglang's protocol, parsers and server args; a cold start on a busy box is slow.
PARSERS_TIMEOUT_S = 300
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

    version: str
    python: str
    planned_with: list[str]  # the flags the plans were built with
    sent: dict[str, list[Any]]
    keyed_argvs: list[list[str]]
    key: str
    answer: dict[str, Any] | None  # None when the check itself failed (``error``)
    error: str | None
    parser_answers: list[dict[str, Any]] | None  # PARSER_CASES, on the current release only

    def checked(self) -> dict[str, Any]:
        """The check's answer; fails the test with sglang's error where the check itself failed."""
        assert self.answer is not None, f"sglang {self.version} could not check the plans: {self.error}"
        return self.answer


@dataclass
class _Planned:
    sent: dict[str, list[Any]]
    keyed_argvs: list[list[str]]
    key: str
    request: dict[str, Any]


def _plan_checks(flags: list[str], tmp_path: Path) -> _Planned:
    """Every argv and body planned for an sglang accepting ``flags``, as one ``check`` request."""
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
    # The misspelt argv rides last among the keyed ones too: it is answered in its place, not a crash of the check.
    request = {**sent, "keyed_argvs": [*keyed_argvs, MISSPELT["server_argvs"]], "auth_checks": auth_checks}
    return _Planned(sent, keyed_argvs, key, request)


def _parser_request() -> list[dict[str, Any]]:
    return [
        {
            "text": text,
            "force_reasoning": open_,
            "tool_call_parser": parser,
            "tools": [SEARCH_TOOL] if tools else [],
        }
        for text, open_, parser, tools in PARSER_CASES
    ]


def _check(python: str, request: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The ``check`` answer of the introspection script run as datagen runs it, or the error it failed with."""
    try:
        return run_introspection(python, "check", request), None
    except SGLangIntrospectionError as error:
        return None, str(error)


def _check_with_parsers(
    python: str, request: dict[str, Any]
) -> tuple[dict[str, Any] | None, str | None, list[dict[str, Any]]]:
    """:func:`_check`'s answer and SGLang's parsers' answers to :data:`PARSER_CASES`, from one sglang import."""
    result = subprocess.run(
        [python, sglang_parsers.__file__, str(INTROSPECT_SCRIPT)],
        input=json.dumps({"cases": _parser_request(), "check": request}),
        capture_output=True,
        text=True,
        timeout=PARSERS_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout)
    return answer["check"], answer["check_error"], answer["answers"]


def _stale_recording(recorded: Path, version: str, why: str) -> None:
    warnings.warn(
        f"{recorded} is not what sglang {version}'s parser accepts ({why}): planned with the live flags; "
        "run tests/fixtures/probe/build_sglang_bundles.py",
        stacklevel=2,
    )


def _make_contract(version: str, tmp_path: Path) -> Contract:
    python = str(ensure_venv(version))
    recorded = FIXTURES / "probe" / RECORDED_FLAGS.format(version=version)
    flags: list[str] | None = recorded.read_text(encoding="utf-8").split() if recorded.is_file() else None
    planned = None
    if flags is not None:
        try:
            planned = _plan_checks(flags, tmp_path / "recorded")
        except PlanError as problem:  # the planner needs a flag the recording lacks
            _stale_recording(recorded, version, str(problem))
    if flags is None or planned is None:  # ask the parser first (one more sglang import)
        flags = sglang_flags(python, use_cache=False)
        assert flags is not None and "--model-path" in flags
        planned = _plan_checks(flags, tmp_path / "live")
    parser_answers = None
    if version == SGLANG_VERSIONS[0]:
        answer, error, parser_answers = _check_with_parsers(python, planned.request)
    else:
        answer, error = _check(python, planned.request)
    if answer is not None and flags_from_answer(answer) != flags:
        live = flags_from_answer(answer)
        _stale_recording(recorded, version, f"{len(flags)} flags planned with, {len(live)} live")
        flags = live
        planned = _plan_checks(flags, tmp_path / "replanned")
        answer, error = _check(python, planned.request)
    return Contract(
        version, python, flags, planned.sent, planned.keyed_argvs, planned.key, answer, error, parser_answers
    )


@pytest.fixture(scope="module")
def contracts(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Contract]:
    """Each release's :class:`Contract`, made on first use (the parser test shares the current release's)."""
    made: dict[str, Contract] = {}

    def contract_for(version: str) -> Contract:
        if version not in made:
            made[version] = _make_contract(version, tmp_path_factory.mktemp(f"contract-{version}"))
        return made[version]

    return contract_for


@pytest.fixture(scope="module", params=SGLANG_VERSIONS)
def contract(request: pytest.FixtureRequest, contracts: Callable[[str], Contract]) -> Contract:
    return contracts(request.param)


def test_every_planned_argv_and_body_is_accepted_by_the_real_sglang(contract: Contract) -> None:
    answer = contract.checked()
    assert flags_from_answer(answer) == contract.planned_with, "planned with flags this sglang does not have"
    assert "--model-path" in contract.planned_with
    assert sglang_version(contract.python) == answer["sglang_version"] == contract.version
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
    assert answer["api_keys"][:-1] == [contract.key] * len(contract.keyed_argvs), (
        "sglang reads the key from datagen's --config file"
    )
    assert answer["auth_checks"] == [True, True, True, True, False, False]
    assert all(contract.key not in " ".join(argv) for argv in contract.keyed_argvs)


def test_a_misspelt_flag_and_a_misspelt_sampling_field_are_caught_by_the_real_models(
    contract: Contract,
) -> None:
    # The last item of each list is the misspelt one (MISSPELT); the same call accepted every planned one.
    answer = contract.checked()
    assert contract.sent["server_argvs"][-1] is MISSPELT["server_argvs"]
    assert answer["server_argvs"][-1] is not None
    assert answer["generate_bodies"][-1] is not None and "max_tokens" in answer["generate_bodies"][-1]
    assert answer["chat_bodies"][-1] is not None
    misspelt_key = answer["api_keys"][-1]
    assert isinstance(misspelt_key, dict) and "mem-fraction-statik" in misspelt_key["error"], misspelt_key


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
    contracts: Callable[[str], Contract],
) -> None:
    answers = contracts(SGLANG_VERSIONS[0]).parser_answers
    assert answers is not None

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
