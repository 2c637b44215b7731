"""What `datagen run` shows a person at a terminal, and what it prints into a pipe.

Real CLI processes (each with its own temporary Prefect API server, as on a fresh host) against an
OpenAI-compatible test server, read through a real pseudo-terminal and replayed as a terminal's screen
(:mod:`tests.support.screen`). On a terminal: the live view (the stages as a checklist, generation's bar), no
Prefect log line, the usual outcome after it. Into a pipe: the log lines as ever, no escape sequence.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from datagen.records import AssistantCompletion, CompletionRecord, Message, SamplingParams, TokenUsage
from tests.support.fault_server import FaultServer
from tests.support.run_configs import external_run_config, write_prompts
from tests.support.screen import PtyRun

REPO = Path(__file__).resolve().parents[2]
PROMPTS = 12
CLI_TIMEOUT_S = 300
# Long enough for a loaded 2-core box to start Prefect's API server and reach generation.
# Wide enough that no outcome line wraps (temporary paths under pytest-xdist are long): the screen's lines are
# the lines printed.
SCREEN_TIMEOUT_S = 240
COLUMNS = 400
CHECKLIST = (
    "preflight",
    "prepare prompts",
    "halt training",
    "probe",
    "plan",
    "start fleet",
    "generate",
    "stop fleet",
    "merge & tokenize",
    "report",
)
PREFECT_LINE = re.compile(r"\| (INFO|DEBUG|WARNING) +\|")


def _config(tmp_path: Path, url: str, model_dir: Path) -> Path:
    return external_run_config(
        tmp_path / "run.yaml",
        server_url=url,
        model_dir=model_dir,
        prompts=write_prompts(tmp_path / "prompts.jsonl", PROMPTS, "Terminal question"),
        dataset="terminal",
        shard_size=6,
        in_flight=4,
        output=str(tmp_path / "out"),
        protected=str(tmp_path / "train"),
        generation={"checkpoint_interval_s": 0.2},
    )


def _env(tmp_path: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "DATAGEN_STATE_DIR": str(tmp_path / "state"),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    for name in ("PREFECT_API_URL", "FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE"):
        env.pop(name, None)
    return env


def _command(config: Path, run_id: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli_entry", "run", "--config", str(config), "--run-id", run_id]


def _row(screen: str, label: str) -> str:
    """The checklist's row of ``label`` (its mark first)."""
    rows = [line for line in screen.splitlines() if re.fullmatch(rf"\S {re.escape(label)}(\s.*)?", line)]
    assert len(rows) == 1, f"no single row for {label!r}:\n{screen}"
    return rows[0]


def _shape(lines: list[str], run_id: str) -> list[str]:
    """Lines with the run id, digests and figures replaced (runs of one config differ only there)."""
    return [
        re.sub(r"\d+(\.\d+)?", "N", re.sub(r"\b[0-9a-f]{16,}\b", "HASH", line.replace(run_id, "RUN")))
        for line in lines
    ]


