from __future__ import annotations

import importlib.util
import json
import os
import shlex
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from datagen.config import RunConfig
from datagen.engines import SGLangEngine
from datagen.engines.cpu_sizing import cpu_slot_fields
from datagen.engines.model_size import shape_from_config
from datagen.engines.router import router_launch
from datagen.engines.sglang import MAMBA_FLAG_OLD
from datagen.errors import PlanError
from datagen.host.env_report import EnvReport
from datagen.host.plan import ServerPlan, ServerSpec, plan_servers
from datagen.host.ports import client_url, port_is_free
from datagen.host.probe import build_report, probe_from_dir
from tests.support.workers import worker_port

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "probe"
PACKAGES: dict[str, str | None] = {}
# Ports are picked from here up; far from the defaults so a developer's running servers do not interfere.
PORT_SEARCH_START = worker_port(32000)
# 8 x RTX PRO 6000 (SM 12.0, 96 GB) over PCIe after training was halted; flags from the real sglang parser.
IDLE_PCIE_SM120 = "pcie-8x-sm120-sglang-0.5.23"
SGLANG_BUNDLES = ("pcie-8x-sm120-sglang-0.5.23", "pcie-8x-sm120-sglang-0.5.14")
QWEN36_27B_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen3.6-27b-shaped"
# The seed's hand-tuned concurrency for Qwen3.6-27B on one 96 GB card (no_buffer, 37 -> 72 requests).
SEED_RUNNING_REQUESTS = 72


def _config(**fleet: Any) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"path": "/models/target"},
            "datasets": [{"name": "chat", "format": "sharegpt", "path": "/data/chat.jsonl"}],
            "output": "/tmp/out",
            "fleet": fleet,
        }
    )


def _env(name: str | None) -> EnvReport:
    if name is None:
        # A host without nvidia-smi: nothing recorded but its packages.
        return build_report(
            query_gpu=None, topo=None, smi=None, apps=None, nvcc=None, packages=PACKAGES, hostname="cpu"
        )
    return probe_from_dir(FIXTURES / name, packages=PACKAGES)


@pytest.fixture()
def base_port() -> int:
    """A port with a few free ports above it (other tests may run in parallel)."""
    port = PORT_SEARCH_START
    while not all(port_is_free("127.0.0.1", candidate) for candidate in range(port, port + 12)):
        port += 13
    return port


@pytest.fixture()
def busy_port(base_port: int) -> Iterator[int]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", base_port))
        listener.listen()
        yield base_port


def test_host_without_gpus_gets_cpu_servers_on_consecutive_ports(tmp_path: Path, base_port: int) -> None:
    plan = plan_servers(_env(None), _config(base_port=base_port, cpu_servers=3), tmp_path)

    assert plan.mode == "cpu"
    assert plan.engine == "transformers"
    assert [server.port for server in plan.servers] == [base_port, base_port + 1, base_port + 2]
    assert plan.urls == [f"http://127.0.0.1:{port}" for port in range(base_port, base_port + 3)]
    assert all(server.gpu_ids == [] for server in plan.servers)
    assert plan.servers[1].log_path == str(tmp_path / "logs" / "server-01.log")
    launch = plan.servers[0].launch
    assert launch is not None
    assert launch.argv[launch.argv.index("--device") + 1] == "cpu"
    assert launch.env["CUDA_VISIBLE_DEVICES"] == ""
    assert plan.served_model_name == "/models/target"
    assert any("no GPUs" in reason for reason in plan.reasons)


def test_num_servers_overrides_the_cpu_server_count(tmp_path: Path, base_port: int) -> None:
    plan = plan_servers(_env(None), _config(base_port=base_port, cpu_servers=3, num_servers=1), tmp_path)

    assert len(plan.servers) == 1


