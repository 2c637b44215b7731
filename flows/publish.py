"""The end of a run: its failures judged, then merge and tokenize, the report, and the manifest last.

A run the generation window ended publishes what it finished (the run's first merge round) and stops there:
no report, no manifest, since the run is not complete; its continuation publishes the rest as the next version.
"""

from __future__ import annotations

from prefect import get_run_logger

from datagen.dataset.report import RunSummary
from datagen.errors import ShardsFailedError, TooManyFailuresError, UnfixableStorageError, WindowEndedError
from datagen.generation.failures import check_failed_share
from datagen.progress import Stage, enter_stage
from datagen.prompts.ledger import SeriesEntry
from tasks.context import RunContext
from tasks.data import merge_and_tokenize
from tasks.run import finalize_manifest, write_report
from tasks.shard_scheduler import Generated


def publish_run(context: RunContext, generated: Generated, series_entry: SeriesEntry | None) -> RunSummary:
    """Merge, tokenize, report and write the manifest, or fail the run with why (everything stays stored)."""
    logger = get_run_logger()
    run_id = context.run.run_id
    unfixable = [error for error in generated.errors if isinstance(error, UnfixableStorageError)]
    if unfixable:
        raise unfixable[0]  # its own line names the fault and where; the terminal adds the resume command
    if generated.window_closed:
        # Training runs again (the fleet stopped inside the window); what finished is published, the rest follows.
        raise _publish_window_part(context, generated, series_entry)
    if generated.errors:
        raise ShardsFailedError(
            f"{len(generated.errors)} shard(s) failed (first: {generated.errors[0]!r}); everything else is stored "
            "and a resume does not generate finished requests again",
            run_id=run_id,
            failed_shards=len(generated.errors),
        ) from generated.errors[0]
    # A run that mostly failed publishes nothing: a 0-row version would read as done (everything stays stored).
    check_failed_share(context.store, generated.summaries, context.config.generation.max_failed_share)
    enter_stage(logger, Stage.MERGE_AND_TOKENIZE)
    tokenize_summary = merge_and_tokenize(_merge_context(context, series_entry), generated.summaries)
    enter_stage(logger, Stage.REPORT)
    report = write_report(
        context,
        generated.prepared,
        generated.summaries,
        tokenize_summary,
        generated.servers,
        generated.wall_s,
    )
    enter_stage(logger, Stage.MANIFEST)
    finalize_manifest(context, report)
    summary = RunSummary.of_report(report, context.store, context.layout, already_complete=False)
    logger.info(
        "run complete run_id=%s completions=%d failures=%d tokenized_rows=%d url=%s",
        summary.run_id,
        summary.completions,
        summary.failures,
        summary.tokenized_rows,
        summary.run_url,
    )
    if generated.held_back:
        # Every object is stored and the run is complete; only training's restart was held back.
        raise generated.held_back[0]
    return summary


def _merge_context(context: RunContext, series_entry: SeriesEntry | None) -> RunContext:
    """The run's context for its merge: a series run's first version builds on the series' last one."""
    if series_entry is None:
        return context
    # The series' last version is the base (fixed in series.json when the run opened); the run's later merge
    # rounds build on its own earlier round instead (datagen/dataset/merge_rounds.py).
    tokenize = context.config.tokenize.model_copy(update={"base_version": series_entry.base_version})
    return context.with_config(context.config.model_copy(update={"tokenize": tokenize}))


def _publish_window_part(
    context: RunContext, generated: Generated, series_entry: SeriesEntry | None
) -> WindowEndedError:
    """Publish the shards finished so far as the run's next merge round; the error that ends the attempt.

    Nothing is published when no shard finished, too many of the finished shards' requests failed (the
    continuation judges the whole run) or every finished answer was dropped (its round is closed without a
    version: the continuation's rows make the next); the report and the manifest wait for the run's last request.
    """
    logger = get_run_logger()
    published: str | None = None
    rows = 0
    unpublished_because: str | None = "no shard finished"
    if generated.summaries:
        try:
            check_failed_share(context.store, generated.summaries, context.config.generation.max_failed_share)
        except TooManyFailuresError as failed:
            unpublished_because = str(failed)
        else:
            enter_stage(logger, Stage.MERGE_AND_TOKENIZE)
            merged = merge_and_tokenize(
                _merge_context(context, series_entry), generated.summaries, window_part=True
            )
            if merged["dataset_version_url"] is None:
                # A version without a row would read as done; the round is closed, the continuation's rows follow.
                dropped = ", ".join(
                    f"{reason} {count}" for reason, count in merged["dropped_by_reason"].items()
                )
                unpublished_because = (
                    f"every one of the {merged['completions_read']} answers of its finished shards was dropped: "
                    f"{dropped}"
                )
            else:
                published, rows = str(merged["dataset_version_url"]), int(merged["rows"])
                unpublished_because = None
    outcome = (
        f"published {published} with the {rows} rows of its finished shards"
        if published
        else f"nothing is published yet ({unpublished_because})"
    )
    logger.info(
        "window ended run_id=%s unsent=%d requests=%d published=%s rows=%d",
        context.run_id,
        generated.unsent,
        generated.requests,
        published,
        rows,
    )
    return WindowEndedError(
        f"the generation window ended with {generated.unsent} requests not yet answered; training runs again "
        f"and every answer is stored; {outcome}: the run's next attempt sends only those, then publishes the "
        "rest as the next version",
        unsent=generated.unsent,
        requests=generated.requests,
        published=published,
        published_rows=rows,
        unpublished_because=unpublished_because,
        run_id=context.run_id,
    )
