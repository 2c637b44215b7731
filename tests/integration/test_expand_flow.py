"""The whole `expand` flow on Prefect's real engine and test harness, with real CPU servers and real files.

Covers what P1 must show: every prompt ends as a completion or a recorded failure, Parquet whose loss mask
covers assistant tokens only, a manifest written last; a rerun regenerates and overwrites nothing; a changed
config under the same run id is refused; a server SIGKILLed mid-run loses no prompt. Through Prefect's API: the
progress artifact mid-run (answered/total, %, tok/s, ETA), the report artifact and the final state message
saying where everything landed.

Both tests check one run of the flow (the module's ``killed_run``): a trainer to halt, four datasets, two CPU
servers, one of them SIGKILLed once generation has started (the other takes over its requests). A second run
would cost two more `transformers serve` starts (~8 s of CPU each) and a flow's preparing and tokenizing; the
kill only makes the run the first test checks a harder one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pyarrow.parquet as pq
import pytest

from datagen.config import RunConfig
from datagen.dataset.report import RunSummary
from datagen.errors import PreflightError
from datagen.samples import sample_path
from tests.support.workers import worker_port

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("prefect_api")

RUN_ID = "flow-test"
# The dataset the kill lands in: 48 requests of up to 64 tokens, so that a server killed once the first part is
# written still has requests in flight and the surviving server has most of the run ahead of it.
KILLED_DATASET = "many"
KILLED_DATASET_PROMPTS = 48
# How long the killer waits for generation to start (a registered fleet and a first part on disk): the run's
# preparation, the trainer's halt and two CPU servers' start come first, minutes on a loaded 2-core machine.
# Only a bound for a run that never generates; the killer acts as soon as both exist.
KILL_DEADLINE_S = 600


@dataclass(frozen=True)
class KilledRun:
    """One finished run of the flow whose first CPU server was SIGKILLed mid-generation.

    Attributes:
        root: The run's folder: ``out/`` (the output root), the trainer's pidfile and checkpoints.
        config: The run's config, for the tests' reruns.
        summary: What the flow returned.
        trainer_returncode: The stand-in trainer's exit status once the run returned (None: it was still
            running and was killed).
        killed_pids: The server pid the killer took down (empty when generation never started in time).
        progress_seen: Every (progress, description) of the progress artifact read through the API while the
            run ran.
    """

    root: Path
    config: RunConfig
    summary: RunSummary
    trainer_returncode: int | None
    killed_pids: list[int]
    progress_seen: list[tuple[float, str]]

    @property
    def out(self) -> Path:
        """The output root."""
        return self.root / "out"

    @property
    def run_root(self) -> Path:
        """The run's folder under the output root."""
        return self.out / "runs" / RUN_ID

    @property
    def checkpoints(self) -> Path:
        """Where the stand-in trainer writes its checkpoint when it is halted."""
        return self.root / "checkpoints"


PROGRESS_KEY = "generation-progress"
# How often the watcher reads the progress artifact through the API while the run runs.
WATCH_INTERVAL_S = 0.5
# The run's end waits a few seconds at most for its last progress update (flows/expand.py): an update still on
# its way then lands after the run returned, sent by the run's publisher thread (named so), which ends with it.
PUBLISHER_THREAD = "progress-artifact"
PUBLISHER_END_TIMEOUT_S = 60.0


