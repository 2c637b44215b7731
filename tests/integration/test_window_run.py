"""A run with a generation window stops in time, stores what it answered, and its next attempt sends the rest.

Real `datagen run` processes (the CLI's own Prefect API server) against one slow OpenAI-compatible server that
stays up across both attempts. The first attempt's window (seconds) is shorter than the work: admission stops
early enough that the fleet stops and training is handed back before the window ends (the box's history gives
the measured stop and restart times), the shards finished in the window are published as v0001 (the run's merge
round 0; the run is not complete: no manifest), and the run exits 4 naming it and the one command that continues
it. The second attempt, the window taken out of the config (it is no part of the run's identity), sends only what
was left and publishes it as v0002 on top of v0001: every request stored and in one version's own parts, once.
The second attempt is the series' next run (no run id), which continues the open run; the run after it takes new
prompts and builds v0003 on v0002 (the series' last version is the window-ended run's last merge round).

The same series with a stand-in trainer, SIGKILLed (its whole process group) twice near the window's end, the
moments picked from outside by the run's own lines: once admission stops with requests in flight, then, in the
series' next run, once it stops its fleet to hand training back. The series' next run after that finishes it:
the runs after the first kill send exactly what it left unanswered, each once; every request is stored once and
in one version's own parts; training was halted once and restarted once; nothing of the killed runs is left.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

from datagen.app.history import BoxRecord, append_record
from datagen.output.local import TEMP_PREFIX
from tests.support.fault_server import FaultPlan, FaultServer
from tests.support.run_configs import external_run_config, write_prompts
from tests.support.run_states import CliRun, Trainer, describe, processes_mentioning

REPO = Path(__file__).resolve().parents[2]
PROMPTS = 96
IN_FLIGHT = 4
ANSWER_DELAY_S = 0.25
# Shorter than the work (PROMPTS x ANSWER_DELAY_S / IN_FLIGHT = 6 s of answers after the fleet is up).
WINDOW_S = 5.0
CLI_TIMEOUT_S = 300
RUN_ID = "window-1"


def _run(
    config: Path, state: Path, prefect_api: str, run_id: str | None = RUN_ID
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DATAGEN_STATE_DIR": str(state),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    env["PREFECT_API_URL"] = prefect_api
    command = [sys.executable, "-m", "flows.cli_entry", "run", "--config", str(config)]
    command += ["--run-id", run_id] if run_id else []
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False
    )


def _stored(run_root: Path, folder: str) -> list[str]:
    return [
        f"{row['prompt_id']}/{row['sample_index']}"
        for file in sorted((run_root / folder).rglob("*.jsonl"))
        for row in map(json.loads, file.read_text().splitlines())
    ]


def _done_completions(run_root: Path) -> int:
    """Answers of the shards whose done marker is stored (the finished shards)."""
    return sum(
        json.loads(marker.read_text())["completions"] for marker in (run_root / "done").rglob("*.json")
    )


def _own_rows(version: dict[str, Any]) -> list[str]:
    """The requests in a version's own parts (its run's, not its base's), one entry per row."""
    return [
        f"{row['prompt_id']}/{row['sample_index']}"
        for shard in version["shards"]
        if shard["source"] == version["run_id"]
        for row in pq.read_table(shard["url"], columns=["prompt_id", "sample_index"]).to_pylist()
    ]


def _record_fast_hand_back(state: Path, model_dir: Path) -> None:
    """This box stops its fleet and restarts training in a fraction of a second (its history says so)."""
    append_record(
        state,
        BoxRecord(
            kind="run",
            model=str(model_dir),
            engine="external",
            plan="external 1 x tp 1",
            output_tokens_per_s=100.0,
            fleet_stop_s=0.1,
            training_restart_s=0.1,
        ),
    )


def _series_configs(
    tmp_path: Path, server_url: str, model_dir: Path, training: dict[str, Any] | None = None
) -> tuple[Path, Path]:
    """The series' config (no window) and the same with a window of :data:`WINDOW_S`: (plain, windowed)."""
    config = external_run_config(
        tmp_path / "run.yaml",
        server_url=server_url,
        model_dir=model_dir,
        # Twice what one run takes: the series' run after the continuation takes the other half.
        prompts=write_prompts(tmp_path / "prompts.jsonl", 2 * PROMPTS, "Window question"),
        dataset="windowed",
        shard_size=8,
        in_flight=IN_FLIGHT,
        output=str(tmp_path / "out"),
        protected=str(tmp_path / "train"),
        generation={"checkpoint_interval_s": 0.2},
    )
    data = yaml.safe_load(config.read_text())
    data["series"] = "nightly"
    data["datasets"][0]["max_prompts"] = PROMPTS
    if training is not None:
        data["training"] = training
    config.write_text(yaml.safe_dump(data))
    windowed = tmp_path / "windowed.yaml"
    windowed.write_text(yaml.safe_dump({**data, "window": {"max_hours": WINDOW_S / 3600}}))
    return config, windowed


