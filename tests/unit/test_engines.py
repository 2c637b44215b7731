from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from typing import get_args

import pytest

from datagen.config import EngineKind, FleetConfig, ModelConfig, RunConfig, SGLangOptions
from datagen.engines import (
    ENGINES,
    ExternalEngine,
    ServerSlot,
    SGLangEngine,
    TransformersEngine,
    engine_class,
    exact_tokens_enabled,
    get_engine,
)
from datagen.engines.sglang import (
    MAMBA_FLAG_NEW,
    MAMBA_FLAG_OLD,
    mamba_flag_from_flags,
    speculative_args,
)
from datagen.engines.sglang_tuning import cuda_graph_flag
from datagen.errors import ConfigError

MODEL = ModelConfig(path="/models/qwen3")
PROBE_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "probe"
CPU_SLOT = ServerSlot(index=0, host="127.0.0.1", port=30000, device="cpu", cpu_threads=2)
GPU_SLOT = ServerSlot(
    index=3, host="0.0.0.0", port=30003, device="cuda", gpu_ids=[3], compute_capability="9.0"
)
TP_SLOT = ServerSlot(
    index=0, host="127.0.0.1", port=30000, device="cuda", gpu_ids=[0, 1], compute_capability="9.0"
)


def _flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_transformers_cpu_launch_is_the_serve_cli_with_cpu_device_and_hidden_gpus() -> None:
    launch = TransformersEngine().build_launch(CPU_SLOT, MODEL, FleetConfig())

    assert launch.argv == [
        sys.executable,
        "-m",
        "transformers.cli.transformers",
        "serve",
        "--continuous-batching",
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        "30000",
        "/models/qwen3",
    ]
    assert launch.env == {
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_WAIT_POLICY": "PASSIVE",
        "OMP_NUM_THREADS": "2",
        "MKL_NUM_THREADS": "2",
    }


def test_transformers_gpu_launch_pins_the_gpu_and_appends_extra_args_and_env() -> None:
    fleet = FleetConfig(extra_args=["--dtype", "bfloat16"], env={"HF_HOME": "/cache"})

    launch = TransformersEngine().build_launch(GPU_SLOT, MODEL, fleet)

    assert _flag_value(launch.argv, "--device") == "cuda:0"
    assert launch.argv[-3:] == ["/models/qwen3", "--dtype", "bfloat16"]
    assert launch.env == {"CUDA_VISIBLE_DEVICES": "3", "HF_HOME": "/cache"}


def test_transformers_recipe_uses_only_options_the_installed_serve_command_has() -> None:
    from transformers.cli.serve import Serve

    parameters = set(inspect.signature(Serve.__init__).parameters)
    sized_cpu_slot = CPU_SLOT.model_copy(update={"cache_num_blocks": 34, "max_batch_tokens": 512})
    shared_cpu_slot = CPU_SLOT.model_copy(update={"cache_memory_fraction": 0.15})
    flags = [
        arg
        for slot in (GPU_SLOT, sized_cpu_slot, shared_cpu_slot)
        for arg in TransformersEngine().build_launch(slot, MODEL, FleetConfig()).argv
        if arg.startswith("--")
    ]

    assert {"--cb-num-blocks", "--cb-max-batch-tokens", "--cb-max-memory-percent"} <= set(flags)
    for flag in flags:
        assert flag[2:].replace("-", "_") in parameters, flag


def test_transformers_engine_is_available_in_the_project_venv() -> None:
    assert TransformersEngine().check_available() == []


