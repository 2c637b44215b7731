"""Every error datagen raises on purpose, in one place.

One base class, :class:`DatagenError`. Each subclass also inherits the builtin that matches its meaning
(so ``except FileExistsError`` still works), carries its context as attributes, and says whether it is
*transient* (worth retrying: a flaky network, a server restarting) or *fatal* (stop and explain). The
message of a fatal error always says what to do next.
"""

from __future__ import annotations

import errno
from typing import Any


class DatagenError(Exception):
    """Base of every datagen error.

    Attributes:
        transient: True when retrying the same operation may succeed.
    """

    transient: bool = False

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.context = context

    def __str__(self) -> str:
        return self.message


class TransientError(DatagenError):
    """An error that a retry may cure (network blip, 5xx, server restarting, write conflict)."""

    transient = True


# --- configuration and validation -------------------------------------------------------------


class ConfigError(DatagenError, ValueError):
    """The run configuration is invalid; the message names the field and the fix."""


class RunConfigMismatchError(DatagenError, ValueError):
    """A run id already exists in storage with a different configuration."""

    def __init__(self, message: str, *, run_id: str, stored_hash: str, new_hash: str) -> None:
        super().__init__(message, run_id=run_id, stored_hash=stored_hash, new_hash=new_hash)
        self.run_id = run_id
        self.stored_hash = stored_hash
        self.new_hash = new_hash


class PreflightError(DatagenError, RuntimeError):
    """One or more checks failed before anything was stopped or started.

    Attributes:
        problems: One human-readable line per failed check, each with its fix.
    """

    def __init__(self, problems: list[str]) -> None:
        if len(problems) == 1:
            message = f"Preflight refused the run; nothing was stopped or started: {problems[0]}"
        else:
            lines = "\n".join(f"  - {problem}" for problem in problems)
            message = f"Preflight found {len(problems)} problems; nothing was stopped or started:\n{lines}"
        super().__init__(message, problems=problems)
        self.problems = problems


# --- storage ----------------------------------------------------------------------------------


class StorageError(DatagenError, OSError):
    """A storage operation failed for a reason a retry will not fix."""


class TransientStorageError(TransientError, OSError):
    """A storage operation failed for a reason a retry may fix (5xx, reset, concurrent create)."""


class UnfixableStorageError(StorageError):
    """A write that retrying cannot fix (no space, no permission, the bucket gone): the run stops new work.

    Attributes (in ``context``): ``where``, the path or bucket; ``cause``, the error's name (errno or S3 code).
    """


class StorageUnreachableError(DatagenError, ConnectionError):
    """The storage endpoint did not answer within the quick probe's timeouts (preflight)."""


class OutputExistsError(DatagenError, FileExistsError):
    """A write-once object already exists; datagen never overwrites anything."""

    def __init__(self, url: str) -> None:
        super().__init__(
            f"Refusing to overwrite existing object {url}: datagen writes every object exactly once.",
            url=url,
        )
        self.url = url


class ProtectedPrefixError(DatagenError, PermissionError):
    """A write was aimed under a protected prefix (the existing training data)."""

    def __init__(self, url: str, prefix: str) -> None:
        super().__init__(
            f"Refusing to write {url}: it lies under the protected prefix {prefix}. "
            "Choose an output location outside every entry of `protected_prefixes`.",
            url=url,
            prefix=prefix,
        )
        self.url = url
        self.prefix = prefix


# --- datasets and prompts ---------------------------------------------------------------------


class DatasetError(DatagenError, ValueError):
    """A dataset source cannot be read at all (missing file, wrong format); bad rows are counted instead."""


# --- engines, servers, generation -------------------------------------------------------------


class ServerStartError(DatagenError, RuntimeError):
    """A generation server did not become ready; the message quotes its log."""


class TransientRequestError(TransientError, RuntimeError):
    """A generation request failed in a way a retry may fix (connection reset, 5xx, empty body)."""


class TuneFailedError(DatagenError, RuntimeError):
    """No level of a ``datagen tune`` sweep got usable answers: nothing is recommended or written.

    Every request failed, or every answer carried no output tokens: a result built from that would hand the
    planner a cap measured on nothing, so the command fails instead (the message names the first failure).
    """


