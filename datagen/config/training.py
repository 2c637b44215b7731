"""The training job halted before the GPUs are taken (``training:``), read by the host stage."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from datagen.config.base import StrictModel

TrainingJobKind = Literal["none", "pidfile", "cmdline", "systemd", "prefect"]


class TrainingJobConfig(StrictModel):
    """The training job to halt before the GPUs are taken."""

    kind: TrainingJobKind = "none"
    pidfile: str | None = Field(default=None, description="File holding the trainer's PID (kind: pidfile).")
    cmdline_pattern: str | None = Field(
        default=None,
        description="Regex searched in the command line of GPU-holding processes (kind: cmdline).",
    )
    systemd_unit: str | None = Field(default=None, description="Unit running the trainer (kind: systemd).")
    systemd_stop: Literal["stop", "kill"] = Field(
        default="stop",
        description="systemd: `stop` (the unit's KillSignal, never restarted by Restart=) or `kill` "
        "(send `signal` to the main process; only for units without Restart=).",
    )
    prefect_flow_run_id: str | None = Field(
        default=None, description="Flow run to cancel through the Prefect API (kind: prefect)."
    )
    prefect_deployment: str | None = Field(
        default=None,
        description="`flow-name/deployment-name` whose running flow runs are cancelled (kind: prefect).",
    )
    signal: str = Field(default="SIGTERM", description="Signal asking the trainer to checkpoint and exit.")
    stop_timeout_s: float = Field(default=600.0, gt=0, description="How long to wait for a graceful exit.")
    escalate: bool = Field(default=False, description="Send SIGKILL when the graceful stop times out.")
    checkpoint_glob: str | None = Field(
        default=None, description="Glob of checkpoint files; the newest is recorded as the last checkpoint."
    )
    checkpoint_marker: str | None = Field(
        default=None,
        description="File (or glob) the trainer writes once its checkpoint is complete; the halt waits for "
        "one written after the stop signal.",
    )
    restart_after_run: bool = Field(
        default=False, description="Start training again after the run (detached); off by default."
    )
    restart_command: list[str] | None = Field(
        default=None,
        description="argv that resumes training (kind systemd: `systemctl start <unit>` when unset).",
    )
    allow_env_change: bool = Field(
        default=False,
        description="Restart training even when its environment (interpreter, installed packages, torch's "
        "CUDA build, NVIDIA driver) changed since the halt; off: such a restart is held back and said.",
    )

    @model_validator(mode="after")
    def _kind_needs_its_target(self) -> TrainingJobConfig:
        needs = {
            "pidfile": ("pidfile", "the path of the trainer's pidfile"),
            "cmdline": ("cmdline_pattern", "a regex matching the trainer's command line"),
            "systemd": ("systemd_unit", "the unit that runs the trainer"),
        }
        if self.kind in needs:
            field, what = needs[self.kind]
            if not getattr(self, field):
                raise ValueError(f"training.kind {self.kind!r} needs training.{field}: {what}")
        if self.kind == "prefect" and not (self.prefect_flow_run_id or self.prefect_deployment):
            raise ValueError(
                "training.kind 'prefect' needs training.prefect_flow_run_id or training.prefect_deployment"
            )
        if self.cmdline_pattern is not None:
            try:
                re.compile(self.cmdline_pattern)
            except re.error as error:
                raise ValueError(f"training.cmdline_pattern is not a valid regex: {error}") from None
        if self.restart_after_run and not self.restart_command and self.kind != "systemd":
            raise ValueError(
                "training.restart_after_run needs training.restart_command (the argv that resumes training)"
            )
        return self

    @field_validator("signal")
    @classmethod
    def _known_signal(cls, value: str) -> str:
        import signal as signal_module

        name = value.upper() if value.upper().startswith("SIG") else f"SIG{value.upper()}"
        if not hasattr(signal_module, name):
            raise ValueError(f"unknown signal {value!r}; use a name such as SIGTERM, SIGINT or SIGUSR1")
        return name
