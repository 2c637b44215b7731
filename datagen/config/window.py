"""The generation window (``window:``): how long a run may keep training stopped, and until when.

A run takes the GPUs from a training job; the window bounds the time from the halt of training to its restart,
by a length (``max_hours``), a time of day in the box's time zone (``until``), or both (the earlier wins).
The admission policy (:mod:`datagen.generation.window`) stops sending new requests early enough that the
requests in flight, the fleet's stop and training's restart all fit before the window ends.
"""

from __future__ import annotations

import datetime as dt
import re
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import Field, field_validator

from datagen.config.base import StrictModel

_CLOCK = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)$")
SECONDS_PER_HOUR = 3600.0


class WindowConfig(StrictModel):
    """When training must run again; unset: the run generates every prompt, however long that takes."""

    max_hours: float | None = Field(
        default=None,
        gt=0,
        le=168,
        description="Longest time from the halt of training to its restart, in hours.",
    )
    until: str | None = Field(
        default=None,
        description="Time of day (`HH:MM`, 24 h) by which training runs again, in `time_zone`: the first such "
        'time after the halt (a run halting at 01:00 with `until: "07:00"` gives six hours).',
    )
    time_zone: str | None = Field(
        default=None,
        description="IANA time zone of `until`, e.g. `Europe/Paris`; the box's local zone when unset.",
    )

    @field_validator("until")
    @classmethod
    def _clock_time(cls, value: str | None) -> str | None:
        if value is not None and not _CLOCK.match(value):
            raise ValueError(f'window.until {value!r} is not a time of day: write it as HH:MM, e.g. "07:00"')
        return value

    @field_validator("time_zone")
    @classmethod
    def _known_zone(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                ZoneInfo(value)
            except (ZoneInfoNotFoundError, ValueError):
                raise ValueError(
                    f"window.time_zone {value!r} is not an IANA time zone: use a name like Europe/Paris or UTC"
                ) from None
        return value

    @property
    def bounded(self) -> bool:
        """The window ends somewhere (a length or a time of day is set)."""
        return self.max_hours is not None or self.until is not None

    def deadline(self, halted_at: dt.datetime) -> dt.datetime | None:
        """When training must run again, for a run that halted training at ``halted_at`` (aware; None: no bound).

        Args:
            halted_at: When the halt of training began (timezone-aware).
        """
        ends: list[dt.datetime] = []
        if self.max_hours is not None:
            ends.append(halted_at + dt.timedelta(hours=self.max_hours))
        if self.until is not None:
            zone = ZoneInfo(self.time_zone) if self.time_zone else None
            local = halted_at.astimezone(zone)
            hour, minute = (int(part) for part in self.until.split(":"))
            end = local.replace(hour=hour, minute=minute, second=0, microsecond=0)
            if end <= local:
                end += dt.timedelta(days=1)
            ends.append(end)
        return min(ends) if ends else None