class NoLiveServersError(DatagenError, RuntimeError):
    """Every server of the fleet is down and none came back within the deadline."""


class ShardsFailedError(DatagenError, RuntimeError):
    """Shards of a run failed after their retries; everything else is stored and a rerun resumes.

    Attributes:
        run_id: The run to rerun.
        failed_shards: How many shard tasks failed.
    """

    def __init__(self, message: str, *, run_id: str, failed_shards: int) -> None:
        super().__init__(message, run_id=run_id, failed_shards=failed_shards)
        self.run_id = run_id
        self.failed_shards = failed_shards


# --- training job, host -----------------------------------------------------------------------


class TrainingHaltError(DatagenError, RuntimeError):
    """The training job could not be stopped as configured."""


class TrainingNotRestartedError(DatagenError, RuntimeError):
    """The run's data is complete, but training was not restarted (the halt record is kept for a later run)."""


class TrainingEnvironmentChangedError(TrainingNotRestartedError):
    """Training was not restarted: its environment changed since the halt (the halt record is kept)."""

    def __init__(self, message: str, *, changes: list[str]) -> None:
        super().__init__(message)
        self.changes = changes


class TrainingStillRunningError(TrainingNotRestartedError):
    """Training was not restarted: a process of the halted job, or the job itself, still runs."""

    def __init__(self, message: str, *, pids: list[int]) -> None:
        super().__init__(message)
        self.pids = pids


class ProbeError(DatagenError, RuntimeError):
    """The environment probe could not read what it needs."""


class PlanError(DatagenError, ValueError):
    """No server plan fits this host and model (e.g. the model does not fit in GPU memory)."""


# --- tokenize and merge -----------------------------------------------------------------------


class TokenizeError(DatagenError, ValueError):
    """A completion cannot be rendered or masked with the target tokenizer's chat template."""


class NoTrainingRowsError(TokenizeError):
    """Every completion a merge read was dropped: no version is published, and a resume would end the same.

    The answers stay stored; what makes rows is another run (a larger ``max_tokens``, other merge settings), so
    the message names that instead of a resume command.
    """


# --- interruption --------------------------------------------------------------------------------


class RunInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: stop the servers, keep what is stored, exit ``128 + signal``.

    Not a :class:`DatagenError`: like Ctrl-C's ``KeyboardInterrupt`` (its base), it must pass through every
    ``except Exception`` on its way out, so nothing mistakes it for a failure to retry or to record.

    Attributes:
        signum: The signal that arrived.
    """

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        super().__init__(f"interrupted by {self.signal_name}")


class RunCancelled(DatagenError):
    """The run was cancelled through the Prefect API: it stopped its servers and handed training back.

    Everything finished so far is stored; the run resumes with its run id.
    """


# HTTP answers a retry can cure, for every client datagen has (the dispatcher's servers, S3): 5xx, and the
# 4xx that say "not now" (408 request timeout, 409 a conflicting request still in progress, 429 slow down).
RETRYABLE_HTTP_4XX = frozenset({408, 409, 429})
HTTP_SERVER_ERROR = 500


def is_transient_http_status(status: int) -> bool:
    """Tell whether an HTTP answer with ``status`` is worth retrying (5xx, 408, 409, 429)."""
    return status >= HTTP_SERVER_ERROR or status in RETRYABLE_HTTP_4XX


def is_transient(error: BaseException) -> bool:
    """Tell whether retrying the operation that raised ``error`` may succeed.

    Args:
        error: Any exception.

    Returns:
        True for datagen's transient errors and for the builtin network errors a retry can cure.
    """
    if isinstance(error, DatagenError):
        return error.transient
    return isinstance(error, ConnectionError | TimeoutError)


# Local errors and S3 codes of a storage fault that no retry cures: the operator must act (free space, fix the
# permissions or credentials, create the bucket).
UNFIXABLE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS})
UNFIXABLE_S3_CODES = frozenset({"NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "AllAccessDisabled"})


def unfixable_storage_error(error: BaseException, where: str) -> UnfixableStorageError | None:
    """``error`` as an :class:`UnfixableStorageError` when retrying cannot fix it, else None.

    Args:
        error: What a storage write raised.
        where: The path or bucket written to, for the message.
    """
    if isinstance(error, UnfixableStorageError):
        return error
    cause = ""
    if isinstance(error, StorageError) and error.context.get("code") in UNFIXABLE_S3_CODES:
        cause = str(error.context["code"])
    elif (
        not isinstance(error, DatagenError) and isinstance(error, OSError) and error.errno in UNFIXABLE_ERRNOS
    ):
        cause = f"{errno.errorcode.get(error.errno or 0, error.errno)} ({error.strerror})"
    if not cause:
        return None
    fix = {
        "NoSuchBucket": "create the bucket or fix `output`",
        "AccessDenied": "give the run's credentials write access to it",
        "InvalidAccessKeyId": "fix the S3 credentials",
        "AllAccessDisabled": "re-enable access to the bucket",
    }.get(cause, "free space or fix the permissions there")
    return UnfixableStorageError(
        f"storage write failed and retrying cannot fix it: {cause} at {where}; {fix}, then resume "
        "(everything stored is kept, no new shard was started)",
        where=where,
        cause=cause,
    )


# --- operations: deployments, series, the GPU lock -----------------------------------------------


class CodeVersionError(DatagenError, RuntimeError):
    """The worker's checkout is not the commit the deployment names (update the checkout, or redeploy)."""


