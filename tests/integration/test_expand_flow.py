"""The whole `expand` flow on Prefect's real engine and test harness, with real CPU servers and real files.

Covers what P1 must show: every prompt ends as a completion or a recorded failure, Parquet whose loss mask
covers assistant tokens only, a manifest written last; a rerun regenerates and overwrites nothing; a changed
config under the same run id is refused; a server SIGKILLed mid-run loses no prompt.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from datagen.config import RunConfig
from datagen.errors import PreflightError
from datagen.samples import sample_path
from tests.support.workers import worker_port

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("prefect_api")


@pytest.fixture()
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    from datagen.settings import get_settings

    path = tmp_path / "state"
    monkeypatch.setenv("DATAGEN_STATE_DIR", str(path))
    get_settings.cache_clear()
    yield path
    get_settings.cache_clear()


def _start_trainer(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path, Path]:
    pidfile, checkpoints = tmp_path / "trainer.pid", tmp_path / "checkpoints"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "datagen.host.standin_trainer",
            "--pidfile",
            str(pidfile),
            "--checkpoint-dir",
            str(checkpoints),
        ],
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while not pidfile.exists():
        assert process.poll() is None and time.monotonic() < deadline, "stand-in trainer did not start"
        time.sleep(0.05)
    return process, pidfile, checkpoints


def _config(tmp_path: Path, model_dir: Path, pidfile: Path, checkpoints: Path, **changes: Any) -> RunConfig:
    data: dict[str, Any] = {
        "run_id": "flow-test",
        "model": {"path": str(model_dir)},
        "fleet": {
            "engine": "transformers",
            "cpu_servers": 2,
            "base_port": worker_port(31400),
            "max_inflight_per_server": 4,
        },
        "sampling": {"temperature": 0.8, "max_tokens": 24},
        "datasets": [
            {
                "name": "metamath",
                "format": "metamath",
                "path": sample_path("metamath"),
                "sampling": {"samples_per_prompt": 2, "enable_thinking": False},
            },
            {"name": "hermes-fc", "format": "hermes_fc", "path": sample_path("hermes_fc"), "shard_size": 2},
            {"name": "code-feedback", "format": "code_feedback", "path": sample_path("code_feedback")},
        ],
        "output": str(tmp_path / "out"),
        "protected_prefixes": [str(tmp_path / "existing-train-data")],
        "training": {
            "kind": "pidfile",
            "pidfile": str(pidfile),
            "stop_timeout_s": 30,
            "checkpoint_glob": str(checkpoints / "*.pt"),
        },
        "generation": {"max_attempts": 4, "request_timeout_s": 120, "checkpoint_every": 4},
        "tokenize": {"rows_per_part": 8},
        **changes,
    }
    return RunConfig.model_validate(data)


def _snapshot(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _request_keys(run_root: Path, kind: str) -> list[str]:
    keys = []
    for file in sorted((run_root / kind).rglob("*.jsonl")):
        keys += [f"{row['prompt_id']}/{row['sample_index']}" for row in _read_jsonl(file)]
    return keys


def test_flow_generates_every_prompt_tokenizes_with_masks_and_a_rerun_changes_nothing(
    tmp_path: Path, tiny_model_dir: Path, state_dir: Path
) -> None:
    from datagen.dataset.tokenizer import load_tokenizer
    from flows.expand import expand

    trainer, pidfile, checkpoints = _start_trainer(tmp_path)
    try:
        config = _config(tmp_path, tiny_model_dir, pidfile, checkpoints)
        summary = expand(config=config)
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
    assert trainer.wait(5) == 0, "the flow halts the trainer gracefully (it exits 0 after checkpointing)"
    assert list(checkpoints.glob("*.pt")), "the trainer wrote its checkpoint when signalled"

    run_root = tmp_path / "out" / "runs" / "flow-test"
    prompts = []
    for file in sorted((run_root / "prompts").rglob("shard-*.jsonl")):
        prompts += _read_jsonl(file)
    samples = {"metamath": 2}
    expected = sorted(f"{p['prompt_id']}/{i}" for p in prompts for i in range(samples.get(p["dataset"], 1)))
    completed, failed = _request_keys(run_root, "completions"), _request_keys(run_root, "failures")
    assert sorted(completed + failed) == expected, "every request ends exactly once as completion or failure"
    assert summary.requests == len(expected) and summary.completions == len(completed)

    training = next((run_root / "attempts").rglob("training.json"))
    halt = json.loads(training.read_text())
    assert halt["stopped"] and halt["last_checkpoint"]

    tokenizer = load_tokenizer(str(tiny_model_dir))
    by_key = {
        f"{row['prompt_id']}/{row['sample_index']}": row
        for file in (run_root / "completions").rglob("*.jsonl")
        for row in _read_jsonl(file)
    }
    rows = 0
    for part in sorted((run_root / "tokenized").glob("part-*.parquet")):
        for row in pq.read_table(part).to_pylist():
            rows += 1
            masked = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
            completion = by_key[f"{row['prompt_id']}/{row['sample_index']}"]["completion"]
            decoded = tokenizer.decode(masked)
            assert decoded.endswith("<|im_end|>")
            assert (completion["content"] or "").strip() in decoded
            unmasked = tokenizer.decode(
                [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if not m]
            )
            assert "<|im_start|>user" in unmasked and "<|im_start|>user" not in decoded
    assert rows == summary.tokenized_rows > 0

    manifest = json.loads((run_root / "manifest.json").read_text())
    listed = {entry["key"] for entry in manifest["objects"]}
    on_disk = {str(p.relative_to(tmp_path / "out")) for p in run_root.rglob("*") if p.is_file()}
    assert listed == on_disk - {"runs/flow-test/manifest.json"}
    assert (tmp_path / "out" / "datasets" / "drafter-expansion" / "v0001.json").is_file()
    assert not (tmp_path / "existing-train-data").exists()

    # A rerun of the complete run: nothing regenerated, nothing rewritten, nothing added.
    before = _snapshot(tmp_path / "out")
    trainer2, _, _ = _start_trainer(tmp_path)
    try:
        again = expand(config=config)
    finally:
        os.killpg(trainer2.pid, signal.SIGTERM)
        trainer2.wait(10)
    assert again.already_complete
    assert _snapshot(tmp_path / "out") == before

    # The same run id with another config is refused before anything is stopped.
    trainer3, _, _ = _start_trainer(tmp_path)
    try:
        with pytest.raises(PreflightError, match="different configuration"):
            expand(config=config.model_copy(update={"seed": 99}))
        assert trainer3.poll() is None, "a refused run must not halt training"
    finally:
        os.killpg(trainer3.pid, signal.SIGTERM)
        trainer3.wait(10)
    assert _snapshot(tmp_path / "out") == before


def _kill_one_server_once_generation_started(state_dir: Path, run_root: Path, killed: list[int]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        registries = list(state_dir.rglob("servers.json"))
        parts = (
            list((run_root / "parts").rglob("completions-*.jsonl")) if (run_root / "parts").exists() else []
        )
        if registries and parts:
            registry = json.loads(registries[0].read_text())
            victim = registry["servers"][0]
            os.killpg(victim["pgid"], signal.SIGKILL)
            killed.append(victim["pid"])
            return
        time.sleep(0.05)


def test_a_server_killed_mid_run_loses_no_prompt(
    tmp_path: Path, tiny_model_dir: Path, state_dir: Path
) -> None:
    from flows.expand import expand

    many = tmp_path / "many.jsonl"
    with many.open("w") as handle:
        for index in range(48):
            handle.write(
                json.dumps({"messages": [{"role": "user", "content": f"Question number {index}: why?"}]})
                + "\n"
            )
    config = _config(
        tmp_path,
        tiny_model_dir,
        tmp_path / "no-trainer.pid",
        tmp_path / "ckpt",
        run_id="kill-test",
        training={"kind": "none"},
        sampling={"temperature": 0.8, "max_tokens": 64},
        datasets=[{"name": "many", "format": "openai_messages", "path": str(many), "shard_size": 16}],
        fleet={
            "engine": "transformers",
            "cpu_servers": 2,
            "base_port": worker_port(31500),
            "max_inflight_per_server": 2,
        },
    )
    run_root = tmp_path / "out" / "runs" / "kill-test"
    killed: list[int] = []
    killer = threading.Thread(
        target=_kill_one_server_once_generation_started, args=(state_dir, run_root, killed)
    )
    killer.start()
    summary = expand(config=config)
    killer.join()
    assert killed, "the test must actually kill a server mid-run"
    completed, failed = _request_keys(run_root, "completions"), _request_keys(run_root, "failures")
    assert len(completed) + len(failed) == 48 == len(set(completed + failed))
    assert summary.completions == len(completed)
    assert not failed, "a killed server's requests are re-dispatched, not failed"
