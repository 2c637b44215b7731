"""The `datagen` command line: a thin typer app that calls the same flow the deployments run.

The flow is not imported here (the core never imports ``flows``): the console script's entry module,
``flows/cli_entry.py``, calls :func:`main` with the starter of the `expand` flow (:data:`StartFlow`), which
reaches the commands that run it as the typer context's ``obj``. Heavy modules (Prefect, torch, transformers) are imported
inside the commands, so ``datagen --help`` answers at once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

# Exit codes of every command come from one table (2: bad input, nothing started; 1: failed).
from datagen.app.terminal import EXIT_REFUSED as EXIT_CONFIG_ERROR
from datagen.app.terminal import EXIT_RUN_FAILED, RETRY_FAILED_FLAG

if TYPE_CHECKING:
    from datagen.app.terminal import StartFlow

app = typer.Typer(
    name="datagen",
    help="Turn a GPU training box into a generation farm and back: expand a drafter's training data.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
datasets_app = typer.Typer(help="Look at prompt datasets without starting anything.", no_args_is_help=True)
app.add_typer(datasets_app, name="datasets")
corpus_app = typer.Typer(help="The existing training corpus.", no_args_is_help=True)
app.add_typer(corpus_app, name="corpus")


def _fail(message: str, code: int) -> None:
    typer.secho(message, fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _flow_starter(ctx: typer.Context) -> StartFlow:
    """The starter of the `expand` flow that :func:`main` was given."""
    if ctx.obj is None:
        _fail(
            "this command runs the `expand` flow, which only the `datagen` console script (or "
            "`python -m flows.cli_entry`) passes in",
            EXIT_CONFIG_ERROR,
        )
    start_flow: StartFlow = ctx.obj
    return start_flow


@app.command()
def run(
    ctx: typer.Context,
    config: Annotated[Path, typer.Option("--config", "-c", help="Run configuration (YAML).")],
    run_id: Annotated[str | None, typer.Option(help="Run id; reuse one to resume that run.")] = None,
    output: Annotated[
        str | None, typer.Option(help="Output root: a directory or s3://bucket/prefix.")
    ] = None,
    retry_failed: Annotated[
        bool,
        typer.Option(
            RETRY_FAILED_FLAG,
            help="With --run-id of a run that ended: send again its failed requests whose reason was not the "
            "prompt's own (server errors, resets, timeouts, a wrong model or server).",
        ),
    ] = False,
    max_prompts: Annotated[
        int | None,
        typer.Option(min=1, help="Cap every dataset's quota at this many prompts (a smoke run)."),
    ] = None,
    datasets: Annotated[
        str | None,
        typer.Option(
            help="Run only these of the config's datasets: names, comma-separated (all when unset)."
        ),
    ] = None,
) -> None:
    """Run the whole expansion flow (the same flow the Prefect deployments run).

    Exit codes: 0 done; 1 the run failed (resume with --run-id); 2 bad config or preflight refusal (nothing
    halted); 3 the run is complete and stored but training was not restarted (its environment changed since the
    halt: the last line says what); 4 the generation window ended the run first (training runs again, what
    finished is published; the same --run-id sends the rest); 130/143 interrupted by SIGINT/SIGTERM (servers
    stopped; resume with --run-id).
    """
    from datagen.app.preflight import check_output_reachable
    from datagen.app.pullstep import default_checkout
    from datagen.app.run_request import box_config_name, resolve_config_file
    from datagen.app.terminal import (
        INTERRUPT_SIGNALS,
        exit_code_for_signal,
        exit_now_if_threads_linger,
        print_summary,
        run_in_terminal,
        run_log_path,
    )
    from datagen.errors import ConfigError, PreflightError, StorageError
    from datagen.output.runs import open_store
    from datagen.prompts.ledger import read_series_entry
    from datagen.settings import get_settings

    start_flow = _flow_starter(ctx)
    chosen: dict[str, Any] = {
        "run_id": run_id,
        "output": output,
        "max_prompts": max_prompts,
        "datasets": [name.strip() for name in datasets.split(",")] if datasets is not None else None,
    }
    try:
        resolved = resolve_config_file(config, **chosen)
    except ConfigError as error:
        _fail(str(error), EXIT_CONFIG_ERROR)
    try:
        # Before Prefect starts (seconds): an S3 endpoint that does not answer at all is refused at once.
        check_output_reachable(resolved)
    except PreflightError as error:
        _fail(f"datagen: {error}", EXIT_CONFIG_ERROR)
    if run_id is None and resolved.series is not None:
        # A series' next run continues the series' unfinished run first (its run id, resumed).
        try:
            resolved = resolve_config_file(config, **chosen, continue_series=True)
            continued = read_series_entry(open_store(resolved), str(resolved.run_id)) is not None
        except ConfigError as error:
            _fail(str(error), EXIT_CONFIG_ERROR)
        except StorageError as error:
            _fail(f"datagen: the series' ledger could not be read: {error}", EXIT_CONFIG_ERROR)
        if continued:
            typer.echo(
                f"continuing run {resolved.run_id} of series {resolved.series}: it took prompts it has not "
                "published yet; new prompts wait for the series' next run",
                err=True,
            )
    assert resolved.run_id is not None
    resume = f"datagen run --config {config} --run-id {resolved.run_id}"
    if output:
        resume += f" --output {output}"
    # The run's config is the file with these choices: its resume names them again.
    if datasets is not None:
        resume += f" --datasets {datasets}"
    if max_prompts is not None:
        resume += f" --max-prompts {max_prompts}"
    # A config of the checkout's configs/ is passed with its name: a multi-host run's hosts resolve it by it.
    name = box_config_name(config, default_checkout())
    if retry_failed:
        resume += f" {RETRY_FAILED_FLAG}"
    code, summary = run_in_terminal(
        lambda: start_flow(resolved, name, retry_failed),
        run_id=resolved.run_id,
        resume_command=resume,
        log_path=run_log_path(get_settings().state_dir, resolved.run_id),
    )
    if code in {exit_code_for_signal(signum) for signum in INTERRUPT_SIGNALS}:
        exit_now_if_threads_linger(code)
    if code != 0 or summary is None:
        raise typer.Exit(code)
    print_summary(summary)


@app.command()
def tune(
    url: Annotated[list[str], typer.Option(help="Base URL of a running server (repeat for each).")],
    model: Annotated[str, typer.Option(help="Model name to send in requests (the served name).")],
    engine: Annotated[str, typer.Option(help="Engine of the servers: sglang reads /metrics.")] = "sglang",
    levels: Annotated[str, typer.Option(help="In-flight counts per server to try, comma-separated.")] = (
        "1,2,4,8,16,32,64,128"
    ),
    max_tokens: Annotated[int, typer.Option(help="Answer length of every request.")] = 256,
    vary_flag: Annotated[
        str | None,
        typer.Option(
            help="Instead: restart ONE server (--launch, at the first --url) with each --values of this flag."
        ),
    ] = None,
    values: Annotated[str, typer.Option(help="Values of --vary-flag, comma-separated.")] = "",
    launch: Annotated[
        str, typer.Option(help="The server's command line (from the plan), for --vary-flag.")
    ] = "",
    output: Annotated[
        Path | None, typer.Option(help="Write the result (JSON) here, for fleet.tune_result.")
    ] = None,
) -> None:
    """Sweep requests in flight per server on live servers; print the throughput curve and the best setting.

    With --vary-flag (e.g. --max-running-requests for sglang), stop the first server yourself and give its
    command as --launch: it is restarted once per value and measured at full load.
    """
    import shlex

    from datagen.app.bars import work_bars
    from datagen.app.tune import tune_inflight, tune_result_json, tune_setting_by_restart
    from datagen.engines import engine_class
    from datagen.engines.tune_result import TuneResult
    from datagen.errors import TuneFailedError

    with work_bars():
        try:
            if vary_flag:
                if not launch or not values:
                    _fail("--vary-flag needs --launch (the server's command) and --values", EXIT_CONFIG_ERROR)
                best, points = tune_setting_by_restart(
                    shlex.split(launch),
                    url[0],
                    model,
                    engine,
                    vary_flag,
                    tuple(int(value) for value in values.split(",")),
                    max_tokens=max_tokens,
                )
                best_point = next(point for point in points if point.setting == best)
                result = TuneResult(
                    engine=engine,
                    urls=url[:1],
                    max_tokens=max_tokens,
                    best_inflight_per_server=best_point.inflight_per_server,
                    best_output_tokens_per_s=best_point.output_tokens_per_s,
                    curve=[],
                    measured_with="client+/metrics" if engine_class(engine).metrics_path else "client",
                    setting_flag=vary_flag,
                    best_setting=best,
                    setting_curve=points,
                )
            else:
                result = tune_inflight(
                    url,
                    model,
                    engine,
                    levels=tuple(int(level) for level in levels.split(",")),
                    max_tokens=max_tokens,
                )
        except TuneFailedError as error:
            # A sweep that measured nothing failed: no file, no history record for the planner to trust.
            _fail(str(error), EXIT_RUN_FAILED)
        except (ValueError, RuntimeError, TimeoutError) as error:
            _fail(str(error), EXIT_CONFIG_ERROR)
    typer.echo(result.to_table())
    typer.echo(
        f"best: {result.best_inflight_per_server} in flight per server "
        f"({result.best_output_tokens_per_s:.1f} output tok/s over {len(result.urls)} server(s))"
        + (f", {result.setting_flag} {result.best_setting}" if result.setting_flag else "")
    )
    if result.still_rising:
        typer.echo(
            f"note: throughput was still rising at {result.best_inflight_per_server}, the largest level tried: "
            "add larger --levels to find where it flattens"
        )
    if output is not None:
        output.write_text(tune_result_json(result), encoding="utf-8")
        typer.echo(f"written to {output}: set fleet.tune_result: {output} to plan with it")
    _record_tune(result, model)


@app.command("tiny-model")
def tiny_model(
    directory: Annotated[Path, typer.Argument(help="Where to write the model and tokenizer.")],
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
) -> None:
    """Build a tiny random-weight Qwen3-architecture model and tokenizer (offline, seconds)."""
    from datagen.app.tinymodel import build_tiny_model

    path = build_tiny_model(directory, seed=seed)
    typer.echo(f"tiny model written to {path}")


@app.command()
def probe(
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    from_dir: Annotated[
        Path | None, typer.Option(help="Read recorded nvidia-smi/nvcc/torch outputs from this folder.")
    ] = None,
    record: Annotated[
        Path | None,
        typer.Option(help="Also write this host's raw outputs to this folder (a bundle for --from-dir)."),
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(help="Also plan the servers for this model directory (its config.json) on this host."),
    ] = None,
    engine: Annotated[str, typer.Option(help="Engine to plan for with --model.")] = "sglang",
) -> None:
    """Probe this host (or a recorded bundle): GPUs, interconnect, drivers, packages, problems and fixes."""
    from datagen.errors import DatagenError
    from datagen.host.probe import probe_environment, probe_from_dir

    if from_dir and record:
        _fail("--record writes this host's outputs; it cannot be combined with --from-dir", EXIT_CONFIG_ERROR)
    try:
        report = probe_from_dir(from_dir) if from_dir else probe_environment(record_dir=record)
    except DatagenError as error:
        _fail(str(error), EXIT_CONFIG_ERROR)
    plan = None
    if model is not None and not (model / "config.json").is_file():
        what = "does not exist" if not model.exists() else "has no config.json"
        _fail(f"--model {model} {what}: pass a local model directory (with config.json)", EXIT_CONFIG_ERROR)
    if model is not None:
        try:
            plan = _plan_for_model(report, model, engine)
        except DatagenError as error:
            _fail(f"no plan for {model}: {error}", EXIT_CONFIG_ERROR)
    if as_json:
        data = report.model_dump(mode="json")
        if plan is not None:
            data["plan"] = plan.model_dump(mode="json")
        typer.echo(json.dumps(data, indent=2))
    else:
        typer.echo(report.to_markdown())
        if plan is not None:
            typer.echo(plan.to_markdown())


def _plan_for_model(report: Any, model: Path, engine: str) -> Any:
    """The server plan this host would get for ``model`` (ports are only proposed, nothing is started)."""
    import tempfile

    from datagen.config import parse_run_config
    from datagen.host.plan import plan_servers

    config = parse_run_config(
        {
            "model": {"path": str(model)},
            "fleet": {"engine": engine},
            "datasets": [{"name": "probe", "format": "openai_messages", "path": "unused"}],
            "output": tempfile.gettempdir(),
        },
        source="datagen probe --model",
    )
    # The plan only names its log folder there; nothing is started, so the folder goes when the plan is made.
    with tempfile.TemporaryDirectory(prefix="datagen-probe-plan-") as logs:
        return plan_servers(report, config, Path(logs))


@datasets_app.command("inspect")
def datasets_inspect(
    path: Annotated[str, typer.Argument(help="Dataset file, glob, folder or s3:// URL.")],
    format: Annotated[str, typer.Option("--format", "-f", help="Dataset layout, e.g. metamath, hermes_fc.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the counts as JSON.")] = False,
    limit: Annotated[int | None, typer.Option(help="Read at most this many rows.")] = None,
    multi_turn: Annotated[
        str,
        typer.Option(
            "--multi-turn",
            help="last_turn, every_turn (one prompt per assistant turn), or on_policy (one prompt per "
            "conversation, its turns answered in generation).",
        ),
    ] = "last_turn",
) -> None:
    """Count rows read, prompts produced and rejections by reason; starts nothing, writes nothing."""
    from typing import get_args

    from datagen.config import MultiTurnPolicy
    from datagen.errors import DatagenError
    from datagen.prompts.prepare import inspect_dataset

    policies = get_args(MultiTurnPolicy)
    if multi_turn not in policies:
        _fail(f"Unknown --multi-turn {multi_turn!r}; use one of: {', '.join(policies)}", EXIT_CONFIG_ERROR)
    try:
        report = inspect_dataset(format, path, limit=limit, multi_turn=multi_turn)  # type: ignore[arg-type]
    except DatagenError as error:
        _fail(str(error), EXIT_CONFIG_ERROR)
    if as_json:
        typer.echo(json.dumps(report.model_dump(mode="json"), indent=2))
    else:
        typer.echo(report.to_text())


@app.command()
def demo(
    ctx: typer.Context,
    run_id: Annotated[str, typer.Option(help="Run id of the demo run.")] = "demo",
) -> None:
    """Run the local demo: tiny model, stand-in trainer, 2 CPU servers, bundled sample prompts."""
    from datagen.app.demo import run_demo

    sys.exit(run_demo(run_id, _flow_starter(ctx)))


@corpus_app.command("adopt")
def corpus_adopt(
    url: Annotated[
        str, typer.Argument(help="The existing corpus (read only): a folder or s3://bucket/prefix.")
    ],
    output: Annotated[str, typer.Option(help="Output store root for the manifest: a folder or s3://...")],
    name: Annotated[str, typer.Option(help="Dataset name of the version.")] = "existing-corpus",
    category_field: Annotated[
        str | None, typer.Option(help="Column / record field holding each row's category.")
    ] = None,
    category_key_pattern: Annotated[
        str | None, typer.Option(help="Regex with a `category` group, searched in each object key.")
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="The target's tokenizer folder: also tokenize the corpus's completions (*.jsonl) into Parquet "
            "parts in the output store, so the version's parts are the whole corpus."
        ),
    ] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, help="Tokenizer processes (default: the cores available).")
    ] = None,
    jsonl: Annotated[
        bool,
        typer.Option(
            "--jsonl",
            help="Also export the version as the JSONL SpecForge and speculators read (`datagen export`).",
        ),
    ] = False,
) -> None:
    """Reference the existing corpus in place as a base dataset version (nothing under URL is written)."""
    from pydantic import ValidationError

    from datagen.app.bars import work_bars
    from datagen.config import TokenizeConfig
    from datagen.dataset.corpus import AdoptTokenize, CategoryRule, adopt_corpus
    from datagen.errors import DatagenError
    from datagen.output.store import Store

    try:
        rule = CategoryRule(field=category_field, key_pattern=category_key_pattern)
        tokenize = (
            AdoptTokenize(tokenizer=tokenizer, settings=TokenizeConfig(workers=workers))
            if tokenizer
            else None
        )
        with work_bars():
            adopted = adopt_corpus(
                url, Store(output, protected_prefixes=[url]), name=name, rule=rule, tokenize=tokenize
            )
    except ValidationError as error:
        _fail(f"invalid category rule: {error}", EXIT_CONFIG_ERROR)
    except DatagenError as error:
        _fail(f"corpus adopt failed: {error}", EXIT_RUN_FAILED)
    version = adopted.version
    completion_rows = sum(source.rows for source in version.completion_sources)
    untokenized = [source for source in version.completion_sources if source.tokenized_rows is None]
    if not version.completion_sources:
        completions = ""
    elif untokenized:
        completions = (
            f"  completions: {completion_rows} rows referenced, not training rows (give --tokenizer to tokenize "
            "them into parts)\n"
        )
    else:
        tokenized = sum(source.tokenized_rows or 0 for source in version.completion_sources)
        completions = (
            f"  completions: {completion_rows} rows, {tokenized} tokenized into parts, dropped "
            f"{json.dumps(adopted.dropped_by_reason)}\n"
        )
    typer.echo(
        f"adopted {url}: {len(version.shards)} parts ({version.rows} rows), "
        f"{len(version.completion_sources)} completions files ({completion_rows} rows)\n"
        f"{completions}"
        f"  categories {json.dumps(version.categories)}\n"
        f"  version    {adopted.version_url}\n"
        f"  next runs: set tokenize.base_version: {adopted.version_url}"
    )
    _print_training(adopted.version_url, output, tokenizer, export=jsonl)


def _print_training(version_url: str, output: str, tokenizer: str | None, *, export: bool) -> None:
    """Export a version when asked (or find its export) and print each trainer's command, or how to export."""
    from datagen.app.bars import work_bars
    from datagen.dataset.export import export_version, find_export, parquet_hint, training_commands
    from datagen.dataset.versions import ExportRecord, read_base_version
    from datagen.errors import DatagenError
    from datagen.output.store import Store

    store = Store(output)
    record: ExportRecord | None = None
    try:
        if export:
            with work_bars():
                _, _, record = export_version(store, version_url)
        else:
            record = find_export(store, read_base_version(store, version_url)[1])
    except DatagenError as error:
        _fail(f"export failed: {error}", EXIT_RUN_FAILED)
    if record is None:
        typer.echo("  to train on it:")
        typer.echo("".join(f"    {line}\n" for line in parquet_hint(version_url)), nl=False)
        return
    typer.echo(
        f"  export     {record.url} ({record.rows} rows, {record.tokens} tokens, {record.loss_tokens} loss "
        f"tokens, longest row {record.longest_row_tokens} tokens)"
    )
    typer.echo("  to train on it:")
    typer.echo("".join(f"    {line}\n" for line in training_commands(record, tokenizer)), nl=False)


