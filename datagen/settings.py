"""Environment settings and secrets (prefix ``DATAGEN_``), separate from the per-run config.

Per-run knobs live in :class:`datagen.config.RunConfig` (a flow parameter, shown in the UI). What belongs
to the host or is secret lives here and is read from the environment, never logged.
"""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Host-level settings, read from ``DATAGEN_*`` environment variables."""

    model_config = SettingsConfigDict(env_prefix="DATAGEN_", env_nested_delimiter="__", extra="ignore")

    state_dir: str = Field(
        default="~/.datagen", description="Per-user host state: server pidfiles and server logs."
    )
    lock_dir: str = Field(
        default="/run/lock/datagen",
        description="The box's GPU lock and training-halt record, shared by every user, container and worker "
        "of the box whatever their state_dir (created world-writable when missing, so any user's run can take "
        "the lock; an operator may create it instead, owned by a group every datagen user is in, mode 2775). "
        "Override only for tests or when /run/lock is not shared (a container: bind-mount the host's folder).",
    )
    s3_endpoint_url: str | None = Field(
        default=None, description="Endpoint of an S3-compatible store (MinIO, moto, R2); AWS when unset."
    )
    s3_region: str | None = Field(default=None, description="S3 region; the AWS chain's when unset.")
    aws_credentials_block: str | None = Field(
        default=None,
        description=(
            "Name of a Prefect AwsCredentials block to take S3 credentials from (read by the flow through "
            "the Prefect API; prefect-aws need not be installed). Unset: the standard AWS chain "
            "(AWS_* environment variables, AWS_PROFILE and ~/.aws files, an instance or container role)."
        ),
    )
    server_api_key: SecretStr | None = Field(
        default=None, description="API key the generation servers require (sent as a bearer token)."
    )
    gpu_lock: str | None = Field(
        default=None,
        description="Name of this host's GPU lock, a file lock every run on the host's GPUs holds "
        "(`<lock_dir>/<name>.lock`; one run at a time, whatever the deployment or user); "
        "`datagen-gpus-<hostname>` when unset. Runs that share GPUs must share the name and the lock dir.",
    )
    gpu_lock_timeout_s: float = Field(
        default=24 * 3600.0,
        gt=0,
        description="How long a run waits for the GPUs while another run holds them before it fails.",
    )
    progress_interval_s: float = Field(
        default=5.0,
        gt=0,
        le=10,
        description="How often a run refreshes its progress artifact and progress log line while generating.",
    )


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, read once from the environment."""
    return Settings()


def server_api_key() -> str | None:
    """``DATAGEN_SERVER_API_KEY`` in clear: for the servers datagen launches and the requests it sends."""
    key = get_settings().server_api_key
    return key.get_secret_value() if key else None
