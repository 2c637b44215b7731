from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from datagen.config import RunConfig
from datagen.engines import SGLangEngine
from datagen.engines.sglang import MAMBA_FLAG_OLD
from datagen.errors import PlanError
from datagen.plan import ServerPlan, client_url, plan_servers, port_is_free
from datagen.probe import EnvReport, probe_from_dir

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "probe"
PACKAGES: dict[str, str | None] = {}
# Ports are picked from here up; far from the defaults so a developer's running servers do not interfere.
PORT_SEARCH_START = 41000


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
    return probe_from_dir(FIXTURES / name if name else FIXTURES / "does-not-exist", packages=PACKAGES)


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
    config = _config(base_port=base_port, engine="sglang", sglang={"mamba_cache_strategy": "no_buffer"})

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
    config = _config(base_port=base_port, engine="sglang", sglang={"mamba_cache_strategy": "no_buffer"})

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
        assert server.launch.shell_line() in markdown
    assert "CUDA_VISIBLE_DEVICES=1" in markdown
    assert ServerPlan.model_validate_json(plan.model_dump_json()) == plan


def test_wildcard_bind_address_is_reached_through_loopback() -> None:
    assert client_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert client_url("::1", 8000) == "http://[::1]:8000"