def test_busy_port_is_skipped_and_the_reason_recorded(tmp_path: Path, busy_port: int) -> None:
    plan = plan_servers(_env(None), _config(base_port=busy_port, cpu_servers=2), tmp_path)

    assert [server.port for server in plan.servers] == [busy_port + 1, busy_port + 2]
    assert any(f"port {busy_port}" in reason and "in use" in reason for reason in plan.reasons)


def test_gpu_host_gets_one_pinned_server_per_gpu(tmp_path: Path, base_port: int) -> None:
    plan = plan_servers(_env("pcie-8gpu"), _config(base_port=base_port), tmp_path)

    assert plan.mode == "dp"
    assert [server.gpu_ids for server in plan.servers] == [[index] for index in range(8)]
    assert [server.launch.env["CUDA_VISIBLE_DEVICES"] for server in plan.servers if server.launch] == [
        str(index) for index in range(8)
    ]


def test_num_servers_caps_the_gpu_servers(tmp_path: Path, base_port: int) -> None:
    plan = plan_servers(_env("pcie-8gpu"), _config(base_port=base_port, num_servers=3), tmp_path)

    assert [server.gpu_ids for server in plan.servers] == [[0], [1], [2]]


def test_device_cpu_ignores_the_gpus(tmp_path: Path, base_port: int) -> None:
    plan = plan_servers(_env("h200x2-nvlink"), _config(base_port=base_port, device="cpu"), tmp_path)

    assert plan.mode == "cpu"
    assert len(plan.servers) == 2


def test_device_cuda_without_gpus_is_refused(tmp_path: Path, base_port: int) -> None:
    with pytest.raises(PlanError, match="no GPU"):
        plan_servers(_env(None), _config(base_port=base_port, device="cuda"), tmp_path)


def test_tensor_parallel_groups_stay_inside_nvlink_islands(tmp_path: Path, base_port: int) -> None:
    config = _config(base_port=base_port, engine="sglang", tensor_parallel=2)

    plan = plan_servers(_env("nvlink-pairs-4gpu"), config, tmp_path, engine=SGLangEngine())

    assert plan.mode == "tp"
    assert [server.gpu_ids for server in plan.servers] == [[0, 1], [2, 3]]
    first = plan.servers[0].launch
    assert first is not None
    assert first.argv[first.argv.index("--tp-size") + 1] == "2"
    assert first.env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_tensor_parallel_larger_than_every_island_is_refused(tmp_path: Path, base_port: int) -> None:
    config = _config(base_port=base_port, engine="sglang", tensor_parallel=4)

    with pytest.raises(PlanError, match="NVLink island"):
        plan_servers(_env("nvlink-pairs-4gpu"), config, tmp_path, engine=SGLangEngine())


def test_tensor_parallel_over_pcie_uses_consecutive_gpus_and_says_so(tmp_path: Path, base_port: int) -> None:
    config = _config(base_port=base_port, engine="sglang", tensor_parallel=4)

    plan = plan_servers(_env("pcie-8gpu"), config, tmp_path, engine=SGLangEngine())

    assert [server.gpu_ids for server in plan.servers] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert any("no NVLink" in reason for reason in plan.reasons)


def test_tensor_parallel_with_transformers_is_refused(tmp_path: Path, base_port: int) -> None:
    with pytest.raises(PlanError, match="one GPU per server"):
        plan_servers(_env("h200x2-nvlink"), _config(base_port=base_port, tensor_parallel=2), tmp_path)


def test_sglang_plan_uses_the_engine_recipe_given_and_sm_from_the_probe(
    tmp_path: Path, base_port: int
) -> None:
    config = _config(
        base_port=base_port,
        engine="sglang",
        sglang={"mamba_cache_strategy": "no_buffer", "disable_radix_cache": False},
    )

    plan = plan_servers(
        _env("pcie-8gpu"), config, tmp_path, engine=SGLangEngine(mamba_strategy_flag=MAMBA_FLAG_OLD)
    )

    launch = plan.servers[0].launch
    assert launch is not None
    assert launch.argv[launch.argv.index(MAMBA_FLAG_OLD) + 1] == "no_buffer"
    assert launch.argv[launch.argv.index("--attention-backend") + 1] == "flashinfer"


