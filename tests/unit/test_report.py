"""The run report: throughput over every attempt (one definition, the progress artifact's too), where it landed."""

from __future__ import annotations

from pathlib import Path

from datagen.config import RunConfig
from datagen.dataset.report import (
    GenerationWindow,
    build_report,
    generation_time_over_attempts,
    record_generation_window,
    run_locations,
)
from datagen.output.layout import RunLayout
from datagen.output.store import Store
from datagen.progress import GenerationProgress, output_tokens_per_s
from datagen.records import ShardSummary


def _config(tmp_path: Path) -> RunConfig:
    return RunConfig.model_validate(
        {
            "run_id": "r-1",
            "model": {"path": "m"},
            "datasets": [{"name": "d", "format": "metamath", "path": "x.json"}],
            "output": str(tmp_path),
        }
    )


def _shard(index: int, tokens: int) -> ShardSummary:
    return ShardSummary(
        dataset="d",
        shard_index=index,
        requests=10,
        completions=10,
        failures=0,
        prompt_tokens=0,
        completion_tokens=tokens,
        generation_s=1.0,
        completions_path="c",
        failures_path="f",
    )


def test_a_resumed_run_reports_throughput_over_every_attempt(tmp_path: Path) -> None:
    store, layout = Store(str(tmp_path)), RunLayout("r-1")
    # The first attempt was interrupted after 30 s, the second finished in 10 s (and its rerun adds nothing).
    record_generation_window(store, layout, GenerationWindow(attempt_id="a1", wall_s=30.0, interrupted=True))
    record_generation_window(store, layout, GenerationWindow(attempt_id="a2", wall_s=10.0))
    record_generation_window(store, layout, GenerationWindow(attempt_id="a2", wall_s=99.0))
    wall_s, attempts = generation_time_over_attempts(store, layout)
    assert (wall_s, attempts) == (40.0, 2)
    report = build_report(
        run_id="r-1",
        config=_config(tmp_path),
        prepared=[],
        shards=[_shard(0, 3000), _shard(1, 1000)],
        tokenize_summary=None,
        servers=2,
        generation_wall_s=wall_s,
        generation_attempts=attempts,
        dataset_mix=[],
        mix_by_category=[],
    )
    assert report.output_tokens_per_s == 100.0
    assert "40.0 s** over 2 attempt(s)" in report.to_markdown()


def test_a_run_without_generation_records_sums_to_zero(tmp_path: Path) -> None:
    assert generation_time_over_attempts(Store(str(tmp_path)), RunLayout("r-1")) == (0.0, 0)


def test_the_progress_artifact_and_the_report_give_one_throughput_for_the_same_numbers(
    tmp_path: Path,
) -> None:
    from datagen.generation.dispatch_state import DispatcherStats
    from tasks.progress import progress_card

    # 4000 output tokens over 40 s of generation. The dispatcher was busy for 25 s of them: its own rate
    # (160 tok/s) is the fleet's, not the run's; the artifact shows the report's figure.
    report = build_report(
        run_id="r-1",
        config=_config(tmp_path),
        prepared=[],
        shards=[_shard(0, 3000), _shard(1, 1000)],
        tokenize_summary=None,
        servers=2,
        generation_wall_s=40.0,
        dataset_mix=[],
        mix_by_category=[],
    )
    stats = DispatcherStats(
        servers=[],
        queued=0,
        backing_off=0,
        completed=20,
        failed=0,
        retries=0,
        output_tokens=4000,
        tokens_per_s=160.0,
    )
    progress, description = progress_card(20, 20, stats, 40.0)
    assert report.output_tokens_per_s == progress.tokens_per_s == output_tokens_per_s(4000, 40.0) == 100.0
    assert "100.0 output tok/s" in description
    assert "100.0 output tok/s" in report.to_markdown()


def test_the_progress_line_says_answered_share_throughput_and_eta() -> None:
    progress = GenerationProgress(answered=80, total=320, failed=2, output_tokens=12_000, elapsed_s=60.0)
    # 80 answered in 60 s: 240 left take 180 s more.
    assert progress.line() == (
        "25.0% · 80/320 answered · 200.0 output tok/s · ETA 3 min 0 s · 2 failed · 1 min 0 s elapsed"
    )
    assert GenerationProgress(answered=0, total=10).line().startswith("0.0% · 0/10 answered · 0.0 output")
    assert "ETA unknown" in GenerationProgress(answered=0, total=10, elapsed_s=5.0).line()
    assert "ETA done" in GenerationProgress(answered=10, total=10, elapsed_s=5.0).line()