def _watch_progress(seen: list[tuple[float, str]], stop: threading.Event) -> None:
    """Read the progress artifact through the Prefect API, as the UI does, until ``stop``, then once more."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterName,
    )

    with get_client(sync_client=True) as client:
        while True:
            stopped = stop.wait(WATCH_INTERVAL_S)
            # This run's artifacts only: other modules' runs on the worker's shared API have the same key.
            artifacts = client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[PROGRESS_KEY])),
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"expand-{RUN_ID}"])),
            )
            for artifact in artifacts:
                entry = (float(cast(float, artifact.data)), artifact.description or "")
                if entry not in seen:
                    seen.append(entry)
            if stopped:
                return


def _kill_one_server_once_generation_started(state_dir: Path, run_root: Path, killed: list[int]) -> None:
    deadline = time.monotonic() + KILL_DEADLINE_S
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


@pytest.fixture(scope="module")
def killed_run(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, prefect_api: str
) -> Iterator[KilledRun]:
    """The module's one run of the flow: a trainer to halt, four datasets, one of two servers SIGKILLed mid-run.

    The state directory stays set while the module's tests run: their reruns use the same host state.
    """
    from datagen.settings import get_settings
    from flows.expand import run_with_config

    root = tmp_path_factory.mktemp("expand-flow")
    state_dir = root / "state"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DATAGEN_STATE_DIR", str(state_dir))
        # Generation here lasts seconds: refresh the progress often enough for the watcher to see it mid-run.
        patch.setenv("DATAGEN_PROGRESS_INTERVAL_S", "0.3")
        get_settings.cache_clear()
        try:
            trainer, pidfile, checkpoints = _start_trainer(root)
            killed: list[int] = []
            progress_seen: list[tuple[float, str]] = []
            try:
                config = _config(root, tiny_model_dir, pidfile, checkpoints)
                killer = threading.Thread(
                    target=_kill_one_server_once_generation_started,
                    args=(state_dir, root / "out" / "runs" / RUN_ID, killed),
                )
                stop_watching = threading.Event()
                watcher = threading.Thread(target=_watch_progress, args=(progress_seen, stop_watching))
                killer.start()
                watcher.start()
                try:
                    summary = run_with_config(config)
                finally:
                    killer.join()
                    # The last update may still be on its way to the API: the watcher's last read comes after it.
                    for thread in threading.enumerate():
                        if thread.name == PUBLISHER_THREAD:
                            thread.join(PUBLISHER_END_TIMEOUT_S)
                    stop_watching.set()
                    watcher.join()
            finally:
                if trainer.poll() is None:
                    os.killpg(trainer.pid, signal.SIGKILL)
            yield KilledRun(root, config, summary, trainer.wait(5), killed, progress_seen)
        finally:
            get_settings.cache_clear()


def _many_prompts(folder: Path) -> Path:
    path = folder / "many.jsonl"
    with path.open("w") as handle:
        for index in range(KILLED_DATASET_PROMPTS):
            handle.write(
                json.dumps({"messages": [{"role": "user", "content": f"Question number {index}: why?"}]})
                + "\n"
            )
    return path


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


def _config(folder: Path, model_dir: Path, pidfile: Path, checkpoints: Path) -> RunConfig:
    data: dict[str, Any] = {
        "run_id": RUN_ID,
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
            {
                "name": KILLED_DATASET,
                "format": "openai_messages",
                "path": str(_many_prompts(folder)),
                "shard_size": 16,
                "sampling": {"max_tokens": 64},
            },
        ],
        "output": str(folder / "out"),
        "protected_prefixes": [str(folder / "existing-train-data")],
        "training": {
            "kind": "pidfile",
            "pidfile": str(pidfile),
            "stop_timeout_s": 30,
            "checkpoint_glob": str(checkpoints / "*.pt"),
        },
        "generation": {"max_attempts": 4, "request_timeout_s": 120, "checkpoint_every": 4},
        "tokenize": {"rows_per_part": 8},
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


def _request_keys(run_root: Path, kind: str, dataset: str | None = None) -> list[str]:
    """``prompt_id/sample_index`` of every ``kind`` record (``completions`` or ``failures``), or one dataset's."""
    folder = run_root / kind if dataset is None else run_root / kind / dataset
    keys = []
    for file in sorted(folder.rglob("*.jsonl")):
        keys += [f"{row['prompt_id']}/{row['sample_index']}" for row in _read_jsonl(file)]
    return keys


def test_flow_generates_every_prompt_tokenizes_with_masks_and_a_rerun_changes_nothing(
    killed_run: KilledRun, tiny_model_dir: Path
) -> None:
    from datagen.dataset.tokenizer import load_tokenizer
    from flows.expand import run_with_config

    summary, out, run_root = killed_run.summary, killed_run.out, killed_run.run_root
    assert killed_run.trainer_returncode == 0, (
        "the flow halts the trainer gracefully (it exits 0 after checkpointing)"
    )
    assert list(killed_run.checkpoints.glob("*.pt")), "the trainer wrote its checkpoint when signalled"

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
    on_disk = {str(p.relative_to(out)) for p in run_root.rglob("*") if p.is_file()}
    assert listed == on_disk - {f"runs/{RUN_ID}/manifest.json"}
    assert (out / "datasets" / "drafter-expansion" / "v0001.json").is_file()
    assert not (killed_run.root / "existing-train-data").exists()

    # A rerun of the complete run: nothing regenerated, nothing rewritten, nothing added.
    before = _snapshot(out)
    trainer2, _, _ = _start_trainer(killed_run.root)
    try:
        again = run_with_config(killed_run.config)
    finally:
        os.killpg(trainer2.pid, signal.SIGTERM)
        trainer2.wait(10)
    assert again.already_complete
    assert _snapshot(out) == before

    # The same run id with another config is refused before anything is stopped.
    trainer3, _, _ = _start_trainer(killed_run.root)
    try:
        with pytest.raises(PreflightError, match="different configuration"):
            run_with_config(killed_run.config.model_copy(update={"seed": 99}))
        assert trainer3.poll() is None, "a refused run must not halt training"
    finally:
        os.killpg(trainer3.pid, signal.SIGTERM)
        trainer3.wait(10)
    assert _snapshot(out) == before