def test_sglang_option_the_installed_release_lacks_becomes_a_plan_error(
    tmp_path: Path, base_port: int
) -> None:
    config = _config(
        base_port=base_port,
        engine="sglang",
        sglang={"mamba_cache_strategy": "no_buffer", "disable_radix_cache": False},
    )

    with pytest.raises(PlanError, match="mamba_cache_strategy"):
        plan_servers(_env("pcie-8gpu"), config, tmp_path, engine=SGLangEngine(mamba_strategy_flag=None))


def test_external_plan_lists_the_urls_and_launches_nothing(tmp_path: Path) -> None:
    config = _config(engine="external", external_urls=["http://gpu-box:30000/", "https://router.internal"])

    plan = plan_servers(_env(None), config, tmp_path)

    assert plan.mode == "external"
    assert plan.urls == ["http://gpu-box:30000", "https://router.internal"]
    assert [server.port for server in plan.servers] == [30000, 443]
    assert all(server.launch is None for server in plan.servers)


def test_markdown_shows_the_exact_command_of_every_server(tmp_path: Path, base_port: int) -> None:
    plan = plan_servers(_env("h200x2-nvlink"), _config(base_port=base_port), tmp_path)

    markdown = plan.to_markdown()

    for server in plan.servers:
        assert server.launch is not None
        block = server.launch.shell_block()
        assert f"```bash\n{block}\n```" in markdown
        # The block is the same command: the shell joins its continuation lines back into the exact argv.
        joined = shlex.split(block.replace("\\\n", " "))
        env = [f"{key}={value}" for key, value in sorted(server.launch.env.items())]
        assert joined == env + server.launch.argv
        # Short lines: Prefect's UI cuts a code block's long line off.
        assert max(len(line) for line in block.splitlines()) < 120
    assert "CUDA_VISIBLE_DEVICES=1" in markdown
    assert ServerPlan.model_validate_json(plan.model_dump_json()) == plan


def test_wildcard_bind_address_is_reached_through_loopback() -> None:
    assert client_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert client_url("::1", 8000) == "http://[::1]:8000"


# --- model fit, DP vs TP, planned sglang flags ------------------------------------------------------

# Qwen3-27B-like (Qwen3.6-27B class target): ~27B parameters, ~50 GiB in bf16.
QWEN3_27B = {
    "model_type": "qwen3",
    "hidden_size": 5120,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 20480,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 40960,
}
# Llama-70B-like: ~140 GiB in bf16: more than one H200 holds, less than two.
DENSE_70B = {
    "model_type": "llama",
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}
# ~400B dense in bf16: fits neither one H200 nor the pair.
DENSE_400B = {**DENSE_70B, "hidden_size": 16384, "num_hidden_layers": 126, "intermediate_size": 53248}
# A hybrid (gated-delta + full attention) model: 3 of every 4 layers are linear attention.
HYBRID = {
    **QWEN3_27B,
    "model_type": "qwen3_next",
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 16,
}


def _model_dir(tmp_path: Path, config: dict[str, Any]) -> Path:
    directory = tmp_path / "model"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _model_config(model_dir: Path, datasets: list[dict[str, Any]] | None = None, **fleet: Any) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "datasets": datasets or [{"name": "chat", "format": "sharegpt", "path": "/data/chat.jsonl"}],
            "output": "/tmp/out",
            "fleet": fleet,
        }
    )


def test_model_shape_estimates_parameters_from_config_json() -> None:
    assert 26e9 < shape_from_config(QWEN3_27B).params < 28e9
    assert 69e9 < shape_from_config(DENSE_70B).params < 72e9
    hybrid = shape_from_config(HYBRID)
    assert hybrid.hybrid and hybrid.full_attention_layers == 16
    assert not shape_from_config(QWEN3_27B).hybrid


