"""``datagen tune``: measure the in-flight count per server that saturates a live fleet.

For each level (requests kept in flight per server) a short fixed prompt set is sent to every server at
once, each server holding at most that many requests; output tokens per second over the whole fleet are
measured client-side (the ``usage`` of each answer), and where the engine serves Prometheus metrics
(SGLang's ``/metrics``) running and queued requests, KV-cache token usage and the engine's own generation
throughput are sampled while the level runs. The best level is the smallest one reaching
:data:`SATURATION_SHARE` of the highest throughput seen: past it more requests only add latency.

The result (``--output FILE``, JSON :class:`TuneResult`) can be given to the planner as ``fleet.tune_result``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import httpx

from datagen.engines import engine_class
from datagen.engines.tune_result import TunePoint, TuneResult
from datagen.errors import ConfigError, TuneFailedError
from datagen.generation.openai_chat import CHAT_COMPLETIONS_PATH
from datagen.progress import WorkProgress, report_work

logger = logging.getLogger(__name__)

# The smallest level within this share of the best throughput is chosen (beyond it: latency, no throughput).
SATURATION_SHARE = 0.95
DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32, 64, 128)
# Requests per server per level, in multiples of the level, so every slot refills a few times.
ROUNDS_PER_LEVEL = 3
DEFAULT_MAX_TOKENS = 256
REQUEST_TIMEOUT_S = 600.0
METRICS_POLL_S = 1.0
# A restarted server loads its model again: SGLang with CUDA graphs takes minutes on a 27B model.
RESTART_READY_TIMEOUT_S = 1200.0
RESTART_STOP_GRACE_S = 30.0
READY_POLL_S = 0.5
# Asking a server its model list before a sweep: a live server answers in milliseconds, even under load.
MODELS_TIMEOUT_S = 10.0
# Characters of a failed answer's body quoted in the error (the engine's reason fits; a whole page does not).
FAILURE_EXCERPT_CHARS = 200
# Fixed, varied prompts: the same set on every run so curves compare across hosts and versions.
TUNE_PROMPTS = (
    "Explain how a hash map handles collisions, with a short example.",
    "Write a Python function that merges two sorted lists.",
    "Summarise the causes of the French Revolution in five sentences.",
    "What is the derivative of x^3 * sin(x)? Show the steps.",
    "Describe three ways to reduce memory use in a web server.",
    "Translate 'knowledge is power' into French, German and Spanish, and explain each.",
    "Give a SQL query that finds the second highest salary per department.",
    "List the planets of the solar system with one fact about each.",
)
SGLANG_METRICS = {
    "running": "sglang:num_running_reqs",
    "queued": "sglang:num_queue_reqs",
    "token_usage": "sglang:token_usage",
    "gen_throughput": "sglang:gen_throughput",
}
_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)\s*$")


def parse_prometheus(text: str, names: dict[str, str]) -> dict[str, float]:
    """Sum the samples of each wanted metric in Prometheus text (labels, e.g. per-rank, are summed).

    Args:
        text: ``/metrics`` output.
        names: Our key -> Prometheus metric name.

    Returns:
        Our key -> value, for the metrics present.

    """
    wanted = {metric: key for key, metric in names.items()}
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _METRIC_LINE.match(line.strip())
        if match is None or match.group(1) not in wanted:
            continue
        key = wanted[match.group(1)]
        values[key] = values.get(key, 0.0) + float(match.group(3))
    return values


def choose_best(curve: list[TunePoint], first_failure: str | None = None) -> TunePoint:
    """The smallest level within :data:`SATURATION_SHARE` of the best throughput.

    Levels that lost more than :data:`~datagen.engines.tune_result.MAX_FAILED_SHARE` of their requests are not
    candidates, unless every level did: then every level that produced tokens is (transformers serve with
    random weights fails a share of requests at any load, and its sweep must still give a result).

    Args:
        curve: The measured levels.
        first_failure: The sweep's first failed request, for the error when no level produced a token.

    Raises:
        TuneFailedError: No level produced a single output token.

    """
    producing = [point for point in curve if point.output_tokens > 0]
    if not producing:
        raise TuneFailedError(_nothing_measured_message(curve, first_failure), first_failure=first_failure)
    usable = [point for point in producing if not point.disqualified] or producing
    top = max(point.output_tokens_per_s for point in usable)
    return min(
        (point for point in usable if point.output_tokens_per_s >= SATURATION_SHARE * top),
        key=lambda point: point.inflight_per_server,
    )


def _nothing_measured_message(curve: list[TunePoint], first_failure: str | None) -> str:
    """One line: what each level lost, the first failure, and what to check."""
    levels = ", ".join(
        f"{point.failed} of {point.requests} failed at {point.inflight_per_server} in flight"
        + (f" (setting {point.setting})" if point.setting is not None else "")
        for point in curve
    )
    first = (
        f"first failure: {first_failure}"
        if first_failure
        else "every answer carried no output tokens (usage.completion_tokens 0)"
    )
    return (
        f"datagen tune measured nothing: no level produced an output token ({levels}); {first}; "
        "nothing was recommended or written: check --model (the name the servers serve, e.g. the plan's "
        "served_model_name from `datagen probe --model DIR`) and --url"
    )


class _Answered(NamedTuple):
    """A request that was answered: its output tokens and how long it took."""

    output_tokens: int
    latency_s: float


def _describe_failure(url: str, error: Exception) -> str:
    """A failed request in a few words: the HTTP status and the start of the body, or the exception."""
    if isinstance(error, httpx.HTTPStatusError):
        body = " ".join(error.response.text.split())[:FAILURE_EXCERPT_CHARS]
        return f"HTTP {error.response.status_code} from {url}: {body}"
    return f"{type(error).__name__} from {url}: {error}"


async def _one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
) -> _Answered | str:
    """Send one chat request; the answer, or a description of why it failed."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "top_p": 0.95,
        "stream": False,
    }
    started = time.monotonic()
    try:
        response = await client.post(url + CHAT_COMPLETIONS_PATH, json=body)
        response.raise_for_status()
        usage = response.json().get("usage") or {}
    except (httpx.HTTPError, ValueError) as error:
        logger.warning("tune request failed url=%s error=%s", url, error)
        return _describe_failure(url, error)
    return _Answered(int(usage.get("completion_tokens") or 0), time.monotonic() - started)