def test_a_server_killed_mid_run_loses_no_prompt(killed_run: KilledRun) -> None:
    run_root = killed_run.run_root
    assert killed_run.killed_pids, "the test must actually kill a server mid-run"
    completed = _request_keys(run_root, "completions", KILLED_DATASET)
    failed = _request_keys(run_root, "failures", KILLED_DATASET)
    assert len(completed) + len(failed) == KILLED_DATASET_PROMPTS == len(set(completed + failed))
    assert killed_run.summary.completions == len(_request_keys(run_root, "completions"))
    assert not _request_keys(run_root, "failures"), "a killed server's requests are re-dispatched, not failed"


# The progress artifact's card mid-run, one short line per paragraph, the essentials first:
# `**62.5%** · 200/320 answered`, `604.1 output tok/s · ETA 3 min 5 s`, `0 failed · 40 s elapsed`, what the
# halted training has cost so far (`paused 1 min 2 s · 0.0 GPU-h`: this run halts a trainer), the queues.
PROGRESS_CARD = re.compile(
    r"^\*\*(?P<percent>\d+\.\d)%\*\* · (?P<answered>\d+)/(?P<total>\d+) answered\n\n"
    r"\d+\.\d output tok/s · ETA (\d+ (s|min|h)|unknown)( \d+ (s|min))?\n\n"
    r"\d+ failed · [\d a-z]+ elapsed\n\n"
    r"paused [\d a-z]+ · \d+\.\d GPU-h\n\n"
    r"\d+ in flight · \d+ queued · \d+ retries$"
)
# What the card shows per line: the Artifacts tab's grid at 1600 px cuts a longer line off.
CARD_LINE_CHARS = 40


def test_progress_is_readable_through_the_api_while_generating(killed_run: KilledRun) -> None:
    mid_run = [
        (value, description, match)
        for value, description in killed_run.progress_seen
        if 0 < value < 100 and (match := PROGRESS_CARD.match(description))
    ]
    assert mid_run, f"no mid-run progress read through the API: {killed_run.progress_seen}"
    for value, description, match in mid_run:
        assert int(match["answered"]) < int(match["total"]) == killed_run.summary.requests
        assert float(match["percent"]) == round(value, 1)
        assert max(len(line) for line in description.replace("**", "").split("\n\n")) <= CARD_LINE_CHARS
    final = killed_run.progress_seen[-1]
    assert final[0] == 100.0 and final[1].startswith(f"**100.0%** · {killed_run.summary.requests}/"), final


def test_the_report_artifact_and_final_state_say_where_everything_landed(killed_run: KilledRun) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterName,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    summary = killed_run.summary
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"expand-{RUN_ID}"])),
            sort=FlowRunSort.START_TIME_ASC,
            limit=1,
        )[0]
        report = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["datagen-report"])),
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])),
        )[0]
    version = summary.dataset_version_url
    assert version and version.endswith("v0001.json")
    markdown = str(report.data)
    for line in (
        f"- run folder: `{summary.run_url}`",
        f"- report: `{summary.report_url}`",
        f"- manifest: `{summary.manifest_url}`",
        f"- dataset version: `{version}`",
        f"- export: `datagen export {version}`",
    ):
        assert line in markdown, markdown
    assert f"throughput: **{summary.output_tokens_per_s:.1f} output tok/s**" in markdown
    assert flow_run.state is not None and flow_run.state.is_completed()
    assert flow_run.state.message == summary.state_message()
    for where in (summary.run_url, summary.report_url, summary.manifest_url, f"datagen export {version}"):
        assert where in flow_run.state.message