@app.command("export")
def export(
    version: Annotated[
        str, typer.Argument(help="A dataset version manifest: its URL (.../datasets/<name>/vNNNN.json).")
    ],
    output: Annotated[
        str | None,
        typer.Option(help="Store root to write the export into (default: the store holding the version)."),
    ] = None,
    tokenizer: Annotated[
        str | None, typer.Option(help="The target model or tokenizer folder, for speculators' --model.")
    ] = None,
) -> None:
    """Write (once) the JSONL that SpecForge and speculators read as-is beside a version's Parquet parts."""
    from datagen.dataset.export import version_store_root

    root = output or version_store_root(version)
    if root is None:
        _fail(
            f"{version} is not at .../datasets/<name>/vNNNN.json: give the store root with --output",
            EXIT_CONFIG_ERROR,
        )
    assert root is not None
    typer.echo(f"version    {version}")
    _print_training(version, root, tokenizer, export=True)


@app.command()
def deploy(
    name: Annotated[
        list[str] | None, typer.Option("--name", "-n", help="Deploy only this deployment (repeatable).")
    ] = None,
) -> None:
    """Create or update the Prefect deployments from this checkout, versioned by its git commit.

    Calls `prefect deploy` on deployments/prefect.yaml from the checkout's root (any working folder
    works) against the configured PREFECT_API_URL (with PREFECT_API_AUTH_STRING when the server asks for
    it), creating or updating the work pool with deployments/work-pool.json as its job template: the
    command and environment of a run are the pool's, not the run's; then closes each deployment's parameters
    to the flow's own, so the server refuses a run that sends another. Workers then run the flow from their
    own checkout and refuse to run another commit than the one deployed.
    """
    from datagen.app.deploy import deploy as deploy_checkout
    from datagen.errors import ConfigError

    try:
        code, output = deploy_checkout(names=name)
    except ConfigError as error:
        _fail(str(error), EXIT_CONFIG_ERROR)
    typer.echo(output)
    if code != 0:
        _fail(f"prefect deploy failed (exit {code}); its output is above.", EXIT_RUN_FAILED)