async def _server_level(
    client: httpx.AsyncClient, url: str, model: str, level: int, count: int, max_tokens: int, offset: int
) -> list[_Answered | str]:
    semaphore = asyncio.Semaphore(level)

    async def run(index: int) -> _Answered | str:
        async with semaphore:
            prompt = TUNE_PROMPTS[(offset + index) % len(TUNE_PROMPTS)]
            return await _one_request(client, url, model, prompt, max_tokens)

    return list(await asyncio.gather(*(run(index) for index in range(count))))


async def _sample_metrics(
    client: httpx.AsyncClient, urls: list[str], path: str, stop: asyncio.Event
) -> list[dict[str, float]]:
    samples: list[dict[str, float]] = []
    while not stop.is_set():
        fleet: dict[str, float] = {}
        for url in urls:
            try:
                response = await client.get(url + path)
                response.raise_for_status()
            except httpx.HTTPError:
                continue
            for key, value in parse_prometheus(response.text, SGLANG_METRICS).items():
                fleet[key] = fleet.get(key, 0.0) + value / len(urls)
        if fleet:
            samples.append(fleet)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), METRICS_POLL_S)
    return samples


async def _measure_level(
    urls: list[str], model: str, level: int, max_tokens: int, metrics_path: str | None
) -> tuple[TunePoint, str | None]:
    """Measure one level on every server at once: its point, and its first failed request (None: none)."""
    count = level * ROUNDS_PER_LEVEL
    async with httpx.AsyncClient(
        timeout=REQUEST_TIMEOUT_S, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)
    ) as client:
        stop = asyncio.Event()
        sampler = (
            asyncio.create_task(_sample_metrics(client, urls, metrics_path, stop)) if metrics_path else None
        )
        started = time.monotonic()
        per_server = await asyncio.gather(
            *(
                _server_level(client, url, model, level, count, max_tokens, offset=index)
                for index, url in enumerate(urls)
            )
        )
        wall = time.monotonic() - started
        stop.set()
        samples = await sampler if sampler is not None else []
    results = [result for server in per_server for result in server]
    done = [result for result in results if isinstance(result, _Answered)]
    failures = [result for result in results if isinstance(result, str)]
    tokens = sum(answer.output_tokens for answer in done)
    gauges = {
        key: statistics.fmean(sample[key] for sample in samples if key in sample)
        for key in SGLANG_METRICS
        if any(key in sample for sample in samples)
    }
    point = TunePoint(
        inflight_per_server=level,
        requests=len(results),
        failed=len(failures),
        output_tokens=tokens,
        wall_s=round(wall, 3),
        output_tokens_per_s=round(tokens / wall, 2) if wall > 0 else 0.0,
        median_latency_s=round(statistics.median(answer.latency_s for answer in done), 3) if done else None,
        server_metrics={key: round(value, 4) for key, value in gauges.items()},
    )
    return point, failures[0] if failures else None


