"""S3 clients for every stage: endpoint, region and credentials resolved in one place for boto3 and s3fs.

Credentials come from the standard AWS chain, or from explicit :class:`S3Credentials` handed to each client
(the orchestration layer reads them from a Prefect AwsCredentials block and passes them down: there is no
process-wide default). Secrets never reach reprs, logs or error messages.
Every retry botocore makes is logged with its cause.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from datagen.errors import is_transient_http_status

logger = logging.getLogger(__name__)

# Attempts per S3 request in botocore's standard retry mode (exponential backoff with jitter, at most
# 20 s apart): it absorbs throttling, 5xx answers and connection resets before we ever see them.
S3_MAX_ATTEMPTS = 10
# Times a GET's body may be cut short mid-stream before the read gives up (each time the rest is asked
# for again with a ranged GET; botocore's own retries end once the response headers arrived).
S3_BODY_READ_ATTEMPTS = 3
# Read buffer of S3 object streams (JSON-lines iteration reads through it).
S3_READ_BUFFER_BYTES = 1024 * 1024
HTTP_NOT_FOUND = 404
HTTP_PRECONDITION_FAILED = 412
THROTTLE_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestLimitExceeded"}
)
# The names boto3's Session and s3fs give the same credentials: profile, key id, secret, session token.
BOTO3_NAMES = ("profile_name", "aws_access_key_id", "aws_secret_access_key", "aws_session_token")
S3FS_NAMES = ("profile", "key", "secret", "token")
# Key in botocore's per-request context where the failure of the previous attempt is kept for the log.
RETRY_CAUSE_CONTEXT_KEY = "datagen_retry_cause"


def error_facts(error: Exception) -> tuple[str, int]:
    """The S3 error code and HTTP status of a botocore ClientError (empty and 0 when absent)."""
    response: dict[str, Any] = getattr(error, "response", {}) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def is_transient_status(code: str, status: int) -> bool:
    """Whether an S3 answer is worth retrying: the HTTP rule every client shares, or a throttling code."""
    return is_transient_http_status(status) or code in THROTTLE_CODES


class S3Credentials(BaseModel):
    """Explicit S3 credentials, for when the standard AWS chain is not what should be used.

    Either a key pair (with an optional session token) or a named profile. The secrets are ``SecretStr``:
    they never appear in a repr, a log line or an error message.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    access_key_id: str | None = Field(default=None, description="AWS access key id.")
    secret_access_key: SecretStr | None = Field(default=None, description="AWS secret access key.")
    session_token: SecretStr | None = Field(default=None, description="Token of temporary credentials.")
    profile_name: str | None = Field(default=None, description="A profile of ~/.aws/config to use instead.")
    region: str | None = Field(default=None, description="Region these credentials belong to, if any.")
    endpoint_url: str | None = Field(default=None, description="S3-compatible endpoint they are for.")

    @model_validator(mode="after")
    def _key_pair_complete(self) -> S3Credentials:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("give both access_key_id and secret_access_key, or neither")
        return self

    def revealed_json(self) -> str:
        """The credentials as JSON with the secrets in clear text (``model_validate_json`` reads it back).

        Only for handing them to a child process (through its environment, never a file or a log).
        """
        data = self.model_dump(mode="python", exclude_none=True)
        for name in ("secret_access_key", "session_token"):
            if isinstance(data.get(name), SecretStr):
                data[name] = data[name].get_secret_value()
        return json.dumps(data)


def _describe_failure(response: Any, caught_exception: BaseException | None) -> str | None:
    """What went wrong in one attempt, without anything secret (class name, status, S3 error code)."""
    if caught_exception is not None:
        return type(caught_exception).__name__
    if response is None:
        return None
    http_response, parsed = response
    status = int(getattr(http_response, "status_code", 0) or 0)
    code = str((parsed or {}).get("Error", {}).get("Code", ""))
    if is_transient_status(code, status):
        return f"{status} {code}".strip()
    return None


def _record_failure(
    response: Any = None,
    caught_exception: BaseException | None = None,
    request_dict: dict[str, Any] | None = None,
    **_: Any,
) -> None:
    """``needs-retry`` hook: remember why an attempt failed, for the retry's log line."""
    cause = _describe_failure(response, caught_exception)
    if cause and request_dict is not None:
        request_dict.setdefault("context", {})[RETRY_CAUSE_CONTEXT_KEY] = cause


def _log_retry(
    request: Any = None, operation_name: str = "", max_attempts: int = S3_MAX_ATTEMPTS, **_: Any
) -> None:
    """``request-created`` hook: log every attempt after the first, with the cause of the one before."""
    context = getattr(request, "context", None) or {}
    attempt = int(context.get("retries", {}).get("attempt", 1))
    if attempt > 1:
        logger.warning(
            "s3 retry operation=%s attempt=%d max_attempts=%d cause=%s",
            operation_name,
            attempt,
            max_attempts,
            context.get(RETRY_CAUSE_CONTEXT_KEY, "unknown"),
        )


def install_retry_logging(client: Any) -> None:
    """Log each botocore retry of ``client`` (idempotent: installing twice logs once)."""
    configured = getattr(client.meta.config, "retries", None) or {}
    max_attempts = int(configured.get("total_max_attempts") or S3_MAX_ATTEMPTS)
    events = client.meta.events
    events.register("needs-retry.s3", _record_failure, unique_id="datagen-record-failure")
    events.register(
        "request-created.s3",
        functools.partial(_log_retry, max_attempts=max_attempts),
        unique_id="datagen-log-retry",
    )