def test_a_resumed_runs_eta_counts_only_what_this_attempt_answered() -> None:
    # 200 answers were stored by an earlier attempt; this one answered 40 in 60 s: 80 left take 120 s.
    resumed = GenerationProgress(answered=240, total=320, elapsed_s=60.0, answered_here=40)
    assert resumed.eta_s == 120.0
    assert "ETA 2 min 0 s" in resumed.line()
    assert GenerationProgress(answered=200, total=320, elapsed_s=5.0, answered_here=0).eta_text == "unknown"


def test_the_progress_card_puts_the_essentials_first_in_short_lines() -> None:
    progress = GenerationProgress(answered=80, total=320, failed=2, output_tokens=12_000, elapsed_s=60.0)
    assert progress.card("4 in flight · 0 queued · 1 retries").split("\n\n") == [
        "**25.0%** · 80/320 answered",
        "200.0 output tok/s · ETA 3 min 0 s",
        "2 failed · 1 min 0 s elapsed",
        "4 in flight · 0 queued · 1 retries",
    ]
    assert GenerationProgress(answered=0, total=10).card() == (
        "**0.0%** · 0/10 answered\n\n0.0 output tok/s · ETA unknown\n\n0 failed · 0 s elapsed"
    )


def test_the_report_says_where_everything_landed(tmp_path: Path) -> None:
    store, layout = Store(str(tmp_path)), RunLayout("r-1")
    version = store.url("datasets/drafter-expansion/v0001.json")
    report = build_report(
        run_id="r-1",
        config=_config(tmp_path),
        prepared=[],
        shards=[_shard(0, 100)],
        tokenize_summary={
            "dataset_version": "datasets/drafter-expansion/v0001.json",
            "dataset_version_url": version,
        },
        servers=1,
        generation_wall_s=1.0,
        dataset_mix=[],
        mix_by_category=[],
    )
    locations = run_locations(store, layout, report)
    markdown = report.to_markdown(locations)
    run_folder = store.url(layout.root)
    assert f"- run folder: `{run_folder}`" in markdown
    assert f"- report: `{store.url(layout.report_md)}`" in markdown
    assert f"- manifest: `{store.url(layout.manifest)}`" in markdown
    assert f"- dataset version: `{version}`" in markdown
    assert f"- export: `datagen export {version}`" in markdown
    # What a browser can open is a link; s3:// and local paths stay code.
    remote = locations.model_copy(
        update={"run_folder": "https://console.example/r-1", "manifest": "s3://b/m.json"}
    )
    assert "- run folder: [https://console.example/r-1](https://console.example/r-1)" in remote.markdown()
    assert "- manifest: `s3://b/m.json`" in remote.markdown()
    assert locations.message().startswith(f"run folder {run_folder}; report ")
    assert locations.message().endswith(f"export: datagen export {version}")


def test_the_accounting_sums_every_attempts_paused_time_beside_the_preflights_estimate(
    tmp_path: Path,
) -> None:
    import datetime as dt

    from datagen.app.accounting import ServingTimes, account_run
    from datagen.app.history import plan_key
    from datagen.app.preflight import PreflightReport
    from datagen.app.preview import estimate_cost
    from datagen.dataset.report import RunSummary

    store, layout = Store(str(tmp_path)), RunLayout("r-1")
    halted = dt.datetime(2026, 1, 1, 1, 0, tzinfo=dt.UTC)
    plan = {
        "engine": "sglang",
        "mode": "dp",
        "served_model_name": "m",
        "servers": [
            {
                "index": index,
                "host": "127.0.0.1",
                "port": 30000 + index,
                "gpu_ids": [index],
                "url": f"http://h:{index}",
            }
            for index in range(4)
        ],
    }
    preview = estimate_cost(_config(tmp_path), [], gpus=4, prompts_by_dataset={"d": 100})
    store.write_json(
        layout.attempt_object("a1", "preflight.json"), PreflightReport(run_id="r-1", preview=preview)
    )
    for attempt, hours, generating_s in (("a1", 1.0, 3000.0), ("a2", 0.5, 1200.0)):
        end = halted + dt.timedelta(hours=hours)
        store.write_json(
            layout.attempt_object(attempt, "serving-times.json"),
            ServingTimes(halted_at=halted, handed_back_at=end),
        )
        store.write_json(layout.attempt_object(attempt, "plan.json"), plan)
        record_generation_window(
            store, layout, GenerationWindow(attempt_id=attempt, wall_s=generating_s, servers=4)
        )

    accounting = account_run(store, layout, output_tokens=600_000)

    assert accounting is not None
    assert (accounting.gpus, accounting.training_paused_s) == (4, 5400.0)
    assert accounting.gpu_hours == 6.0
    assert accounting.generating_share == 4200.0 / 5400.0
    assert accounting.output_tokens_per_gpu_hour == 100_000.0
    assert accounting.estimated_training_paused_s == preview.training_paused_s
    assert plan_key("dp", 4, 1) == "dp 4 x tp 1"
    summary = RunSummary(
        run_id="r-1",
        run_url="u",
        already_complete=False,
        prompts=1,
        requests=1,
        completions=1,
        failures=0,
        tokenized_rows=1,
        output_tokens_per_s=1.0,
        dataset_version=None,
        report_url="r",
        manifest_url="m",
        accounting=accounting,
    )
    assert "training paused: 1.50 h (estimated" in summary.state_message()
    assert "GPU-hours: 6.00 on 4 GPU(s)" in summary.state_message()