@app.command()
def wait(
    flow_run_id: Annotated[
        str, typer.Argument(help="The flow run (its id, as the UI and `prefect` print it).")
    ],
    timeout_s: Annotated[
        float | None, typer.Option(help="Give up after this many seconds (exit 1; the run goes on).")
    ] = None,
    api_url: Annotated[str | None, typer.Option(help="Prefect's API; PREFECT_API_URL when unset.")] = None,
    poll_s: Annotated[float, typer.Option(help="Seconds between two reads of the run's state.")] = 5.0,
) -> None:
    """Wait for a flow run to end; exit 0 only when it Completed (for CI, instead of `--watch`).

    A Prefect API that stops answering for a while is waited out, so only the run's own end decides.
    Exit codes: 0 Completed; 1 Failed, Crashed, Cancelled or the timeout passed; 2 no such run or no API.
    """
    import os

    from datagen.app.wait import wait_for_flow_run
    from datagen.errors import ConfigError

    url = api_url or os.environ.get("PREFECT_API_URL")
    if not url:
        _fail("no Prefect API to ask: set PREFECT_API_URL or pass --api-url", EXIT_CONFIG_ERROR)
    assert url is not None
    try:
        end = wait_for_flow_run(url, flow_run_id, timeout_s=timeout_s, poll_s=poll_s, say=typer.echo)
    except ConfigError as error:
        _fail(f"datagen: {error}", EXIT_CONFIG_ERROR)
    if end is None:
        _fail(f"flow run {flow_run_id} had not ended after {timeout_s:.0f} s (it goes on)", EXIT_RUN_FAILED)
    assert end is not None
    message = f": {end.message}" if end.message else ""
    if not end.completed:
        _fail(f"flow run {end.name or flow_run_id} ended {end.state_name}{message}", EXIT_RUN_FAILED)
    typer.echo(f"flow run {end.name or flow_run_id} ended {end.state_name}")