@dataclass(frozen=True)
class _S3Target:
    """Where and as whom to reach S3, resolved once for boto3 and s3fs alike (holds secrets: never log)."""

    endpoint_url: str | None
    region: str | None
    profile_name: str | None
    key_pair: tuple[str, str] | None
    session_token: str | None


def _resolve_s3_target(
    endpoint_url: str | None, region: str | None, credentials: S3Credentials | None
) -> _S3Target:
    """Apply the precedence rules: explicit argument, then ``DATAGEN_S3_*``, then the credentials' own values."""
    from datagen.settings import get_settings

    settings = get_settings()
    chosen = credentials
    key_pair = None
    token = None
    if chosen is not None and chosen.access_key_id and chosen.secret_access_key:
        key_pair = (chosen.access_key_id, chosen.secret_access_key.get_secret_value())
        token = chosen.session_token.get_secret_value() if chosen.session_token else None
    return _S3Target(
        endpoint_url=endpoint_url or settings.s3_endpoint_url or (chosen.endpoint_url if chosen else None),
        region=region or settings.s3_region or (chosen.region if chosen else None),
        profile_name=chosen.profile_name if chosen else None,
        key_pair=key_pair,
        session_token=token,
    )


@functools.cache
def _shared_data_loader() -> Any:
    """One botocore data loader for every client this process makes.

    Each new botocore session otherwise parses the S3 service model and the endpoint rules (megabytes of JSON)
    again, for every client a run makes. The loader only caches those read-only files; credentials, region and
    configuration stay per session, so nothing else is shared.
    """
    from botocore.loaders import create_loader

    return create_loader()


def make_s3_client(
    endpoint_url: str | None = None,
    region: str | None = None,
    credentials: S3Credentials | None = None,
    *,
    max_attempts: int = S3_MAX_ATTEMPTS,
    connect_timeout_s: float | None = None,
    read_timeout_s: float | None = None,
) -> Any:
    """An S3 client (botocore) with botocore's standard retry mode and logged retries.

    Credentials come from ``credentials`` when given (e.g. read from a Prefect AwsCredentials block by the
    flow), else from the standard AWS chain (``AWS_*`` environment variables, ``AWS_PROFILE`` and the shared
    config files, an instance or container role).

    Args:
        endpoint_url: An S3-compatible endpoint; else ``DATAGEN_S3_ENDPOINT_URL``, else the credentials'
            endpoint, else AWS.
        region: The region; else ``DATAGEN_S3_REGION``, else the credentials' region, else the chain's.
        credentials: Explicit credentials for this client; None for the standard AWS chain.
        max_attempts: Attempts per request (botocore's standard retry mode); fewer for a quick probe.
        connect_timeout_s: Seconds to establish a connection; botocore's default (60) when None.
        read_timeout_s: Seconds to wait for an answer on a connection; botocore's default (60) when None.
    """
    import botocore.session
    from botocore.config import Config

    target = _resolve_s3_target(endpoint_url, region, credentials)
    # A plain botocore session (what boto3.Session wraps; it adds only resource and transfer helpers we do not
    # use), sharing the process's data loader.
    session = botocore.session.get_session()
    session.register_component("data_loader", _shared_data_loader())
    options = _credential_options(target, BOTO3_NAMES)
    if "profile_name" in options:
        session.set_config_variable("profile", options.pop("profile_name"))
    # total_max_attempts counts the first attempt too (botocore's max_attempts counts only retries).
    config = Config(retries={"mode": "standard", "total_max_attempts": max_attempts})
    timeouts: dict[str, Any] = {}
    if connect_timeout_s is not None:
        timeouts["connect_timeout"] = connect_timeout_s
    if read_timeout_s is not None:
        timeouts["read_timeout"] = read_timeout_s
    if timeouts:
        config = config.merge(Config(**timeouts))
    client = session.create_client(
        "s3", endpoint_url=target.endpoint_url, region_name=target.region, config=config, **options
    )
    install_retry_logging(client)
    return client


def s3_storage_options(credentials: S3Credentials | None = None) -> dict[str, Any]:
    """Options for fsspec/s3fs matching :func:`make_s3_client`: endpoint, region, credentials, retries.

    Pass them to ``fsspec.open``/``fsspec.filesystem("s3", ...)`` so reads through s3fs use the same
    endpoint and credentials as the store, and botocore's standard retry mode. The result holds secrets:
    hand it to fsspec, never log it.
    """
    target = _resolve_s3_target(None, None, credentials)
    client_kwargs: dict[str, Any] = {}
    if target.endpoint_url:
        client_kwargs["endpoint_url"] = target.endpoint_url
    if target.region:
        client_kwargs["region_name"] = target.region
    return {
        "client_kwargs": client_kwargs,
        "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": S3_MAX_ATTEMPTS}},
        **_credential_options(target, S3FS_NAMES),
    }


def _credential_options(target: _S3Target, names: tuple[str, str, str, str]) -> dict[str, Any]:
    """The target's profile or key pair (and token) under the option ``names`` of boto3 or s3fs."""
    profile, key, secret, token = names
    options: dict[str, Any] = {}
    if target.profile_name:
        options[profile] = target.profile_name
    if target.key_pair:
        options[key], options[secret] = target.key_pair
        if target.session_token:
            options[token] = target.session_token
    return options
