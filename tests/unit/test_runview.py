"""The live view's checklist and bar, fed by what a run announces (datagen.progress), rendered by rich."""

from __future__ import annotations

import io
import logging

from rich.console import Console

from datagen.app.runview import CHECKLIST, RowState, RunView
from datagen.progress import GenerationProgress, Stage, enter_stage, report_progress, watching


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _render(view: RunView) -> str:
    console = Console(file=io.StringIO(), width=120, color_system=None, force_terminal=False)
    console.print(view)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(text, str)
    return text


def _states(view: RunView) -> dict[str, RowState]:
    return {row.label: row.state for row in view.rows}


def test_announced_stages_tick_the_checklist_with_their_times_and_the_bar_shows_generation() -> None:
    clock = Clock()
    view = RunView("run r-1", clock=clock)
    logger = logging.getLogger("test-runview")
    with watching(view):
        for stage in list(Stage)[:8]:  # preflight ... generate
            enter_stage(logger, stage)
            clock.now += 2.0
        report_progress(GenerationProgress(answered=30, total=40, failed=2, output_tokens=600, elapsed_s=3.0))
    states = _states(view)
    assert [states[label] for label, _ in CHECKLIST[:6]] == [RowState.DONE] * 6
    assert states["generate"] is RowState.RUNNING
    assert [states[label] for label, _ in CHECKLIST[7:]] == [RowState.PENDING] * 3
    # The GPU lock's wait and the halt are one row: its time counts both.
    assert "halt training         4.0 s" in _render(view)
    text = _render(view)
    assert "75.0% · 30/40 answered" in text and "200.0 output tok/s · ETA 1 s · 2 failed" in text
    assert text.index("generate") < text.index("30/40 answered") < text.index("stop fleet")


def test_a_run_that_ends_marks_the_rest_skipped_and_a_failed_one_marks_its_stage() -> None:
    done, failed = RunView("done"), RunView("failed")
    # A resumed run with every shard stored: no server started, none stopped.
    for stage in (
        Stage.PREFLIGHT,
        Stage.PREPARE_PROMPTS,
        Stage.MERGE_AND_TOKENIZE,
        Stage.REPORT,
        Stage.MANIFEST,
    ):
        done.stage_entered(stage)
    done.finish(succeeded=True)
    assert {state for label, state in _states(done).items() if label in ("preflight", "report")} == {
        RowState.DONE
    }
    assert _states(done)["start fleet"] is RowState.SKIPPED and _states(done)["generate"] is RowState.SKIPPED

    failed.stage_entered(Stage.PREFLIGHT)
    failed.stage_entered(Stage.GPU_LOCK)
    assert "waiting for this host's GPU lock" in _render(failed)
    failed.finish(succeeded=False)
    assert _states(failed)["halt training"] is RowState.FAILED
    assert _states(failed)["probe"] is RowState.PENDING
    assert "✗ halt training" in _render(failed)


def test_stopping_the_fleet_after_a_failure_leaves_the_failed_stage_marked_not_the_cleanup() -> None:
    interrupted, shards_failed, finished = RunView("a"), RunView("b"), RunView("c")
    for stage in (Stage.PREFLIGHT, Stage.PREPARE_PROMPTS, Stage.HALT_TRAINING, Stage.PROBE, Stage.PLAN):
        for view in (interrupted, shards_failed, finished):
            view.stage_entered(stage)
    # Interrupted while the servers start: their stop runs on the way out.
    interrupted.stage_entered(Stage.START_SERVERS)
    interrupted.stage_entered(Stage.STOP_SERVERS)
    interrupted.finish(succeeded=False)
    states = _states(interrupted)
    assert states["start fleet"] is RowState.FAILED and states["stop fleet"] is RowState.DONE
    assert states["generate"] is RowState.PENDING and states["merge & tokenize"] is RowState.PENDING
    # Generation ended with failed shards: the run fails after the fleet stopped, before the merge.
    for stage in (Stage.START_SERVERS, Stage.GENERATE, Stage.STOP_SERVERS):
        shards_failed.stage_entered(stage)
        finished.stage_entered(stage)
    shards_failed.finish(succeeded=False)
    assert _states(shards_failed)["generate"] is RowState.FAILED
    assert _states(shards_failed)["stop fleet"] is RowState.DONE
    # The next stage settles it.
    finished.stage_entered(Stage.MERGE_AND_TOKENIZE)
    finished.finish(succeeded=False)
    assert _states(finished)["generate"] is RowState.DONE
    assert _states(finished)["merge & tokenize"] is RowState.FAILED


def test_a_stage_still_logs_its_marker_and_a_watcher_that_fails_never_fails_the_run() -> None:
    class Broken:
        def stage_entered(self, stage: Stage) -> None:
            raise RuntimeError("drawing failed")

        def generation_progressed(self, progress: GenerationProgress) -> None:
            raise RuntimeError("drawing failed")

    logger = logging.getLogger("test-runview-marker")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with watching(Broken()):
            enter_stage(logger, Stage.START_SERVERS, servers=2, engine="sglang")
            report_progress(GenerationProgress(answered=0, total=1))
    finally:
        logger.removeHandler(handler)
    assert records == ["stage=start-servers servers=2 engine=sglang"]


def test_the_bar_shows_what_training_pays_so_far_and_the_windows_time_left_when_the_flow_gives_them() -> None:
    view = RunView("run r-1")
    with watching(view):
        enter_stage(logging.getLogger("test-runview"), Stage.GENERATE)
        report_progress(GenerationProgress(answered=1, total=4, elapsed_s=3.0))
    assert "GPU-h" not in _render(view) and "window" not in _render(view)
    with watching(view):
        report_progress(
            GenerationProgress(
                answered=3, total=4, elapsed_s=60.0, gpus=8, training_paused_s=4500.0, window_left_s=7800.0
            )
        )
    text = _render(view)
    assert "paused 1 h 15 min · 10.0 GPU-h · window 2 h 10 min left" in text
    assert "conversations" not in text, "a run without on-policy conversations shows none"
    assert text.index("output tok/s") < text.index("GPU-h")
    with watching(view):
        report_progress(
            GenerationProgress(
                answered=3, total=4, window_left_s=-5.0, window_closing=True, training_paused_s=9.0
            )
        )
    assert "window 0 s left · draining" in _render(view)


def test_a_run_with_on_policy_conversations_counts_their_turns_and_the_conversations_done() -> None:
    view = RunView("on-policy")
    with watching(view):
        report_progress(GenerationProgress(answered=30, total=60, conversations=20, conversations_done=8))
    assert "30/60 answered · 8/20 conversations done" in _render(view)
    progress = GenerationProgress(answered=30, total=60, conversations=20, conversations_done=8)
    assert "30/60 answered · 8/20 conversations done · " in progress.line()
    assert "8/20 conversations done" in progress.card()