def test_h200_pair_runs_a_27b_model_data_parallel_one_server_per_gpu(tmp_path: Path, base_port: int) -> None:
    config = _model_config(_model_dir(tmp_path, QWEN3_27B), engine="sglang", base_port=base_port)

    plan = plan_servers(_env("h200x2-nvlink"), config, tmp_path, engine=SGLangEngine())

    assert plan.mode == "dp"
    assert plan.tensor_parallel == 1
    assert [server.gpu_ids for server in plan.servers] == [[0], [1]]
    assert plan.model_weights_gib is not None and 45 < plan.model_weights_gib < 55
    launch = plan.servers[1].launch
    assert launch is not None
    assert _flag(launch.argv, "--tp-size") == "1"
    assert launch.env["CUDA_VISIBLE_DEVICES"] == "1"
    assert 0.8 < float(_flag(launch.argv, "--mem-fraction-static")) <= 0.93
    running = int(_flag(launch.argv, "--max-running-requests"))
    assert running > config.fleet.max_inflight_per_server  # a dense 27B on a 141 GB H200 holds many more
    assert plan.servers[1].max_inflight is not None and plan.servers[1].max_inflight > running
    assert "--attention-backend" not in launch.argv
    assert any("fit one GPU" in reason for reason in plan.reasons)


def test_h200_pair_splits_a_model_too_big_for_one_gpu_with_tensor_parallel_2(
    tmp_path: Path, base_port: int
) -> None:
    config = _model_config(_model_dir(tmp_path, DENSE_70B), engine="sglang", base_port=base_port)

    plan = plan_servers(_env("h200x2-nvlink"), config, tmp_path, engine=SGLangEngine())

    assert plan.mode == "tp"
    assert plan.tensor_parallel == 2
    assert [server.gpu_ids for server in plan.servers] == [[0, 1]]
    launch = plan.servers[0].launch
    assert launch is not None
    assert _flag(launch.argv, "--tp-size") == "2"
    assert launch.env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_model_that_fits_no_gpu_group_is_a_plan_error_with_the_numbers(
    tmp_path: Path, base_port: int
) -> None:
    config = _model_config(_model_dir(tmp_path, DENSE_400B), engine="sglang", base_port=base_port)

    with pytest.raises(PlanError, match=r"fit no GPU group.*largest NVLink island has 2 GPU"):
        plan_servers(_env("h200x2-nvlink"), config, tmp_path, engine=SGLangEngine())


def test_pcie_box_runs_data_parallel_on_all_eight_gpus(tmp_path: Path, base_port: int) -> None:
    config = _model_config(_model_dir(tmp_path, QWEN3_27B), engine="sglang", base_port=base_port)

    plan = plan_servers(_env(IDLE_PCIE_SM120), config, tmp_path, engine=SGLangEngine())

    assert plan.mode == "dp"
    assert [server.gpu_ids for server in plan.servers] == [[index] for index in range(8)]


def test_pcie_box_never_plans_tensor_parallel_on_its_own(tmp_path: Path, base_port: int) -> None:
    config = _model_config(_model_dir(tmp_path, DENSE_70B), engine="sglang", base_port=base_port)

    with pytest.raises(PlanError, match="largest NVLink island has 1 GPU"):
        plan_servers(_env("pcie-8gpu"), config, tmp_path, engine=SGLangEngine())


def test_transformers_engine_cannot_split_a_model_too_big_for_one_gpu(tmp_path: Path, base_port: int) -> None:
    config = _model_config(_model_dir(tmp_path, DENSE_70B), base_port=base_port)

    with pytest.raises(PlanError, match="cannot split"):
        plan_servers(_env("h200x2-nvlink"), config, tmp_path)


