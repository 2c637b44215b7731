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
        default="~/.datagen", description="Host-local state: server pidfiles, server logs, locks."
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
        "(`<state_dir>/locks/<name>.lock`; one run at a time, whatever the deployment); "
        "`datagen-gpus-<hostname>` when unset. Runs that share GPUs must share the name and the state dir.",
    )
    gpu_lock_timeout_s: float = Field(
        default=24 * 3600.0,
        gt=0,
        description="How long a run waits for the GPUs while another run holds them before it fails.",
    )


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, read once from the environment."""
    return Settings()


def server_api_key() -> str | None:
    """``DATAGEN_SERVER_API_KEY`` in clear: for the servers datagen launches and the requests it sends."""
    key = get_settings().server_api_key
    return key.get_secret_value() if key else None
