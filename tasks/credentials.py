"""S3 credentials from a Prefect AwsCredentials block, handed to the Prefect-free core.

``datagen/`` uses the standard AWS chain (environment, profile, instance role) unless it is given
:class:`~datagen.output.s3_client.S3Credentials`; it cannot read Prefect blocks itself. When
``DATAGEN_AWS_CREDENTIALS_BLOCK`` names an ``aws-credentials`` block (the block type of the prefect-aws
package), :func:`load_s3_credentials` reads the block's document from the Prefect API (so prefect-aws need not
be installed on the worker). The flow calls it once, at its start, through :func:`tasks.context.open_run_store`:
the credentials go into the run's store, which tasks receive in their run context (their secrets are
``SecretStr``). There is no process-wide default: a store opened without them uses the AWS chain.
"""

from __future__ import annotations

import logging
from typing import Any

import datagen.settings
from datagen.errors import ConfigError
from datagen.output.s3_client import S3Credentials

logger = logging.getLogger(__name__)

AWS_CREDENTIALS_BLOCK_TYPE = "aws-credentials"


def credentials_from_block_data(data: dict[str, Any]) -> S3Credentials:
    """Map the fields of an AwsCredentials block document onto :class:`~datagen.output.s3_client.S3Credentials`.

    Args:
        data: The block document's data (prefect-aws field names: ``aws_access_key_id``,
            ``aws_secret_access_key``, ``aws_session_token``, ``profile_name``, ``region_name``,
            ``aws_client_parameters.endpoint_url``).
    """
    client_parameters = data.get("aws_client_parameters") or {}
    return S3Credentials(
        access_key_id=data.get("aws_access_key_id") or None,
        secret_access_key=data.get("aws_secret_access_key") or None,
        session_token=data.get("aws_session_token") or None,
        profile_name=data.get("profile_name") or None,
        region=data.get("region_name") or None,
        endpoint_url=client_parameters.get("endpoint_url") or None,
    )


def load_aws_credentials_block(name: str) -> S3Credentials:
    """Read the AwsCredentials block ``name`` (``my-creds`` or ``aws-credentials/my-creds``) from Prefect.

    Raises:
        ConfigError: No such block (the message names it, never a secret).
    """
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    document_name = name.removeprefix(f"{AWS_CREDENTIALS_BLOCK_TYPE}/")
    with get_client(sync_client=True) as client:
        try:
            document = client.read_block_document_by_name(
                document_name, block_type_slug=AWS_CREDENTIALS_BLOCK_TYPE, include_secrets=True
            )
        except ObjectNotFound:
            raise ConfigError(
                f"Prefect block {AWS_CREDENTIALS_BLOCK_TYPE}/{document_name} (DATAGEN_AWS_CREDENTIALS_BLOCK) "
                "does not exist; create it in the Prefect UI or unset the variable to use the AWS chain"
            ) from None
    return credentials_from_block_data(dict(document.data))


def load_s3_credentials() -> S3Credentials | None:
    """The credentials of the block named by ``DATAGEN_AWS_CREDENTIALS_BLOCK``, for the flow to pass down.

    Returns:
        The credentials, or None when no block is configured (the standard AWS chain applies).

    Raises:
        ConfigError: The named block does not exist.
    """
    name = datagen.settings.get_settings().aws_credentials_block
    if not name:
        return None
    credentials = load_aws_credentials_block(name)
    logger.info(
        "s3 credentials from prefect block block=%s kind=%s endpoint=%s",
        name,
        "profile" if credentials.profile_name else "key-pair" if credentials.access_key_id else "chain",
        credentials.endpoint_url or "default",
    )
    return credentials