def test_a_run_on_a_terminal_shows_its_stages_and_bar_and_into_a_pipe_its_log_lines(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    with FaultServer() as server:
        config = _config(tmp_path, server.url, tiny_model_dir)
        # Held mid-generation: the screen is caught while the run is in it.
        server.answering.clear()
        run = PtyRun(_command(config, "tty-1"), _env(tmp_path), rows=40, columns=COLUMNS, cwd=str(REPO))
        try:
            middle = run.screen_when(lambda text: "answered" in text and "generate" in text, SCREEN_TIMEOUT_S)
        finally:
            server.answering.set()
        code, screen = run.wait(CLI_TIMEOUT_S)

        piped = subprocess.run(
            _command(config, "pipe-1"),
            env=_env(tmp_path),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
            check=False,
        )

    assert code == 0, screen
    # Mid-run: what is done is ticked, generation runs with its bar, what comes after waits.
    for label in CHECKLIST[:6]:
        assert _row(middle, label).startswith("✓"), middle
    assert not _row(middle, "generate").startswith(("✓", "·")), middle
    assert re.search(rf"━*─+ [\d.]+% · \d+/{PROMPTS} answered\n +[\d.]+ output tok/s · ETA \S+", middle), (
        middle
    )
    for label in CHECKLIST[7:]:
        assert _row(middle, label).startswith("·"), middle

    # At the end: every stage ticked, the bar full, no log line of Prefect's, the usual outcome last.
    for label in CHECKLIST:
        assert _row(screen, label).startswith("✓"), screen
    assert f"{'━' * 30} 100.0% · {PROMPTS}/{PROMPTS} answered" in screen, screen
    assert "ETA done · 0 failed" in screen, screen
    assert not PREFECT_LINE.search(screen) and "stage=" not in screen and "Finished in state" not in screen, (
        screen
    )
    assert "Traceback" not in screen
    view_end = screen.index("✓ report")
    outcome = screen[view_end:].splitlines()[1:]
    assert outcome[0] == "run tty-1: done", screen
    assert outcome[-1].startswith("  to train on it:") or outcome[-1].startswith("    "), screen

    # Into a pipe: today's lines, the same outcome, no escape sequence.
    assert piped.returncode == 0, piped.stderr
    assert "\x1b" not in piped.stdout + piped.stderr
    assert "stage=preflight" in piped.stderr and "stage=generate" in piped.stderr, piped.stderr
    assert re.search(rf"progress 100\.0% · {PROMPTS}/{PROMPTS} answered", piped.stderr), piped.stderr
    assert "✓" not in piped.stdout + piped.stderr
    # The same lines, the figures aside (throughput, the dataset version's number).
    assert _shape(piped.stdout.strip().splitlines(), "pipe-1") == _shape(outcome, "tty-1"), piped.stdout


def test_a_refused_run_on_a_terminal_marks_its_stage_failed_and_ends_with_the_refusal(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    # Nothing serves there: preflight refuses before anything is halted or started.
    config = _config(tmp_path, "http://127.0.0.1:9", tiny_model_dir)
    run = PtyRun(_command(config, "tty-refused"), _env(tmp_path), rows=40, columns=COLUMNS, cwd=str(REPO))
    code, screen = run.wait(CLI_TIMEOUT_S)

    assert code == 2, screen
    lines = screen.splitlines()
    assert lines[-1].startswith("datagen: Preflight refused the run") and "127.0.0.1:9" in lines[-1], screen
    assert sum("Preflight refused" in line for line in lines) == 1, screen
    assert _row(screen, "preflight").startswith("✗"), screen
    assert all(_row(screen, label).startswith("·") for label in CHECKLIST[1:]), screen
    assert not PREFECT_LINE.search(screen) and "Traceback" not in screen, screen


def _completion_line(index: int) -> str:
    record = CompletionRecord(
        prompt_id=f"chat-{index:03d}",
        dataset="chat",
        messages=[Message(role="user", content=f"Question {index}?")],
        completion=AssistantCompletion(content=f"Answer {index}."),
        finish_reason="stop",
        usage=TokenUsage(prompt_tokens=10, completion_tokens=5),
        model="tiny",
        engine="transformers",
        server="http://127.0.0.1:1",
        sampling=SamplingParams(enable_thinking=False),
        latency_s=0.1,
    )
    return record.model_dump_json() + "\n"


def test_corpus_adopt_on_a_terminal_shows_a_bar_per_step_and_into_a_pipe_only_its_lines(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    corpus = tmp_path / "corpus"
    for name in ("a", "b"):
        (corpus / name).mkdir(parents=True)
        (corpus / name / "completions-00000.jsonl").write_text("".join(_completion_line(i) for i in range(3)))

    def adopt(output: str) -> list[str]:
        return [
            sys.executable, "-m", "flows.cli_entry", "corpus", "adopt", str(corpus), "--output",
            str(tmp_path / output), "--tokenizer", str(tiny_model_dir), "--workers", "1", "--jsonl",
        ]  # fmt: skip

    code, screen = PtyRun(adopt("tty"), _env(tmp_path), rows=40, columns=COLUMNS, cwd=str(REPO)).wait(
        CLI_TIMEOUT_S
    )
    piped = subprocess.run(
        adopt("pipe"),
        env=_env(tmp_path),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )

    assert code == 0, screen
    # Each step's bar, finished: the objects read, the files tokenized, the parts exported.
    assert re.search(r"read the corpus +━+ 2/2 objects", screen), screen
    assert re.search(r"tokenize +━+ 2/2 files .* 6 rows", screen), screen
    assert re.search(r"export +━+ 1/1 parts .* 6 rows", screen), screen
    # The bars stay where their work was; the command's lines are the same as into a pipe.
    lines = [line for line in screen.splitlines() if "━" not in line]
    first_line = next(index for index, line in enumerate(lines) if line.startswith("adopted "))
    assert piped.returncode == 0, piped.stderr
    assert "\x1b" not in piped.stdout + piped.stderr and "━" not in piped.stdout + piped.stderr
    assert piped.stdout.splitlines()[0].startswith("adopted "), piped.stdout
    assert _shape(piped.stdout.splitlines(), "pipe") == _shape(lines[first_line:], "tty"), piped.stdout