def _metrics_path(engine: str) -> str | None:
    try:
        return engine_class(engine).metrics_path
    except ConfigError as error:
        raise ValueError(str(error)) from None


def _refuse_other_models(urls: list[str], model: str, engine: str) -> None:
    """Refuse at once when a server's model list does not name ``model``: every request would fail.

    A server without a usable list (transformers serve 5.17 answers 500 to it offline) is not refused: the
    sweep's answers then tell.

    Raises:
        ConfigError: A server lists models and ``model`` is not among them.

    """
    from datagen.host.server_process import list_served_models

    models_path = engine_class(engine).models_path
    with httpx.Client(timeout=MODELS_TIMEOUT_S, trust_env=False) as client:
        for url in urls:
            models = list_served_models(client, url + models_path, {})
            if models is not None and model not in models:
                served = ", ".join(repr(name) for name in models) or "no model"
                raise ConfigError(f"{url} serves {served}, not {model!r}: give --model the name it serves")


def _sweep_progress(done: int, total: int, now: str) -> WorkProgress:
    """A sweep's progress: ``done`` of ``total`` settings measured, ``now`` the one under way."""
    return WorkProgress(what="tune", done=done, total=total, unit="settings", detail=now)


def tune_inflight(
    urls: list[str],
    model: str,
    engine: str,
    *,
    levels: tuple[int, ...] = DEFAULT_LEVELS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> TuneResult:
    """Sweep requests in flight per server on a live fleet and pick the saturating level.

    Args:
        urls: Base URLs of the servers (no ``/v1``).
        model: Model name to send in requests.
        engine: Engine kind of the servers (decides whether ``/metrics`` is read).
        levels: In-flight counts per server to measure, ascending.
        max_tokens: Answer length per request (fixed, so levels compare).

    Returns:
        The curve and the recommended in-flight count per server.

    Raises:
        ValueError: No URL or no level given, or a server's model list does not name ``model`` (before any
            request is sent).
        TuneFailedError: No level produced an output token (e.g. every request was refused).

    """
    if not urls or not levels:
        raise ValueError("datagen tune needs at least one server URL and one level")
    metrics_path = _metrics_path(engine)
    bases = [url.rstrip("/") for url in urls]
    _refuse_other_models(bases, model, engine)
    curve: list[TunePoint] = []
    first_failure: str | None = None
    todo = sorted(set(levels))
    for level in todo:
        report_work(_sweep_progress(len(curve), len(todo), f"{level} in flight per server"))
        point, failure = asyncio.run(_measure_level(bases, model, level, max_tokens, metrics_path))
        logger.info(
            "tune level=%d tokens_per_s=%.1f failed=%d", level, point.output_tokens_per_s, point.failed
        )
        curve.append(point)
        first_failure = first_failure or failure
    report_work(_sweep_progress(len(curve), len(todo), "done"))
    best = choose_best(curve, first_failure)
    return TuneResult(
        engine=engine,
        urls=list(urls),
        max_tokens=max_tokens,
        best_inflight_per_server=best.inflight_per_server,
        best_output_tokens_per_s=best.output_tokens_per_s,
        curve=curve,
        measured_with="client+/metrics" if metrics_path else "client",
    )


def with_setting(argv: list[str], flag: str, value: int) -> list[str]:
    """``argv`` with ``flag`` set to ``value`` (replaced where present, appended otherwise)."""
    updated = list(argv)
    if flag in updated:
        position = updated.index(flag)
        updated[position + 1 : position + 2] = [str(value)]
        return updated
    return [*updated, flag, str(value)]


def _wait_ready(
    process: subprocess.Popen[bytes], url: str, engine: str, model: str, timeout_s: float
) -> None:
    """Wait until the server just launched is ours and serves ``model``, as a fleet's readiness does.

    Ours: the socket listening on the URL's port belongs to ``process``'s tree, so another program that took
    the port is never measured in its place; then the health path answers 200 and the model list names
    ``model``.

    Raises:
        RuntimeError: The server exited, another program holds its port, or it serves another model.
        TimeoutError: It was not ready in ``timeout_s``.

    """
    from datagen import processes
    from datagen.host.server_process import list_served_models, port_listener

    recipe = engine_class(engine)
    address = httpx.URL(url)
    port = address.port or (443 if address.scheme == "https" else 80)
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=READY_POLL_S * 4, trust_env=False) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode} before it became ready")
            listener = port_listener(
                process.pid,
                port,
                lambda bound: True,
                processes.listening_sockets(),
                owner="the server datagen tune started",
            )
            if listener.verdict == "foreign":
                raise RuntimeError(f"{listener.detail}: stop that program or give --url another port")
            if listener.verdict != "none" and _answers(client, url + recipe.health_path):
                models = list_served_models(client, url + recipe.models_path, {})
                if models is not None and model not in models:
                    # The port is this process's, so no other program answers here: the name is what is wrong.
                    served = ", ".join(repr(name) for name in models) or "no model"
                    raise RuntimeError(
                        f"{url}: the server datagen tune started serves {served}, not {model!r} "
                        f"(GET {recipe.models_path}): give --model the name its command serves"
                    )
                return
            time.sleep(READY_POLL_S)
    raise TimeoutError(f"{url} was not ready within {timeout_s:.0f}s")