def test_the_progress_card_says_what_the_run_has_cost_training_so_far() -> None:
    progress = GenerationProgress(answered=1, total=2, elapsed_s=60.0, gpus=8, training_paused_s=5400.0)
    assert "paused 1 h 30 min · 12.0 GPU-h" in progress.card()
    assert progress.gpu_hours == 12.0
    assert "GPU-h" not in GenerationProgress(answered=1, total=2).card()


def test_the_progress_card_and_line_give_the_windows_time_left_and_say_when_it_drains() -> None:
    plain = GenerationProgress(answered=1, total=2, elapsed_s=60.0)
    assert "window" not in plain.card() and "window" not in plain.line()
    assert (
        plain.line()
        == "50.0% · 1/2 answered · 0.0 output tok/s · ETA 1 min 0 s · 0 failed · 1 min 0 s elapsed"
    )
    windowed = plain.model_copy(update={"gpus": 8, "training_paused_s": 5400.0, "window_left_s": 3900.0})
    # One short paragraph each on the card (Prefect cuts a card's lines at about 40 characters).
    assert "\n\npaused 1 h 30 min · 12.0 GPU-h\n\nwindow 1 h 5 min left" in windowed.card("queues")
    assert windowed.line().endswith("elapsed · paused 1 h 30 min · 12.0 GPU-h · window 1 h 5 min left")
    closing = windowed.model_copy(update={"window_left_s": 200.0, "window_closing": True})
    assert "window 3 min 20 s left · draining" in closing.card()


def test_a_multi_host_runs_gpu_hours_sum_every_box_and_its_paused_time_counts_overlapping_boxes_once(
    tmp_path: Path,
) -> None:
    import datetime as dt

    from datagen.app.accounting import ServingTimes, account_run

    store, layout = Store(str(tmp_path)), RunLayout("r-1")

    def plan(gpus: int) -> dict[str, object]:
        servers = [
            {"index": i, "host": "h", "port": 30000 + i, "gpu_ids": [i], "url": f"http://h:{i}"}
            for i in range(gpus)
        ]
        return {"engine": "sglang", "mode": "dp", "served_model_name": "m", "servers": servers}

    def served(attempt: str, host: str, start_h: float, end_h: float, gpus: int | None) -> None:
        day = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
        times = ServingTimes(
            halted_at=day + dt.timedelta(hours=start_h), handed_back_at=day + dt.timedelta(hours=end_h)
        )
        store.write_json(layout.attempt_object(attempt, f"host-{host}-serving-times.json"), times)
        if gpus is not None:
            store.write_json(layout.attempt_object(attempt, f"host-{host}-plan.json"), plan(gpus))

    # Attempt 1: box-a (8 GPUs) 01:00-07:00, box-b (4 GPUs) 01:30-06:30. Attempt 2 (a resume): box-a alone,
    # 08:00-09:00, failed before its plan was recorded: its GPUs are the box's own from attempt 1.
    served("a1", "box-a", 1.0, 7.0, 8)
    served("a1", "box-b", 1.5, 6.5, 4)
    served("a2", "box-a", 8.0, 9.0, None)
    record_generation_window(store, layout, GenerationWindow(attempt_id="a1", wall_s=18_000.0, servers=12))

    accounting = account_run(store, layout, output_tokens=1_000_000)

    assert accounting is not None
    assert accounting.gpus == 12  # both boxes at once
    assert accounting.gpu_hours == 8 * 6 + 4 * 5 + 8 * 1
    assert accounting.training_paused_s == (6 + 1) * 3600  # box-b's hold inside box-a's counts once
    assert accounting.generating_share == 18_000.0 / (7 * 3600)


