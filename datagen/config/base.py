"""What every config model shares: strictness, the schema version, and the slug rule of names and run ids."""

from __future__ import annotations

import re
from typing import Annotated, Final

from pydantic import BaseModel, ConfigDict, Field

from datagen.errors import ConfigError

CONFIG_SCHEMA_VERSION: Final = 1

# A run id or dataset name becomes part of an object key: keep it to characters safe everywhere.
SLUG_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,79}$"
Slug = Annotated[str, Field(pattern=SLUG_PATTERN)]
# A part of a whole: more than none, at most all (a dataset's share of the prompts, a memory fraction).
Share = Annotated[float, Field(gt=0, le=1)]
RUN_ID_EXAMPLE: Final = "20261201-nightly-1"


class StrictModel(BaseModel):
    """Base for every config model: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_run_id_option(run_id: str | None, flag: str = "--run-id") -> None:
    """Refuse a run id given on the command line that cannot be one, naming the flag (not the config file).

    Args:
        run_id: The value given, or None when the flag was not.
        flag: The option's name, for the message.

    Raises:
        ConfigError: The value is not a valid run id; the message gives the rule and an example.
    """
    if run_id is not None and not is_valid_slug(run_id):
        raise ConfigError(
            f"{flag} {run_id!r} is not a valid run id: use 1-80 lowercase letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit, e.g. {flag} {RUN_ID_EXAMPLE}",
            run_id=run_id,
        )


def is_valid_slug(value: str) -> bool:
    """Tell whether ``value`` may be used as a run id or dataset name."""
    return re.match(SLUG_PATTERN, value) is not None