def _answers(client: httpx.Client, url: str) -> bool:
    """Whether ``url`` answers 200 now."""
    try:
        return client.get(url).status_code == httpx.codes.OK
    except httpx.HTTPError:
        return False


def tune_setting_by_restart(
    launch_argv: list[str],
    url: str,
    model: str,
    engine: str,
    flag: str,
    values: tuple[int, ...],
    *,
    inflight: int | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    ready_timeout_s: float = RESTART_READY_TIMEOUT_S,
    log_path: Path | None = None,
) -> tuple[int, list[TunePoint]]:
    """Restart one server with each value of ``flag`` and measure it at full load.

    The server is started from ``launch_argv`` (its own process group, stopped after each value); stop the
    server of ``url`` before calling. For ``--max-running-requests`` the load is the value plus the planner's
    margin; for other flags ``inflight``.

    Args:
        launch_argv: The server's command (e.g. from the plan artifact).
        url: Where that server answers.
        model: Model name for requests.
        engine: Engine kind (decides whether /metrics is read).
        flag: The flag to vary.
        values: Its values, ascending.
        inflight: Requests in flight during each measurement (None: value + margin).
        max_tokens: Answer length per request.
        ready_timeout_s: How long one start may take.
        log_path: Where the server's output goes (appended); discarded when None.

    Returns:
        The best value (smallest within reach of the top throughput) and one point per value.

    Raises:
        RuntimeError: A start failed (the server died).
        TimeoutError: A start did not become ready in time.
        TuneFailedError: No value produced an output token.

    """
    from datagen.engines.sglang_tuning import inflight_with_margin
    from datagen.processes import terminate_groups

    metrics_path = _metrics_path(engine)
    points: list[TunePoint] = []
    first_failure: str | None = None
    todo = sorted(set(values))
    for value in todo:
        report_work(_sweep_progress(len(points), len(todo), f"{flag} {value}"))
        argv = with_setting(launch_argv, flag, value)
        with open(log_path or os.devnull, "ab") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_ready(process, url.rstrip("/"), engine, model, ready_timeout_s)
            level = inflight or inflight_with_margin(value)
            point, failure = asyncio.run(
                _measure_level([url.rstrip("/")], model, level, max_tokens, metrics_path)
            )
        finally:
            terminate_groups([process.pid], RESTART_STOP_GRACE_S)
            process.wait()
        logger.info("tune restart flag=%s value=%d tokens_per_s=%.1f", flag, value, point.output_tokens_per_s)
        points.append(point.model_copy(update={"setting": value}))
        first_failure = first_failure or failure
    report_work(_sweep_progress(len(points), len(todo), "done"))
    best = choose_best(points, first_failure)
    assert best.setting is not None
    return best.setting, points


def tune_result_json(result: TuneResult) -> str:
    """The result as indented JSON."""
    return result.model_dump_json(indent=2)