def test_a_window_shorter_than_the_work_ends_in_time_publishes_what_it_finished_and_the_next_attempt_the_rest(
    tmp_path: Path, tiny_model_dir: Path, prefect_api: str
) -> None:
    state = tmp_path / "state"
    _record_fast_hand_back(state, tiny_model_dir)
    with FaultServer(FaultPlan(base_delay_s=ANSWER_DELAY_S)) as server:
        config, windowed = _series_configs(tmp_path, server.url, tiny_model_dir)
        data = yaml.safe_load(config.read_text())

        ended = _run(windowed, state, prefect_api)
        assert ended.returncode == 4, ended.stdout[-3000:] + ended.stderr[-3000:]
        last = ended.stderr.strip().splitlines()[-1]
        assert "the generation window ended with" in last and f"of {PROMPTS} requests" in last, last
        assert last.endswith(f"--run-id {RUN_ID}") or f"--run-id {RUN_ID}" in last, last
        run_root = tmp_path / "out" / "runs" / RUN_ID
        assert not (run_root / "manifest.json").exists(), "a window-ended run is not complete"
        versions = tmp_path / "out" / "datasets" / "drafter-expansion"
        # What the window finished is published: exactly the rows of the shards done in it.
        v1 = json.loads((versions / "v0001.json").read_text())
        finished_rows = _done_completions(run_root)
        assert 0 < finished_rows == v1["rows"] < PROMPTS, (finished_rows, v1["rows"])
        assert f"{finished_rows} rows published as {versions / 'v0001.json'}" in last, last
        assert sorted(path.name for path in versions.glob("v*.json")) == ["v0001.json"]
        (times_file,) = (run_root / "attempts").rglob("serving-times.json")
        times = json.loads(times_file.read_text())
        halted = dt.datetime.fromisoformat(times["halted_at"])
        handed_back = dt.datetime.fromisoformat(times["handed_back_at"])
        assert (handed_back - halted).total_seconds() <= WINDOW_S, times
        first = _stored(run_root, "completions")
        assert len(first) == len(set(first)) < PROMPTS, "the window ended the attempt before the work did"

        sent = len(server.chat_requests())
        data.pop("window", None)
        config.write_text(yaml.safe_dump(data))
        # The series' next run (no run id) continues the window-ended run before it takes new prompts.
        finished = _run(config, state, prefect_api, run_id=None)
        assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
        assert f"continuing run {RUN_ID} of series nightly" in finished.stderr, finished.stderr[-3000:]
        resent = [request.body["messages"][-1]["content"] for request in server.chat_requests()[sent:]]
        # Only what the window left is sent again: the unsent, and at most the requests in flight at the cut.
        assert len(resent) <= PROMPTS - len(first) + IN_FLIGHT, (len(resent), len(first))

        # The run after it takes new prompts only and builds on the continuation's version.
        after = _run(config, state, prefect_api, run_id=None)
        assert after.returncode == 0, after.stdout[-3000:] + after.stderr[-3000:]
        assert "continuing run" not in after.stderr

    answered = _stored(run_root, "completions")
    assert len(answered) == len(set(answered)) == PROMPTS, (
        "every request stored exactly once over both attempts"
    )
    assert not _stored(run_root, "failures")
    assert (run_root / "manifest.json").exists()
    # The rest is the next version, on top of the first: the two versions' own rows are every request, once.
    assert json.loads((versions / "v0001.json").read_text()) == v1, "a published version never changes"
    v2 = json.loads((versions / "v0002.json").read_text())
    assert v2["base_version"] == str(versions / "v0001.json") and v2["rows"] == PROMPTS
    first_rows, rest_rows = _own_rows(v1), _own_rows(v2)
    assert len(first_rows) == finished_rows and not set(first_rows) & set(rest_rows)
    assert sorted(first_rows + rest_rows) == sorted(answered)
    manifest = json.loads((run_root / "manifest.json").read_text())
    assert manifest["dataset_version"] == "datasets/drafter-expansion/v0002.json"
    v3 = json.loads((versions / "v0003.json").read_text())
    assert v3["base_version"] == str(versions / "v0002.json") and v3["rows"] == 2 * PROMPTS
    new_rows = _own_rows(v3)
    assert len(new_rows) == PROMPTS and not {row.split("/")[0] for row in new_rows} & {
        row.split("/")[0] for row in answered
    }