def test_hybrid_model_gets_fa3_on_sm90_and_flashinfer_on_sm120(tmp_path: Path, base_port: int) -> None:
    config = _model_config(_model_dir(tmp_path, HYBRID), engine="sglang", base_port=base_port)

    hopper = plan_servers(_env("h200x2-nvlink"), config, tmp_path, engine=SGLangEngine())
    blackwell = plan_servers(_env(IDLE_PCIE_SM120), config, tmp_path, engine=SGLangEngine())

    assert all(_flag(_argv(server), "--attention-backend") == "fa3" for server in hopper.servers)
    assert all(_flag(_argv(server), "--attention-backend") == "flashinfer" for server in blackwell.servers)
    assert any("hybrid" in reason for reason in hopper.reasons)


def test_plan_uses_the_flags_the_probed_sglang_accepts(tmp_path: Path, base_port: int) -> None:
    env = probe_from_dir(FIXTURES / "sm120-workstation")
    strategy = {"mamba_cache_strategy": "no_buffer", "disable_radix_cache": False}
    config = _model_config(
        _model_dir(tmp_path, HYBRID), engine="sglang", base_port=base_port, sglang=strategy
    )

    plan = plan_servers(env, config, tmp_path)
    old_env = env.model_copy(
        update={
            "sglang_flags": [flag for flag in env.sglang_flags or [] if "mamba" not in flag]
            + [MAMBA_FLAG_OLD]
        }
    )
    old_plan = plan_servers(old_env, config, tmp_path)

    assert _flag(_argv(plan.servers[0]), "--mamba-radix-cache-strategy") == "no_buffer"
    assert _flag(_argv(old_plan.servers[0]), MAMBA_FLAG_OLD) == "no_buffer"
    unknown = config.model_copy(
        update={"fleet": config.fleet.model_copy(update={"extra_args": ["--no-such-flag"]})}
    )
    with pytest.raises(PlanError, match="does not accept --no-such-flag"):
        plan_servers(env, unknown, tmp_path)