@app.command("gpu-lock")
def gpu_lock() -> None:
    """Show this host's GPU lock: free, or held by which run (pid, flow run, since when).

    Exit code 0 when the lock is free, 1 when a run holds it (scripts can wait on it).
    """
    from datagen.host.gpu_lock import host_lock_path, is_held, read_holder

    path = host_lock_path()
    holder = read_holder(path)
    if is_held(path):
        typer.echo(f"held: {holder.describe() if holder else 'by a process that has not named itself yet'}")
        typer.echo(f"lock file: {path}")
        raise typer.Exit(EXIT_RUN_FAILED)
    last = f" (last held by {holder.describe()})" if holder else ""
    typer.echo(f"free{last}")
    typer.echo(f"lock file: {path}")


def main(start_flow: StartFlow) -> None:
    """Run the command line (called by the console script's entry module, ``flows/cli_entry.py``).

    Args:
        start_flow: Imports Prefect and the `expand` flow and returns a run of it; called only by the
            commands that run it.

    """
    app(obj=start_flow)


@app.command("plan")
def plan_cost(
    config: Annotated[Path, typer.Option("--config", "-c", help="Run configuration (YAML).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the preview as JSON.")] = False,
) -> None:
    """Show what a run of this config would cost (prompts, output tokens, hours, GPU-hours): halts nothing.

    Figures come from this box's history of earlier runs and `datagen tune`s of the same model and engine;
    without history, from the datasets' max_tokens and the planner's rate, marked as such.
    """
    from datagen.app.preview import preview_on_this_box
    from datagen.app.run_request import resolve_config_file
    from datagen.errors import ConfigError

    try:
        resolved = resolve_config_file(config)
    except ConfigError as error:
        _fail(str(error), EXIT_CONFIG_ERROR)
    preview = preview_on_this_box(resolved, count_unbounded=True)
    if as_json:
        typer.echo(preview.model_dump_json(indent=2))
        return
    for line in preview.lines():
        typer.echo(line)


def _record_tune(result: Any, model: str) -> None:
    """Add the tune's best rate to this box's history, which `datagen plan` and preflight's preview read."""
    from datagen.app.history import append_record, tune_record
    from datagen.settings import get_settings

    append_record(get_settings().state_dir, tune_record(result, model))