def test_a_window_whose_finished_answers_are_all_dropped_publishes_nothing_and_the_continuation_publishes_them(
    tmp_path: Path, tiny_model_dir: Path, prefect_api: str
) -> None:
    state = tmp_path / "state"
    _record_fast_hand_back(state, tiny_model_dir)
    run_id = "window-dropped"
    with FaultServer(FaultPlan(base_delay_s=ANSWER_DELAY_S)) as server:
        config, windowed = _series_configs(tmp_path, server.url, tiny_model_dir)
        server.cut_off = True  # every answer of the window's attempt hits max_tokens: dropped at the merge

        ended = _run(windowed, state, prefect_api, run_id=run_id)

        assert ended.returncode == 4, ended.stdout[-3000:] + ended.stderr[-3000:]
        run_root = tmp_path / "out" / "runs" / run_id
        finished = _done_completions(run_root)
        assert 0 < finished < PROMPTS, finished
        last = ended.stderr.strip().splitlines()[-1]
        because = (
            f"every one of the {finished} answers of its finished shards was dropped: truncated {finished}"
        )
        assert f"nothing published yet ({because})" in last and f"--run-id {run_id}" in last, last
        assert not (tmp_path / "out" / "datasets").exists(), "a version without a row would read as done"

        sent_cut_off = len(server.chat_requests())
        server.cut_off = False
        finished_run = _run(config, state, prefect_api, run_id=run_id)
        assert finished_run.returncode == 0, finished_run.stdout[-3000:] + finished_run.stderr[-3000:]

    answered = _stored(run_root, "completions")
    assert len(answered) == len(set(answered)) == PROMPTS, (
        "every request stored exactly once over both attempts"
    )
    # The rows are the answers not cut off: the continuation's. The window's attempt's stay stored, dropped at the
    # merge: its finished shards' and those a cut shard had checkpointed (merged with that shard, in the next round).
    records = _rows(sorted((run_root / "completions").rglob("*.jsonl")))
    kept = {
        f"{row['prompt_id']}/{row['sample_index']}" for row in records if row["finish_reason"] != "length"
    }
    assert finished <= len(records) - len(kept) <= sent_cut_off and kept, (len(records), len(kept), finished)
    (version_file,) = (tmp_path / "out" / "datasets" / "drafter-expansion").glob("v*.json")
    version = json.loads(version_file.read_text())
    assert version["base_version"] is None and version["rows"] == len(kept)
    assert sorted(_own_rows(version)) == sorted(kept)
    manifest = json.loads((run_root / "manifest.json").read_text())
    assert manifest["dataset_version"] == "datasets/drafter-expansion/v0001.json"


def _rows(files: list[Path]) -> list[dict[str, Any]]:
    return [row for file in files for row in map(json.loads, file.read_text().splitlines())]


def _final_files(root: Path) -> list[Path]:
    """Every object under ``root`` a reader may take (the store's temporary files have their own prefix)."""
    return [path for path in root.rglob("*") if path.is_file() and not path.name.startswith(TEMP_PREFIX)]


def _answered_prompts(run_root: Path) -> set[str]:
    """The prompts whose answer is stored, finished shards' or checkpoint parts': a resume never sends them."""
    files = [
        path
        for path in _final_files(run_root)
        if path.suffix == ".jsonl" and ("completions" in path.parts or path.name.startswith("completions-"))
    ]
    return {row["prompt_id"] for row in _rows(files)}


def _prompt_ids(run_root: Path) -> dict[str, str]:
    """The run's prompts: the question a request carries -> its prompt id."""
    files = [path for path in _final_files(run_root / "prompts") if path.suffix == ".jsonl"]
    return {row["messages"][-1]["content"]: row["prompt_id"] for row in _rows(files)}


def _sigkill_when(run: CliRun, pattern: str, what: str) -> None:
    """SIGKILL ``run``'s whole process group once a line matches ``pattern`` (from outside, like the OOM killer)."""
    run.wait_for(pattern, CLI_TIMEOUT_S)
    run.send(signal.SIGKILL)
    assert run.wait(30) is not None, f"the run SIGKILLed {what} did not end"