def test_context_length_covers_the_longest_prompt_cap_plus_max_tokens(tmp_path: Path, base_port: int) -> None:
    datasets = [
        {"name": "a", "format": "sharegpt", "path": "/a", "max_prompt_tokens": 1000},
        {"name": "b", "format": "sharegpt", "path": "/b", "max_prompt_tokens": 3000},
    ]
    config = _model_config(_model_dir(tmp_path, QWEN3_27B), datasets, engine="sglang", base_port=base_port)

    plan = plan_servers(_env("h200x2-nvlink"), config, tmp_path, engine=SGLangEngine())

    assert _flag(_argv(plan.servers[0]), "--context-length") == str(
        -(-(3000 + config.sampling.max_tokens) // 256) * 256
    )


def test_jit_fixes_reach_the_servers_environment_only_when_asked(tmp_path: Path, base_port: int) -> None:
    env = probe_from_dir(FIXTURES / "sm120-workstation")
    config = _model_config(_model_dir(tmp_path, QWEN3_27B), engine="sglang", base_port=base_port)

    plain = plan_servers(env, config, tmp_path)
    fixed = plan_servers(
        env,
        config.model_copy(update={"fleet": config.fleet.model_copy(update={"fix_jit_env": True})}),
        tmp_path,
    )

    assert "CPATH" not in (plain.servers[0].launch.env if plain.servers[0].launch else {})
    launch = fixed.servers[0].launch
    assert launch is not None
    assert launch.env["CPATH"].split(":")[0] == "/usr/local/cuda-13.0/include/cccl"
    assert launch.env["LIBRARY_PATH"].split(":")[0] == "/usr/local/cuda-13.0/lib64/stubs"
    assert "CPATH" not in os.environ or os.environ["CPATH"] != launch.env["CPATH"]


def test_cpu_servers_size_their_kv_cache_by_tokens(
    tmp_path: Path, base_port: int, tiny_model_dir: Path
) -> None:
    config = _model_config(
        tiny_model_dir, device="cpu", cpu_servers=2, base_port=base_port, max_inflight_per_server=8
    )
    config.sampling.max_tokens = 64

    plan = plan_servers(_env(None), config, tmp_path)

    argv = _argv(plan.servers[0])
    # 8 requests x (1024 prompt budget + 64 new tokens) = 8704 tokens = 34 blocks of 256.
    assert _flag(argv, "--cb-num-blocks") == "34"
    assert _flag(argv, "--cb-max-batch-tokens") == "512"
    assert "--cb-max-memory-percent" not in argv


def test_router_needs_sglang_router_installed(tmp_path: Path, base_port: int) -> None:
    config = _config(base_port=base_port, router=True)

    if importlib.util.find_spec("sglang_router") is None:
        with pytest.raises(PlanError, match="pip install sglang-router"):
            plan_servers(_env(None), config, tmp_path)
    else:
        plan = plan_servers(_env(None), config, tmp_path)
        assert plan.router is not None and plan.client_urls == [plan.router.url]


def test_router_command_lists_every_worker_and_the_policy() -> None:
    launch = router_launch(
        ["http://127.0.0.1:30000", "http://127.0.0.1:30001"], "127.0.0.1", 30002, "round_robin"
    )

    assert launch.argv[1:] == [
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        "http://127.0.0.1:30000",
        "http://127.0.0.1:30001",
        "--host",
        "127.0.0.1",
        "--port",
        "30002",
        "--policy",
        "round_robin",
    ]


def _argv(server: ServerSpec) -> list[str]:
    assert server.launch is not None
    return server.launch.argv


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_real_qwen36_config_is_a_multimodal_hybrid_with_one_mtp_layer() -> None:
    shape = shape_from_config(json.loads((QWEN36_27B_DIR / "config.json").read_text()))

    assert shape.hybrid and shape.full_attention_layers == 16 and shape.linear_attention_layers == 48
    assert shape.mtp_layers == 1
    assert 26e9 < shape.params < 28.5e9  # text model + vision tower, MTP layer excluded
    assert 50e9 < shape.weight_bytes < 58e9  # the "54 GB of weights" of the seed
    assert shape.kv_bytes_per_token() == 16 * 2 * 4 * 256 * 2  # full-attention layers only
    # 48 layers x (conv (2*16*128 + 48*128) * 3 bf16 + SSM 48*128*128 float32)
    assert shape.recurrent_state_bytes_per_request() == 48 * (10240 * 3 * 2 + 48 * 128 * 128 * 4)


@pytest.mark.parametrize("bundle", SGLANG_BUNDLES)
def test_qwen36_on_eight_sm120_pcie_gpus_plans_eight_flashinfer_servers_above_the_seed(
    tmp_path: Path, base_port: int, bundle: str
) -> None:
    env = probe_from_dir(FIXTURES / bundle)
    config = _model_config(QWEN36_27B_DIR, engine="sglang", base_port=base_port)

    plan = plan_servers(env, config, tmp_path)

    assert plan.mode == "dp" and [server.gpu_ids for server in plan.servers] == [[gpu] for gpu in range(8)]
    for server in plan.servers:
        argv = _argv(server)
        assert _flag(argv, "--attention-backend") == "flashinfer"
        assert "--disable-radix-cache" in argv
        assert not any("mamba" in arg for arg in argv)  # no effect with the radix cache off
        running = int(_flag(argv, "--max-running-requests"))
        assert running >= SEED_RUNNING_REQUESTS
        assert int(_flag(argv, "--cuda-graph-max-bs-decode")) == running
        assert server.max_inflight is not None and server.max_inflight > running
    assert plan.dispatcher_inflight == plan.servers[0].max_inflight
    assert any("recurrent state" in reason for reason in plan.reasons)


def test_mtp_adds_the_family_recipe_and_lowers_concurrency_for_the_draft_states(
    tmp_path: Path, base_port: int
) -> None:
    env = probe_from_dir(FIXTURES / IDLE_PCIE_SM120)
    plain = plan_servers(env, _model_config(QWEN36_27B_DIR, engine="sglang", base_port=base_port), tmp_path)
    mtp = plan_servers(
        env, _model_config(QWEN36_27B_DIR, engine="sglang", base_port=base_port, speculative="mtp"), tmp_path
    )

    argv = _argv(mtp.servers[0])
    assert _flag(argv, "--speculative-algorithm") == "EAGLE"
    assert _flag(argv, "--speculative-num-steps") == "3"
    assert _flag(argv, "--speculative-eagle-topk") == "1"
    assert _flag(argv, "--speculative-num-draft-tokens") == "4"
    assert int(_flag(argv, "--max-running-requests")) < int(
        _flag(_argv(plain.servers[0]), "--max-running-requests")
    )
    assert any("distribution" in reason for reason in mtp.reasons)


def test_mtp_is_refused_for_a_model_without_mtp_layers(tmp_path: Path, base_port: int) -> None:
    config = _model_config(
        _model_dir(tmp_path, QWEN3_27B), engine="sglang", base_port=base_port, speculative="mtp"
    )

    with pytest.raises(PlanError, match="no MTP layers"):
        plan_servers(probe_from_dir(FIXTURES / IDLE_PCIE_SM120), config, tmp_path)


def test_gpu_still_held_by_training_is_a_plan_error_naming_the_memory(tmp_path: Path, base_port: int) -> None:
    config = _model_config(QWEN36_27B_DIR, engine="sglang", base_port=base_port)

    with pytest.raises(PlanError, match="held by other processes"):
        plan_servers(_env("pcie-8gpu"), config, tmp_path, engine=SGLangEngine())


def test_an_explicit_inflight_cap_wins_over_the_derived_one(tmp_path: Path, base_port: int) -> None:
    env = probe_from_dir(FIXTURES / IDLE_PCIE_SM120)
    config = _model_config(QWEN36_27B_DIR, engine="sglang", base_port=base_port, max_inflight_per_server=40)

    plan = plan_servers(env, config, tmp_path)

    assert {server.max_inflight for server in plan.servers} == {40}
    assert int(_flag(_argv(plan.servers[0]), "--max-running-requests")) >= SEED_RUNNING_REQUESTS


def test_a_tune_result_sets_the_inflight_cap_and_the_measured_max_running_requests(
    tmp_path: Path, base_port: int
) -> None:
    from datagen.engines.tune_result import TunePoint, TuneResult

    point = TunePoint(
        inflight_per_server=135,
        setting=120,
        requests=405,
        output_tokens=1,
        wall_s=1.0,
        output_tokens_per_s=1.0,
    )
    result = TuneResult(
        engine="sglang",
        urls=["http://127.0.0.1:30000"],
        max_tokens=256,
        best_inflight_per_server=135,
        best_output_tokens_per_s=2000.0,
        curve=[],
        measured_with="client+/metrics",
        setting_flag="--max-running-requests",
        best_setting=120,
        setting_curve=[point],
    )
    tune_file = tmp_path / "tune.json"
    tune_file.write_text(result.model_dump_json())
    config = _model_config(QWEN36_27B_DIR, engine="sglang", base_port=base_port, tune_result=str(tune_file))

    plan = plan_servers(probe_from_dir(FIXTURES / IDLE_PCIE_SM120), config, tmp_path)

    argv = _argv(plan.servers[0])
    assert _flag(argv, "--max-running-requests") == "120"
    assert _flag(argv, "--cuda-graph-max-bs-decode") == "120"
    assert {server.max_inflight for server in plan.servers} == {135}
    assert any("datagen tune" in reason for reason in plan.reasons)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity masks here")
def test_cpu_servers_share_the_cores_this_process_may_run_on() -> None:
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs two cores to pin this thread to fewer than the machine has")
    os.sched_setaffinity(0, {min(allowed)})
    try:
        fields, reason = cpu_slot_fields(None, request_tokens=1024, configured_inflight=4, servers=1)
    finally:
        os.sched_setaffinity(0, allowed)

    assert fields["cpu_threads"] == 1
    assert "share 1 cores" in reason