class JobVariablesError(DatagenError, PermissionError):
    """A run sent job variables its work pool keeps for the box (the command, its environment, its folder)."""


class RunOriginRefusedError(ConfigError):
    """A run's creation asked what its caller may not choose (retries, a work queue), or a host part has no parent.

    Nothing was halted or started.
    """


class RunLeaseHeldError(ConfigError):
    """Another flow run holds the run id's lease: one run id has one runner at a time."""


class SeriesConflictError(DatagenError, RuntimeError):
    """Two runs of one expansion series took the same prompts (they ran at once on different hosts)."""


class HostsUnavailableError(DatagenError, RuntimeError):
    """A multi-host run has no host left to generate on (none came up, or every one was lost)."""


class GpuLockTimeoutError(DatagenError, TimeoutError):
    """Another run kept this host's GPUs for longer than the run was allowed to wait."""


class GpuLockUnavailableError(DatagenError, PermissionError):
    """The box's GPU lock file cannot be opened by this user: the run refuses before it halts anything."""


class TooManyFailuresError(DatagenError, RuntimeError):
    """More requests failed than ``generation.max_failed_share`` allows (or a whole dataset failed).

    Nothing is published; every result stays stored, so the run resumes or retries its failures.

    Attributes:
        retryable: Failures ``--retry-failed`` would send again: when there are any, the one resume command
            is the run's with ``--retry-failed`` (a plain resume would end the same way).
    """

    def __init__(self, message: str, *, retryable: int = 0, **context: Any) -> None:
        super().__init__(message, retryable=retryable, **context)
        self.retryable = retryable


class WindowClosingError(DatagenError, TimeoutError):
    """Admission stopped because the run's generation window is closing; the next attempt sends the rest."""


class WindowEndedError(DatagenError):
    """The generation window ended the run before every request was answered; training runs again.

    Everything answered is stored, and the shards finished so far are published as a dataset version (the
    run's first merge round): the run's next attempt (the same run id) sends exactly the requests left, then
    publishes the rest as the next version on top of it.

    Attributes:
        unsent: Requests left for the next attempt.
        requests: The run's requests in all.
        published: The URL of the dataset version published with what was generated (None: nothing yet).
        published_rows: The rows this run added to that version.
        unpublished_because: Why nothing was published (no shard finished, too many failures, every finished
            answer dropped); None when something was.
    """

    def __init__(
        self,
        message: str,
        *,
        unsent: int,
        requests: int,
        published: str | None = None,
        published_rows: int = 0,
        unpublished_because: str | None = None,
        **context: Any,
    ) -> None:
        super().__init__(
            message,
            unsent=unsent,
            requests=requests,
            published=published,
            published_rows=published_rows,
            unpublished_because=unpublished_because,
            **context,
        )
        self.unpublished_because = unpublished_because
        self.unsent = unsent
        self.requests = requests
        self.published = published
        self.published_rows = published_rows