def test_a_series_run_sigkilled_at_its_window_end_and_again_while_handing_back_is_finished_by_the_next_runs_each_answer_once(
    tmp_path: Path, tiny_model_dir: Path, prefect_api: str
) -> None:
    state = tmp_path / "state"
    _record_fast_hand_back(state, tiny_model_dir)
    trainer = Trainer(tmp_path / "trainer")
    env = {
        **os.environ,
        "DATAGEN_STATE_DIR": str(state),
        "DATAGEN_LOCK_DIR": str(tmp_path / "locks"),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
    }
    env["PREFECT_API_URL"] = prefect_api
    transcript = tmp_path / "transcript.txt"
    runs: list[CliRun] = []
    run_root = tmp_path / "out" / "runs" / RUN_ID
    try:
        with FaultServer(FaultPlan(base_delay_s=ANSWER_DELAY_S)) as server:
            config, windowed = _series_configs(
                tmp_path, server.url, tiny_model_dir, trainer.training_config()
            )
            trainer.start()
            # 1. The window's end: admission stops with requests in flight, and the run dies there.
            runs.append(CliRun(windowed, RUN_ID, env, transcript))
            _sigkill_when(runs[-1], r"window closing: admission stopped", "as its window's admission stopped")
            answered_at_kill = _answered_prompts(run_root)
            sent_before = len(server.chat_requests())
            assert len(answered_at_kill) < PROMPTS, "the window ended the run before the work did"
            # 2. The series' next run (no run id, no window this time) continues it and dies again once its
            # generation is over, stopping its servers and handing training back.
            runs.append(CliRun(config, None, env, transcript))
            _sigkill_when(runs[-1], r"stage=stop-servers", "while stopping its fleet")
            # 3. The same command again finishes the run.
            runs.append(CliRun(config, None, env, transcript))
            code = runs[-1].wait(CLI_TIMEOUT_S)
            assert code == 0, runs[-1].tail()
            resent = [
                request.body["messages"][-1]["content"] for request in server.chat_requests()[sent_before:]
            ]
        assert all(f"continuing run {RUN_ID} of series nightly" in run.text for run in runs[1:]), runs[
            -1
        ].tail()

        # The runs after the first sent exactly what it left unanswered, each request once.
        ids = _prompt_ids(run_root)
        assert len(ids) == PROMPTS
        resent_ids = [ids[question] for question in resent]
        assert len(resent_ids) == len(set(resent_ids)), "a request sent twice after the first kill"
        assert set(resent_ids) == set(ids.values()) - answered_at_kill
        # Every request stored exactly once, nothing failed, no object half-written.
        answered = _stored(run_root, "completions")
        assert len(answered) == len(set(answered)) == PROMPTS
        assert not _stored(run_root, "failures")
        for path in _final_files(tmp_path / "out"):
            if path.suffix == ".jsonl":
                _rows([path])  # every line whole
            elif path.suffix == ".json":
                json.loads(path.read_text())
        assert (run_root / "manifest.json").exists()
        # The versions chain, and their own rows are every request once.
        versions = tmp_path / "out" / "datasets" / "drafter-expansion"
        chain = [json.loads(path.read_text()) for path in sorted(versions.glob("v*.json"))]
        assert chain and chain[-1]["rows"] == PROMPTS, [version["rows"] for version in chain]
        assert chain[0]["base_version"] is None, "the series' first run builds on nothing"
        for index, version in enumerate(chain[1:], start=1):
            assert version["base_version"] == str(versions / f"v{index:04d}.json"), version["base_version"]
        own_rows = [row for version in chain for row in _own_rows(version)]
        assert sorted(own_rows) == sorted(answered)
        manifest = json.loads((run_root / "manifest.json").read_text())
        assert manifest["dataset_version"] == f"datasets/drafter-expansion/v{len(chain):04d}.json"

        # The run after the first kill adopted its halt: its pause counts from that run's stop signal, which went
        # out before the training job was gone (what the first attempt recorded).
        halts = [json.loads(path.read_text()) for path in (run_root / "attempts").rglob("training.json")]
        adopted = [halt for halt in halts if halt.get("paused_since_s") is not None]
        first = [halt for halt in halts if halt.get("paused_since_s") is None]
        assert len(adopted) == 1 and len(first) == 1, halts
        # `stopped_at` is recorded to the second, rounded down: the signal came before the next second began.
        stopped_by_s = dt.datetime.fromisoformat(first[0]["stopped_at"]).timestamp() + 1.0
        assert adopted[0]["paused_since_s"] < stopped_by_s, halts
        # Training was halted once and handed back once (by the run killed handing it back, or its resume).
        assert trainer.wait_for(starts=2, timeout_s=30), f"training was not restarted:\n{trainer.summary()}"
        time.sleep(1.0)  # a second restart (a bug) would show up now
        assert sum(trainer.signals().values()) == 1, trainer.summary()
        assert len(trainer.started_pids()) == 2 and trainer.running() == trainer.started_pids()[-1:], (
            trainer.summary()
        )
        # Nothing of the killed runs (their Prefect API servers included) is left running.
        trainers = set(trainer.started_pids())
        left = [pid for run in runs for pid in run.left_running(grace_s=5.0) if pid not in trainers]
        strays = [pid for pid, _ in processes_mentioning(str(tmp_path)) if pid not in trainers]
        assert not left and not strays, describe(left + strays)
    finally:
        for run in runs:
            run.kill()
        trainer.stop()
