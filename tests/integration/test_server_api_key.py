"""DATAGEN_SERVER_API_KEY end to end: launched servers require it, requests carry it, nothing shows it.

The fleet launches, as an ``sglang`` plan's servers, a stand-in that reads its key the way SGLang does
(``--config FILE`` with ``api-key``, tests/support/keyed_server.py) and logs it at start, as SGLang does; the
real SGLang parsers read the same files in tests/integration/test_sglang_contract.py.
"""

from __future__ import annotations

import json
import secrets
import stat
import sys
from pathlib import Path

import pytest

from datagen.config import GenerationConfig
from datagen.errors import ServerStartError
from datagen.generation.dispatcher import Dispatcher
from datagen.host.fleet import Fleet
from datagen.host.plan import ServerPlan
from datagen.records import CompletionRecord, FailureRecord
from tests.support.plans import local_plan
from tests.support.prefect_stack import free_port
from tests.unit.test_dispatch import make_request

REPO = Path(__file__).resolve().parents[2]
GENERATION = GenerationConfig(
    max_attempts=2, backoff_initial_s=0.01, backoff_max_s=0.05, request_timeout_s=10
)


def _plan(tmp_path: Path, *extra: str) -> ServerPlan:
    def argv(port: int) -> list[str]:
        return [sys.executable, "-m", "tests.support.keyed_server", "--port", str(port), *extra]

    ports = [free_port(), free_port()]
    return local_plan(tmp_path, ports, argv, engine="sglang", mode="dp", env={"PYTHONPATH": str(REPO)})


def _answers(urls: list[str], api_key: str | None) -> list[object]:
    with Dispatcher(
        urls,
        model="target",
        engine="sglang",
        max_inflight_per_server=2,
        generation=GENERATION,
        api_key=api_key,
    ) as dispatcher:
        futures = [dispatcher.submit(make_request(f"question {index}")) for index in range(6)]
        return [future.result(60) for future in futures]


def test_launched_servers_require_the_key_which_stays_off_their_command_lines_and_out_of_quoted_logs(
    tmp_path: Path,
) -> None:
    key = f"dg-{secrets.token_hex(16)}"
    plan = _plan(tmp_path)
    with Fleet(plan, tmp_path / "state", ready_timeout_s=60, api_key=key) as fleet:
        keyed = _answers(fleet.urls, key)
        unkeyed = _answers(fleet.urls, None)
        key_files = sorted((tmp_path / "state" / "secrets").iterdir())
        modes = [stat.S_IMODE(path.stat().st_mode) for path in key_files]
        # The registry the orphan cleanup matches command lines against records the argv as launched.
        records = json.loads(fleet.pidfile_path.read_text())["servers"]
        command_lines = [
            Path(f"/proc/{record['pid']}/cmdline").read_bytes().split(b"\0") for record in records
        ]
        recorded = [record["cmd"] for record in records]
    assert all(isinstance(record, CompletionRecord) for record in keyed)
    assert all(isinstance(record, FailureRecord) and record.last_status == 401 for record in unkeyed)
    assert len(key_files) == 2 and modes == [0o600, 0o600]
    assert len(command_lines) == 2
    for line, cmd in zip(command_lines, recorded, strict=True):
        assert [part.decode() for part in line if part] == cmd and "--config" in cmd
        assert not any(key in part for part in cmd)
    assert key not in plan.model_dump_json() and key not in plan.to_markdown()
    assert not list((tmp_path / "state" / "secrets").iterdir()), "key files are removed when the fleet stops"
    # The servers logged the key, as SGLang does; the log on disk is the operator's own file.
    assert any(key in path.read_text() for path in (tmp_path / "logs").iterdir())


def test_a_server_that_dies_at_start_is_quoted_with_its_key_redacted(tmp_path: Path) -> None:
    key = f"dg-{secrets.token_hex(16)}"
    with (
        pytest.raises(ServerStartError) as raised,
        Fleet(_plan(tmp_path, "--crash"), tmp_path / "state", ready_timeout_s=60, api_key=key),
    ):
        pass
    message = str(raised.value)
    assert "api_key='***'" in message and key not in message