def test_the_progress_card_shows_what_serving_costs_and_the_window_left() -> None:
    import datetime as dt

    from datagen.generation.dispatch_state import DispatcherStats
    from datagen.generation.window import WindowPolicy
    from datagen.records import utc_now
    from tasks.progress import ServingCost, progress_card

    stats = DispatcherStats(
        servers=[],
        queued=0,
        backing_off=0,
        completed=5,
        failed=0,
        retries=0,
        output_tokens=50,
        tokens_per_s=1.0,
    )
    now = utc_now()
    # Admission already stopped: the policy's generation end is in the past of the monotonic clock.
    closed = WindowPolicy(generation_end=0.0, initial_answer_s=1.0)
    cost = ServingCost(
        gpus=8,
        halted_at=now - dt.timedelta(hours=1),
        window_ends_at=now + dt.timedelta(hours=2),
        window=closed,
    )
    progress, card = progress_card(5, 10, stats, 60.0, cost)
    assert progress.training_paused_s is not None and 3599 <= progress.training_paused_s <= 3700
    assert progress.gpu_hours >= 8.0 - 1e-6
    assert progress.window_left_s is not None and 7100 <= progress.window_left_s <= 7200
    assert progress.window_closing
    assert "paused 1 h 0 min · 8.0 GPU-h" in card and "left · draining" in card
    unwindowed, plain = progress_card(5, 10, stats, 60.0, ServingCost(gpus=8))
    assert unwindowed.window_left_s is None and unwindowed.training_paused_s is None
    assert "GPU-h" not in plain and "window" not in plain


def test_the_report_counts_conversations_and_completions_by_sampling_setting(tmp_path: Path) -> None:
    shards = [
        _shard(0, 10).model_copy(
            update={
                "conversations": 4,
                "conversations_completed": 3,
                "sampling_settings": {"cold": 7, "hot": 3},
            }
        ),
        _shard(1, 10).model_copy(
            update={"conversations": 2, "conversations_completed": 2, "sampling_settings": {"cold": 10}}
        ),
    ]
    report = build_report(
        run_id="r-1",
        config=_config(tmp_path),
        prepared=[],
        shards=shards,
        tokenize_summary=None,
        servers=1,
        generation_wall_s=1.0,
        dataset_mix=[],
        mix_by_category=[],
    )
    assert (report.totals.conversations, report.totals.conversations_completed) == (6, 5)
    assert report.totals.sampling_settings == {"cold": 17, "hot": 3}
    markdown = report.to_markdown()
    assert (
        "- on-policy conversations: **6** (their turns are requests above), every turn answered: **5**"
        in markdown
    )
    assert "- d / cold: 17" in markdown and "- d / hot: 3" in markdown
    assert "inside their conversation's row" not in markdown


def test_per_conversation_rows_say_how_many_turns_are_inside_them(tmp_path: Path) -> None:
    shard = _shard(0, 10).model_copy(update={"conversations": 4, "conversations_completed": 4})
    tokenize = {"rows_by_dataset": {"d": 4}, "loss_tokens": 900, "turns_in_conversation_rows": 6}
    report = build_report(
        run_id="r-1",
        config=_config(tmp_path),
        prepared=[],
        shards=[shard],
        tokenize_summary=tokenize,
        servers=1,
        generation_wall_s=1.0,
        dataset_mix=[],
        mix_by_category=[],
    )
    assert report.totals.tokenized_rows == 4
    assert (
        "- tokenized rows: **4**, loss tokens: 900 (one row per on-policy conversation: 6 earlier turns are "
        "inside their conversation's row)" in report.to_markdown()
    )


def test_a_run_without_conversations_or_a_sampling_mix_says_nothing_of_them(tmp_path: Path) -> None:
    report = build_report(
        run_id="r-1",
        config=_config(tmp_path),
        prepared=[],
        shards=[_shard(0, 10)],
        tokenize_summary=None,
        servers=1,
        generation_wall_s=1.0,
        dataset_mix=[],
        mix_by_category=[],
    )
    markdown = report.to_markdown()
    assert "conversations" not in markdown and "sampling setting" not in markdown
