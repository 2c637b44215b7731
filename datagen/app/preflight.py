"""Preflight: everything that can be checked before the training job is stopped.

Stopping training costs GPU hours; a run that then dies on a typo in a dataset path wastes them. So every
check that needs no GPU runs first, all of them (not stopping at the first problem), and the run refuses
to start with one message listing each problem and its fix.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from datagen.app.preview import CostPreview
from datagen.config import DatasetConfig, RunConfig
from datagen.errors import DatagenError, OutputExistsError, PreflightError, StorageUnreachableError
from datagen.escape import markdown_code, markdown_text
from datagen.output.layout import RunLayout
from datagen.output.runs import check_run_config, read_stored_config
from datagen.output.s3 import S3Backend
from datagen.output.s3_client import S3Credentials, error_facts, is_transient_status, make_s3_client
from datagen.output.store import Store, normalise_url, overlaps
from datagen.prompts.mix import validate_mix
from datagen.records import PreparedDataset, utc_now

logger = logging.getLogger(__name__)

# Preflight asks S3 one question per check and must answer in seconds: a short connect and read timeout, and
# for the reachability probe one retry, against the run's ten attempts with backoff (minutes) once it is under
# way. The checks that read the output once it answered get a few more tries: S3 answers 503 SlowDown or 500
# under load as a matter of course, and refusing a run (a resume, say) for two such answers in a row would be
# wrong; five tries with standard backoff take seconds.
PREFLIGHT_S3_CONNECT_TIMEOUT_S = 3.0
PREFLIGHT_S3_READ_TIMEOUT_S = 3.0
PREFLIGHT_S3_MAX_ATTEMPTS = 2
PREFLIGHT_S3_READ_ATTEMPTS = 5
# A server that should already run answers its first byte in well under a second.
PREFLIGHT_SERVER_CONNECT_TIMEOUT_S = 3.0
PREFLIGHT_SERVER_READ_TIMEOUT_S = 5.0
HTTP_NOT_FOUND = 404
# Random bytes in the name of the write-once probe: two preflights never try the same object.
WRITE_ONCE_PROBE_TOKEN_BYTES = 6
# Any of these in a local directory means it holds a tokenizer (fast, sentencepiece or BPE vocabulary).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Check(BaseModel):
    """One preflight check and its outcome."""

    model_config = ConfigDict(extra="forbid")

    name: str
    ok: bool
    skipped: bool = Field(
        default=False, description="Not run, because an earlier check it depends on failed."
    )
    detail: str = ""


class PreflightReport(BaseModel):
    """Every check that ran, in order."""

    model_config = ConfigDict(extra="forbid")

    run_id: str
    checks: list[Check] = Field(default_factory=list)
    preview: CostPreview | None = Field(default=None, description="The run's expected cost on this box.")

    @property
    def problems(self) -> list[str]:
        """One line per failed check."""
        return [
            f"{check.name}: {check.detail}" for check in self.checks if not check.ok and not check.skipped
        ]

    def to_markdown(self) -> str:
        """A checklist for a Prefect artifact."""
        lines = [f"# Preflight of run {markdown_code(self.run_id)}", ""]
        # A check's detail names paths and URLs a run's caller chose (its output): shown as text, never markdown.
        lines += [
            f"- {'✅' if check.ok else '⏭️' if check.skipped else '❌'} **{markdown_text(check.name)}** "
            f"{markdown_text(check.detail)}"
            for check in self.checks
        ]
        if self.preview is not None:
            lines += ["", self.preview.to_markdown()]
        return "\n".join(lines) + "\n"


def _check_mix(config: RunConfig, store: Store) -> str:
    plan = validate_mix(config)
    if plan.capped_categories:
        return f"category caps hold; capped: {', '.join(plan.capped_categories)}"
    return "quotas planned"


def preflight_store(
    config: RunConfig,
    credentials: S3Credentials | None = None,
    *,
    max_attempts: int = PREFLIGHT_S3_MAX_ATTEMPTS,
) -> Store:
    """The run's store with a quick S3 client: seconds to connect or answer, one retry by default.

    Args:
        config: The run config.
        credentials: S3 credentials (None: the standard AWS chain); the datasets are read with them too.
        max_attempts: Tries per S3 request: the default suits the reachability probe; the checks that read
            the output once it answered pass ``PREFLIGHT_S3_READ_ATTEMPTS``.
    """
    backend = None
    if config.output.startswith("s3://"):
        client = make_s3_client(
            credentials=credentials,
            max_attempts=max_attempts,
            connect_timeout_s=PREFLIGHT_S3_CONNECT_TIMEOUT_S,
            read_timeout_s=PREFLIGHT_S3_READ_TIMEOUT_S,
        )
        backend = S3Backend(config.output, client=client)
    return Store(
        config.output, protected_prefixes=config.protected_prefixes, backend=backend, credentials=credentials
    )


def _unreachable(error: Exception) -> bool:
    """Whether nothing answered at all: no connection, or a connection that stayed silent."""
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

    return isinstance(error, EndpointConnectionError | ConnectTimeoutError | ReadTimeoutError)


def _answered_transiently(error: Exception) -> bool:
    """Whether the endpoint answered with what S3 under load answers now and then: a 5xx, throttling, a reset."""
    from botocore.exceptions import ConnectionClosedError

    return isinstance(error, ConnectionClosedError) or is_transient_status(*error_facts(error))


def _raise_unreachable(client: Any, error: Exception, started: float) -> None:
    endpoint = client.meta.endpoint_url
    raise StorageUnreachableError(
        f"S3 endpoint {endpoint} is unreachable ({type(error).__name__}, {PREFLIGHT_S3_MAX_ATTEMPTS} "
        f"attempts in {time.monotonic() - started:.1f}s); check DATAGEN_S3_ENDPOINT_URL (or the AWS region) "
        "and that this host reaches it",
        endpoint=endpoint,
    ) from None


def check_output_reachable(config: RunConfig) -> None:
    """Refuse at once when the S3 endpoint of the output does not answer at all (seconds, no credentials).

    The command line calls this before it starts Prefect, so an unreachable endpoint is reported in
    seconds; any answer (even 403: credentials may come from a Prefect block the flow loads) passes, and
    the flow's preflight judges it.

    Raises:
        PreflightError: The endpoint did not answer within the quick probe's timeouts.
    """
    if not config.output.startswith("s3://"):
        return
    backend = preflight_store(config).backend
    assert isinstance(backend, S3Backend)
    started = time.monotonic()
    try:
        backend.client.head_bucket(Bucket=backend.bucket)
    except Exception as error:
        if not _unreachable(error):
            return
        try:
            _raise_unreachable(backend.client, error, started)
        except StorageUnreachableError as unreachable:
            raise PreflightError([f"output location: {unreachable}"]) from None


def _head_output_bucket(config: RunConfig, store: Store, patient: S3Backend) -> None:
    """Ask for the output's bucket: a quick probe first, then, if S3 answered with a transient error, ``patient``.

    Nothing answering at all is reported in seconds (the quick probe's two attempts). An answer such as
    ``503 SlowDown``, a ``500`` or a reset means the endpoint is there and busy: the question is asked again
    with the checks' client (a few attempts with backoff) before the run is refused.

    Raises:
        StorageUnreachableError: Nothing answered.
        DatagenError: The bucket cannot be reached (credentials, a missing bucket, S3 failing every try).
    """
    probe = preflight_store(config, store.credentials).backend
    assert isinstance(probe, S3Backend)
    started = time.monotonic()
    failure: Exception | None = None
    for backend in (probe, patient):
        try:
            backend.client.head_bucket(Bucket=backend.bucket)
            return
        except Exception as error:
            if _unreachable(error):
                _raise_unreachable(backend.client, error, started)
            failure = error
        if not _answered_transiently(failure):
            break  # a refusal (403, a missing bucket) is the same answer the second time
    raise DatagenError(
        f"bucket {patient.bucket} is not reachable ({failure}); check credentials (AWS_* env, profile, "
        "DATAGEN_AWS_CREDENTIALS_BLOCK) and DATAGEN_S3_ENDPOINT_URL"
    ) from None


def _check_output_location(config: RunConfig, store: Store) -> str:
    # What matters is where this run writes: its run folder and its dataset's version folder. An output root
    # that merely contains a protected prefix (s3://bucket beside s3://bucket/train) is fine, since the store
    # refuses every write under a protected prefix; an output inside one, or a run that would write into one,
    # is refused here, before anything is stopped.
    assert config.run_id is not None
    write_roots = [
        config.output,
        store.url(RunLayout(config.run_id).root),
        store.url(f"datasets/{config.tokenize.dataset_name}"),
    ]
    for prefix in config.protected_prefixes:
        for root in write_roots:
            inside = normalise_url(root) == normalise_url(prefix) or normalise_url(root).startswith(
                normalise_url(prefix).rstrip("/") + "/"
            )
            if inside or (root != config.output and overlaps(root, prefix)):
                raise DatagenError(
                    f"this run would write under {root}, which overlaps the protected prefix {prefix}; "
                    "choose an `output` outside the existing data (e.g. s3://bucket/expansion)"
                )
    if config.output.startswith("s3://"):
        backend = store.backend
        bucket = getattr(backend, "bucket", None)
        if isinstance(backend, S3Backend):
            _head_output_bucket(config, store, backend)
        return f"bucket {bucket} reachable"
    path = Path(normalise_url(config.output))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DatagenError(f"cannot create output directory {path}: {error}") from None
    if not os.access(path, os.W_OK):
        raise DatagenError(
            f"output directory {path} is not writable; fix its permissions or choose another --output"
        )
    return f"writable directory {path}"


def _check_run_identity(config: RunConfig, store: Store) -> str:
    stored = check_run_config(store, config)
    return "new run" if stored is None else f"resuming run created {stored.created_at.isoformat()}"


def _check_write_once(config: RunConfig, store: Store) -> str:
    # Write-once rests on the store refusing to replace an object (S3: a PutObject with `If-None-Match: *`
    # answered 412; locally: a hard link that fails when the name exists). A store that ignores the condition
    # overwrites silently, so it is tried for real: a probe object under the run's folder, written twice with
    # different bytes; the second write must be refused. The probe stays (write-once itself; the manifest
    # lists it).
    assert config.run_id is not None
    layout = RunLayout(config.run_id)
    if store.exists(layout.manifest):
        return "not tried: the run is complete (nothing is written into a run that has its manifest)"
    token = f"{utc_now():%Y%m%d-%H%M%S}-{secrets.token_hex(WRITE_ONCE_PROBE_TOKEN_BYTES)}"
    key = layout.write_once_probe(token)
    store.write_json(key, {"probe": "write-once", "token": token, "write": 1})
    try:
        store.write_json(key, {"probe": "write-once", "token": token, "write": 2})
    except OutputExistsError:
        return f"an overwrite of {store.url(key)} was refused"
    raise DatagenError(
        f"the store overwrote {store.url(key)}, which existed: it ignores conditional writes, so nothing it "
        "holds is write-once; use a store that honours them (S3's PutObject with If-None-Match: * answered "
        "412 PreconditionFailed when the object exists), or a local folder"
    )


def _check_datasets(config: RunConfig, store: Store) -> str:
    # Read the first row of every source: a wrong path, an unreachable bucket or Hub, a file that is not its
    # layout's type all fail here, before training is stopped, instead of hours into the run.
    from datagen.errors import DatasetError
    from datagen.prompts.datasets import iter_rows

    problems = []
    for dataset in config.datasets:
        try:
            next(iter(iter_rows(dataset.path, limit=1, credentials=store.credentials)), None)
        except DatasetError as error:
            problems.append(f"{dataset.name}: {error}")
    if problems:
        raise DatagenError("; ".join(problems) + " (fix `datasets[].path`)")
    return f"{len(config.datasets)} dataset source(s) readable"


def _check_model(config: RunConfig, store: Store) -> str:
    from datagen.engines import engine_class

    model_path = Path(config.model.path)
    if engine_class(config.fleet.engine).launches_processes and not (model_path / "config.json").is_file():
        raise DatagenError(
            f"model directory {model_path} has no config.json; set `model.path` to a local model directory "
            "(download it before the run: GPU hosts may not reach the hub)"
        )
    from datagen.dataset.tokenizer import shared_spec

    location = Path(config.model.tokenizer)
    if location.is_dir() and not any((location / name).is_file() for name in TOKENIZER_FILES):
        # transformers would load *something* from config.json alone and then report a missing chat template.
        setting = "model.tokenizer_path" if config.model.tokenizer_path else "model.path"
        raise DatagenError(
            f"{setting} {location} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); copy the "
            "target's tokenizer there, or point `model.tokenizer_path` at a directory that has it"
        )
    # Read once for the flow process (exact-token generation and the merge reuse it); the Rust tokenizer is
    # built here so a corrupt tokenizer.json is refused before training is stopped.
    spec = shared_spec(config.model.tokenizer)
    if not spec.chat_template.strip():
        raise DatagenError(
            f"tokenizer {config.model.tokenizer} has no chat template; the training data must be rendered with "
            "the target's own template: point `model.tokenizer_path` at the target tokenizer"
        )
    try:
        spec.backend()
    except Exception as error:  # the Rust tokenizer's parse errors have no common type
        raise DatagenError(
            f"tokenizer {config.model.tokenizer}: its tokenizer.json does not load ({error}); copy the target's "
            "tokenizer files there again"
        ) from None
    return f"model {config.model.path}; tokenizer with chat template"


def _check_engine(config: RunConfig, store: Store) -> str:
    from datagen.engines import get_engine
    from datagen.engines.router import router_problems

    problems = get_engine(config.fleet.engine).check_available() + router_problems(config.fleet)
    if problems:
        raise DatagenError("; ".join(problems))
    return f"engine {config.fleet.engine} available"


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a hostname: it may resolve to any interface
        return False


def _check_server_access(config: RunConfig, store: Store) -> str:
    """Servers other machines can reach must require the API key, and the engine must be able to."""
    from datagen.engines import get_engine
    from datagen.settings import server_api_key

    engine = get_engine(config.fleet.engine)
    key = server_api_key()
    if not engine.launches_processes:
        return "requests carry DATAGEN_SERVER_API_KEY" if key else "no API key sent (none set)"
    host = config.fleet.host
    if key is None:
        if not _is_loopback(host):
            raise DatagenError(
                f"fleet.host {host!r} lets other machines reach the servers, and no API key is set: set "
                "DATAGEN_SERVER_API_KEY (the same on every box and on the parent), or bind the servers to "
                "127.0.0.1"
            )
        return "servers listen on the loopback address only"
    if engine.api_key_args("key-file") is None:
        if not _is_loopback(host):
            raise DatagenError(
                f"fleet.engine {engine.name} cannot require an API key and fleet.host {host!r} lets other "
                "machines reach its servers: bind them to 127.0.0.1, or serve with fleet.engine: sglang"
            )
        return f"servers listen on the loopback address only ({engine.name} does not check API keys)"
    if "--config" in config.fleet.extra_args:
        raise DatagenError(
            "fleet.extra_args passes --config, and datagen gives sglang its API key in a --config file of its "
            "own (sglang takes one): move those options into fleet.sglang or fleet.extra_args, or unset "
            "DATAGEN_SERVER_API_KEY"
        )
    if config.fleet.router:
        raise DatagenError(
            "fleet.router is on and DATAGEN_SERVER_API_KEY is set: the router does not send the key to its "
            "workers; turn the router off (the dispatcher spreads requests itself) or unset the key"
        )
    return "servers require DATAGEN_SERVER_API_KEY (given to each in an owner-only file)"


def _check_generation_mode(config: RunConfig, store: Store) -> str:
    from datagen.engines import exact_tokens_enabled

    if exact_tokens_enabled(config):
        return "exact tokens: prompt ids to /generate, the answers' output ids kept verbatim"
    return "chat completions: answers re-tokenized from their text at the merge"


def _check_training(config: RunConfig, store: Store) -> str:
    from datagen.host.training import validate_training_job

    problems = validate_training_job(config.training)
    pidfile = config.training.pidfile
    assert config.run_id is not None
    existing = read_stored_config(store, config.run_id)
    if problems and existing is not None and pidfile and not Path(pidfile).exists():
        # An earlier attempt of this run halted the trainer, which may have removed its pidfile: nothing to stop.
        return f"pidfile {pidfile} is gone: the trainer was halted by an earlier attempt of this run"
    if problems:
        raise DatagenError("; ".join(problems))
    return _training_job_state(config)


def _training_job_state(config: RunConfig) -> str:
    """Say whether the job the config names runs now; warn when it does not (nothing will be halted)."""
    from datagen.host.training_jobs import job_for

    if config.training.kind not in {"pidfile", "systemd"}:  # the others need nvidia-smi or the Prefect API
        return f"training job: {config.training.kind}"
    handle = job_for(config.training)
    if handle is None:
        return f"training job: {config.training.kind}"
    target = handle.find()
    if target.running:
        _refuse_the_trainers_environment(target.pids)
        return f"training job running: {target.description}"
    logger.warning(
        "training job named by the config is not running kind=%s target=%r: nothing will be halted; if "
        "training holds the GPUs, fix `training` in the config",
        config.training.kind,
        target.description,
    )
    return f"training job NOT running ({target.description}): nothing to halt"


def _refuse_the_trainers_environment(pids: list[int]) -> None:
    """Refuse when datagen runs in (or imports from) the training job's Python environment.

    Installing datagen and its serving stack there once moved the trainer's torch to another CUDA build and
    the restarted training ran out of memory; the serving stack belongs in an environment of its own.
    """
    from datagen.host.trainer_env import is_standin_trainer, read_process_environment, shares_environment

    if not pids or is_standin_trainer(pids[0]):
        return  # datagen's own stand-in (the demo, the tests): part of datagen, nothing of a trainer's to keep
    trainer = read_process_environment(pids[0])
    if trainer is None:
        return
    shared = shares_environment(trainer)
    if shared is not None:
        raise DatagenError(
            f"{shared}: installing or upgrading datagen's serving stack there changes what training restarts "
            "with. Install datagen into an environment of its own (python3 -m venv ~/datagen-venv, then "
            "install requirements/gpu.txt and datagen there: docs/operations.md#environments) and run it from there"
        )


def _check_external_servers(config: RunConfig, store: Store) -> str:
    # External servers must answer now: the fleet's readiness wait (ready_timeout_s, minutes) would only
    # notice after training was halted.
    from datagen.engines import engine_class, exact_tokens_enabled

    if engine_class(config.fleet.engine).launches_processes:
        return "no external servers"
    import httpx

    from datagen.errors import ConfigError
    from datagen.generation.sglang_generate import GENERATE_PATH

    try:
        exact_tokens = exact_tokens_enabled(config)
    except ConfigError:
        exact_tokens = False  # the generation mode check reports it
    timeout = httpx.Timeout(PREFLIGHT_SERVER_READ_TIMEOUT_S, connect=PREFLIGHT_SERVER_CONNECT_TIMEOUT_S)
    unreachable = []
    without_generate = []
    with httpx.Client(timeout=timeout) as client:
        for url in config.fleet.external_urls:
            try:
                client.get(url)  # any HTTP answer means a server listens there
                # SGLang (and its router) route /generate for POST only: a GET is refused with 405, while a
                # server without the route answers 404. Every request would fail there, so say it now.
                if exact_tokens and client.get(url.rstrip("/") + GENERATE_PATH).status_code == HTTP_NOT_FOUND:
                    without_generate.append(url)
            except httpx.HTTPError as error:
                unreachable.append(f"{url} ({type(error).__name__})")
    if unreachable:
        raise DatagenError(
            f"external server(s) not answering within {PREFLIGHT_SERVER_CONNECT_TIMEOUT_S:.0f}s: "
            f"{', '.join(unreachable)}; start them, or fix `fleet.external_urls`"
        )
    if without_generate:
        raise DatagenError(
            f"generation.exact_tokens is true but external server(s) {', '.join(without_generate)} have no "
            f"{GENERATE_PATH} endpoint (404): set generation.exact_tokens: false for servers that speak only "
            "the OpenAI chat API, or point `fleet.external_urls` at SGLang servers (or their router)"
        )
    return f"{len(config.fleet.external_urls)} external server(s) answering"


def _check_gpu_lock(config: RunConfig, store: Store) -> str:
    # The lock is taken right before training is halted; a user who cannot open it must hear so now.
    from datagen.host.gpu_lock import host_lock_path, open_lock_file

    path = host_lock_path()
    os.close(open_lock_file(path))
    return f"the box's GPU lock {path} opens"


def _check_base_version(config: RunConfig, store: Store) -> str:
    if not config.tokenize.base_version:
        return "none (a first dataset version)"
    from datagen.dataset.versions import read_base_version

    url, version = read_base_version(store, config.tokenize.base_version)
    return f"extends {url} ({version.rows} rows)"


# Each check, and whether it reads the output store (skipped, not failed, when that is unreachable: one
# cause is reported once; run with a client that retries a transient S3 error a few times).
CHECKS: list[tuple[str, Callable[[RunConfig, Store], str], bool]] = [
    ("mix", _check_mix, False),
    ("output location", _check_output_location, False),
    ("run identity", _check_run_identity, True),
    ("datasets readable", _check_datasets, False),
    ("model and tokenizer", _check_model, False),
    ("engine", _check_engine, False),
    ("server access", _check_server_access, False),
    ("generation mode", _check_generation_mode, False),
    ("external servers", _check_external_servers, False),
    ("base dataset version", _check_base_version, True),
    ("training job", _check_training, True),
    ("gpu lock", _check_gpu_lock, False),
    # The one check that writes (a probe object in the run's folder), last: a run any other check refuses
    # leaves nothing behind.
    ("write-once", _check_write_once, True),
]


# Checks that write, and the checks that must pass first: nothing is written for a run refused anyway.
NEEDS: dict[str, tuple[str, ...]] = {
    "write-once": tuple(name for name, _, _ in CHECKS if name != "write-once")
}


# Checks of the box that generates. In a multi-host run each host part runs them on its own box (with its
# fleet and training job); the parent, which serves nothing and halts nothing, skips the serving-only ones.
HOST_CHECKS: frozenset[str] = frozenset(
    {
        "model and tokenizer",
        "engine",
        "server access",
        "generation mode",
        "external servers",
        "training job",
        "gpu lock",
    }
)
SERVING_ONLY_CHECKS: frozenset[str] = frozenset(
    {"engine", "server access", "external servers", "training job", "gpu lock"}
)


def run_host_preflight(config: RunConfig, credentials: S3Credentials | None = None) -> PreflightReport:
    """The checks of one box of a multi-host run (``config`` as :meth:`RunConfig.for_host` gives it).

    Args:
        config: The host part's config.
        credentials: S3 credentials (None: the standard AWS chain).

    Raises:
        PreflightError: At least one check failed.
    """
    return run_preflight(config, only=HOST_CHECKS, credentials=credentials)


def run_preflight(
    config: RunConfig, only: frozenset[str] | None = None, *, credentials: S3Credentials | None = None
) -> PreflightReport:
    """Run every check and raise one error listing all failures.

    With ``config.hosts`` the checks of the serving box are left to each host part
    (:func:`run_host_preflight`).

    Args:
        config: The run config with its run id resolved.
        only: Run only the checks with these names.
        credentials: S3 credentials for the output and s3:// datasets (None: the standard AWS chain).

    Returns:
        The report (all checks passed).

    Raises:
        PreflightError: At least one check failed; ``problems`` has one line per failure with its fix.
    """
    assert config.run_id is not None
    report = PreflightReport(run_id=config.run_id)
    store = preflight_store(config, credentials, max_attempts=PREFLIGHT_S3_READ_ATTEMPTS)
    unreachable = False
    for name, check, reads_output in CHECKS:
        if (only is not None and name not in only) or (
            only is None and config.hosts and name in SERVING_ONLY_CHECKS
        ):
            continue
        if reads_output and unreachable:
            skipped = Check(
                name=name, ok=False, skipped=True, detail="not checked: the output is unreachable"
            )
            report.checks.append(skipped)
            continue
        failed = [check.name for check in report.checks if not check.ok and check.name in NEEDS.get(name, ())]
        if failed:
            detail = f"not tried: {', '.join(failed)} failed (nothing is written for a refused run)"
            report.checks.append(Check(name=name, ok=False, skipped=True, detail=detail))
            continue
        try:
            detail, ok = check(config, store), True
        except StorageUnreachableError as error:
            detail, ok, unreachable = str(error), False, True
        except DatagenError as error:
            detail, ok = str(error), False
        except Exception as error:
            detail, ok = f"{type(error).__name__}: {error}", False
        report.checks.append(Check(name=name, ok=ok, detail=detail))
        logger.info("preflight check=%r ok=%s %s", name, ok, detail)
    if report.problems:
        raise PreflightError(report.problems)
    return report


def _describe_short_dataset(dataset: DatasetConfig, prepared: PreparedDataset) -> str:
    """Why a dataset yields too few prompts: its counts, its rejections by reason and one rejected row."""
    rejections = ", ".join(f"{reason}={count}" for reason, count in sorted(prepared.rejections.items()))
    line = (
        f"dataset {dataset.name!r} ({dataset.format} at {dataset.path}) yields {prepared.prompts} prompt(s), "
        f"fewer than its min_prompts {dataset.min_prompts}: {prepared.rows_read} row(s) read"
    )
    line += f", rejected {rejections}" if rejections else ", none rejected"
    if prepared.rejection_samples:
        sample = prepared.rejection_samples[0]
        line += f"; e.g. row {sample.get('source_index')} ({sample.get('reason')}: {sample.get('detail')})"
        if sample.get("example"):
            line += f": {sample['example']}"
    return line + (
        f". Check `datasets[].path` and `format` (`datagen datasets inspect --format {dataset.format} "
        f"{dataset.path}` lists every rejection), or lower `min_prompts`"
    )


def check_prompts(
    config: RunConfig,
    prepared: Sequence[PreparedDataset],
    unprepared: Mapping[str, str] | None = None,
) -> Check:
    """Refuse the run when a dataset could not be prepared or yields fewer prompts than its ``min_prompts``.

    Runs after every dataset's prompt shards are written and before training is halted, so a dataset of
    random bytes, of rows without a user turn or in another layout stops the run while training still runs.

    Args:
        config: The run config.
        prepared: The summaries of the datasets that were prepared.
        unprepared: Dataset name -> why its preparation failed, for the datasets that were not.

    Returns:
        The passed check (counts per dataset).

    Raises:
        PreflightError: One problem per dataset that could not be prepared or yields too few prompts.
    """
    by_name = {item.dataset: item for item in prepared}
    problems = [
        f"dataset {name!r} could not be prepared: {error}" for name, error in (unprepared or {}).items()
    ]
    for dataset in config.datasets:
        item = by_name.get(dataset.name)
        if item is not None and item.prompts < dataset.min_prompts:
            problems.append(_describe_short_dataset(dataset, item))
    if problems:
        raise PreflightError(problems)
    counts = ", ".join(f"{item.dataset}={item.prompts}" for item in prepared)
    check = Check(name="prompts prepared", ok=True, detail=f"prompts per dataset: {counts}")
    logger.info("preflight check=%r ok=True %s", check.name, check.detail)
    return check