def test_sglang_launch_carries_every_configured_knob() -> None:
    fleet = FleetConfig(
        engine="sglang",
        sglang=SGLangOptions(
            attention_backend="fa3",
            mem_fraction_static=0.85,
            max_running_requests=512,
            mamba_cache_strategy="extra_buffer",
            disable_radix_cache=True,
            reasoning_parser="qwen3",
            tool_call_parser="qwen25",
            speculative={"algorithm": "EAGLE", "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4},
        ),
        extra_args=["--random-seed", "7"],
    )
    model = ModelConfig(path="/m", tokenizer_path="/t", served_name="target", max_model_len_tokens=8192)

    launch = SGLangEngine(mamba_strategy_flag=MAMBA_FLAG_NEW).build_launch(TP_SLOT, model, fleet)
    argv = launch.argv

    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert _flag_value(argv, "--model-path") == "/m"
    assert _flag_value(argv, "--tokenizer-path") == "/t"
    assert _flag_value(argv, "--host") == "127.0.0.1"
    assert _flag_value(argv, "--port") == "30000"
    assert _flag_value(argv, "--tp-size") == "2"
    assert _flag_value(argv, "--served-model-name") == "target"
    assert _flag_value(argv, "--context-length") == "8192"
    assert _flag_value(argv, "--attention-backend") == "fa3"
    assert _flag_value(argv, "--mem-fraction-static") == "0.85"
    assert _flag_value(argv, "--max-running-requests") == "512"
    assert _flag_value(argv, "--reasoning-parser") == "qwen3"
    assert _flag_value(argv, "--tool-call-parser") == "qwen25"
    # With the radix cache off sglang ignores the strategy: it is not passed.
    assert MAMBA_FLAG_NEW not in argv
    assert MAMBA_FLAG_OLD not in argv
    assert "--disable-radix-cache" in argv
    assert "--enable-metrics" in argv
    assert _flag_value(argv, "--speculative-algorithm") == "EAGLE"
    assert _flag_value(argv, "--speculative-num-steps") == "3"
    assert _flag_value(argv, "--speculative-eagle-topk") == "1"
    assert _flag_value(argv, "--speculative-num-draft-tokens") == "4"
    assert argv[-2:] == ["--random-seed", "7"]
    assert launch.env == {"CUDA_VISIBLE_DEVICES": "0,1"}


def test_sglang_old_release_gets_the_old_mamba_flag_and_no_buffer_disables_the_overlap_schedule() -> None:
    fleet = FleetConfig(
        engine="sglang", sglang=SGLangOptions(mamba_cache_strategy="no_buffer", disable_radix_cache=False)
    )

    argv = SGLangEngine(mamba_strategy_flag=MAMBA_FLAG_OLD).build_launch(GPU_SLOT, MODEL, fleet).argv

    assert _flag_value(argv, MAMBA_FLAG_OLD) == "no_buffer"
    assert MAMBA_FLAG_NEW not in argv
    assert "--disable-overlap-schedule" in argv


def test_sglang_without_any_mamba_flag_refuses_a_configured_strategy() -> None:
    fleet = FleetConfig(
        engine="sglang", sglang=SGLangOptions(mamba_cache_strategy="no_buffer", disable_radix_cache=False)
    )

    with pytest.raises(ValueError, match="mamba_cache_strategy"):
        SGLangEngine(mamba_strategy_flag=None).build_launch(GPU_SLOT, MODEL, fleet)


def test_sglang_defaults_leave_optional_flags_out() -> None:
    fleet = FleetConfig(
        engine="sglang", sglang=SGLangOptions(disable_radix_cache=False, reasoning_parser=None)
    )

    argv = SGLangEngine().build_launch(GPU_SLOT, MODEL, fleet).argv

    for flag in (
        "--attention-backend",
        "--mem-fraction-static",
        "--disable-radix-cache",
        "--reasoning-parser",
    ):
        assert flag not in argv
    assert _flag_value(argv, "--served-model-name") == "/models/qwen3"


def test_sglang_on_sm120_defaults_to_flashinfer_attention() -> None:
    slot = GPU_SLOT.model_copy(update={"compute_capability": "12.0"})

    argv = SGLangEngine().build_launch(slot, MODEL, FleetConfig(engine="sglang")).argv

    assert _flag_value(argv, "--attention-backend") == "flashinfer"


def _recorded_flags(bundle: str) -> list[str]:
    # Written by sglang's own parser (tests/fixtures/probe/build_sglang_bundles.py), not by hand.
    return (PROBE_FIXTURES / bundle / "sglang-flags.txt").read_text().split()


def test_flag_names_are_chosen_from_what_each_real_sglang_release_accepts() -> None:
    current = _recorded_flags("pcie-8x-sm120-sglang-0.5.23")
    older = _recorded_flags("pcie-8x-sm120-sglang-0.5.14")

    assert mamba_flag_from_flags(current) == MAMBA_FLAG_NEW and MAMBA_FLAG_OLD not in current
    assert mamba_flag_from_flags(older) == MAMBA_FLAG_NEW and MAMBA_FLAG_OLD in older
    assert mamba_flag_from_flags(["--tp-size"]) is None
    assert mamba_flag_from_flags(None) == MAMBA_FLAG_NEW
    assert "--cuda-graph-max-bs" not in current
    assert cuda_graph_flag(current) == "--cuda-graph-max-bs-decode"
    assert cuda_graph_flag(older) == "--cuda-graph-max-bs-decode"
    assert cuda_graph_flag(["--cuda-graph-max-bs"]) == "--cuda-graph-max-bs"


def test_engines_declare_their_http_quirks() -> None:
    assert TransformersEngine.unsupported_sampling_fields == {"top_k", "min_p"}
    assert TransformersEngine.metrics_path is None and not TransformersEngine.supports_generate
    assert SGLangEngine.unsupported_sampling_fields == frozenset()
    assert SGLangEngine.metrics_path == "/metrics" and SGLangEngine.supports_generate
    for engine in (TransformersEngine(), SGLangEngine(), ExternalEngine()):
        assert engine.health_path == "/health"


def test_speculative_options_become_prefixed_flags() -> None:
    assert speculative_args(
        {"algorithm": "NGRAM", "speculative_num_steps": 2, "adaptive": True, "x": None}
    ) == [
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-steps",
        "2",
        "--speculative-adaptive",
    ]


def test_sglang_availability_matches_whether_the_package_is_installed() -> None:
    problems = SGLangEngine().check_available()

    if importlib.util.find_spec("sglang") is None:
        assert len(problems) == 1
        assert "pip install" in problems[0]
    else:
        assert problems == []


def test_fatal_patterns_catch_tracebacks_and_busy_ports_but_not_a_normal_startup() -> None:
    patterns = get_engine("transformers").fatal_log_patterns
    normal = (
        "[transformers] Loading /tmp/tiny\nINFO:     Started server process [4363]\n"
        "INFO:     Uvicorn running on http://127.0.0.1:31999 (Press CTRL+C to quit)\n"
    )
    crashed = "Loading weights\nTraceback (most recent call last):\n  File x\nOSError: no such model\n"
    busy = (
        "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): address in use\n"
    )

    assert not any(pattern.search(normal) for pattern in patterns)
    assert any(pattern.search(crashed) for pattern in patterns)
    assert any(pattern.search(busy) for pattern in patterns)


def test_get_engine_returns_each_recipe_and_rejects_unknown_kinds() -> None:
    assert isinstance(get_engine("transformers"), TransformersEngine)
    assert isinstance(get_engine("sglang"), SGLangEngine)
    external = get_engine("external")
    assert isinstance(external, ExternalEngine)
    assert not external.launches_processes
    with pytest.raises(ConfigError, match="unknown engine"):
        get_engine("vllm")


def test_one_table_names_every_engine_kind_and_its_recipe() -> None:
    assert list(ENGINES) == list(get_args(EngineKind))
    assert {kind: engine_class(kind).name for kind in ENGINES} == {kind: kind for kind in ENGINES}
    with pytest.raises(ConfigError, match="use one of: transformers, sglang, external"):
        engine_class("vllm")


def test_get_engine_builds_the_recipe_for_the_flags_a_probe_found() -> None:
    old_sglang = get_engine("sglang", accepted_flags=[MAMBA_FLAG_OLD, "--port"])
    assert isinstance(old_sglang, SGLangEngine) and old_sglang.mamba_strategy_flag == MAMBA_FLAG_OLD
    assert old_sglang.accepted_flags == {MAMBA_FLAG_OLD, "--port"}
    assert isinstance(get_engine("transformers", accepted_flags=["--port"]), TransformersEngine)


def test_external_engine_has_nothing_to_launch() -> None:
    with pytest.raises(TypeError, match="no process"):
        ExternalEngine().build_launch(CPU_SLOT, MODEL, FleetConfig())


def test_engine_class_gives_the_quirks_without_building_the_recipe() -> None:
    assert engine_class("transformers").unsupported_sampling_fields == {"top_k", "min_p"}
    assert engine_class("sglang").supports_generate
    assert engine_class("external").health_path == "/health"
    with pytest.raises(ConfigError, match="unknown engine"):
        engine_class("vllm")


def _run_config(engine: str, exact_tokens: bool | None) -> RunConfig:
    fleet: dict[str, object] = {"engine": engine}
    if engine == "external":
        fleet["external_urls"] = ["http://127.0.0.1:30000"]
    return RunConfig.model_validate(
        {
            "model": {"path": "/models/m"},
            "fleet": fleet,
            "datasets": [{"name": "m", "format": "metamath", "path": "/data/m.json"}],
            "output": "/tmp/out",
            "generation": {"exact_tokens": exact_tokens},
        }
    )


@pytest.mark.parametrize(
    ("engine", "exact_tokens", "expected"),
    [
        ("sglang", None, True),  # the default where /generate exists
        ("transformers", None, False),
        ("external", None, False),  # unknown software: chat unless the user says otherwise
        ("sglang", False, False),
        ("external", True, True),  # e.g. SGLang servers or their router, started by someone else
        ("transformers", False, False),
    ],
)
def test_exact_tokens_default_to_the_engines_generate_support(
    engine: str, exact_tokens: bool | None, expected: bool
) -> None:
    assert exact_tokens_enabled(_run_config(engine, exact_tokens)) is expected


def test_exact_tokens_for_an_engine_without_generate_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError) as raised:
        exact_tokens_enabled(_run_config("transformers", True))

    message = str(raised.value)
    assert "generation.exact_tokens: true needs SGLang's /generate" in message
    assert "'transformers'" in message and "fleet.engine: sglang" in message


def test_an_unset_exact_tokens_leaves_the_config_hash_of_older_runs_unchanged() -> None:
    unset = _run_config("sglang", None)
    assert "exact_tokens" not in unset.identity_dict()["generation"]
    assert _run_config("sglang", True).config_hash() != unset.config_hash()
