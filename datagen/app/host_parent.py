"""Whether a host part's parent is one: the rules, over what the Prefect API and the run's store say.

An `expand-host` flow run halts a box's training and serves on its GPUs, so it may run only for a parent that
started it: a running `expand` flow run of the same config and run id, whose handshake folder lists this host
part's flow run (``started.json``, written by the parent once it started its host parts). Anyone who may trigger
a deployment can start an `expand-host` run with any parameters; without such a parent it is refused before it
writes or halts anything.
"""

from __future__ import annotations

from typing import Any, Final

from pydantic import BaseModel, ConfigDict

from datagen.output.multihost import HostsStarted

# The flow a parent runs (flows/expand.py).
PARENT_FLOW_NAME: Final = "expand"


class ParentRun(BaseModel):
    """The parent flow run as the Prefect API returns it (what the rules read of it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    flow_name: str
    running: bool
    parameters: dict[str, Any]


def _parent_choice(parameters: dict[str, Any], name: str) -> str | None:
    """A deployment's parent names its config and run id as parameters; the operator's flow, in its config."""
    config = parameters.get("config")
    if name == "config":
        value = config if isinstance(config, str) else parameters.get("config_name")
    else:
        value = parameters.get("run_id")
        if value is None and isinstance(config, dict):
            value = config.get("run_id")
    return value if isinstance(value, str) else None


def parent_problem(parent: ParentRun | None, *, config: str, run_id: str) -> str | None:
    """Why ``parent`` is no parent of a host part of run ``run_id`` of config ``config`` (None: it may be)."""
    if parent is None:
        return (
            "parent_flow_run_id: no such flow run; a host part runs only for the expand run that started it"
        )
    if parent.flow_name != PARENT_FLOW_NAME:
        return f"parent_flow_run_id: not a flow run of `{PARENT_FLOW_NAME}`; a host part runs only for one"
    if not parent.running:
        return "parent_flow_run_id: that flow run is not running; a host part serves only a running parent"
    for name, expected in (("config", config), ("run_id", run_id)):
        given = _parent_choice(parent.parameters, name)
        if given is not None and given != expected:
            return (
                f"{name}: not the parent's; a host part runs the config and run id of the run that started it"
            )
    return None


def started_problem(started: HostsStarted | str, *, parent: str, host: str, flow_run_id: str) -> str | None:
    """Why the parent's list of its host parts (or why it never appeared) does not vouch for this one."""
    if isinstance(started, str):
        return f"parent_flow_run_id: the parent never listed its host parts ({started})"
    if started.parent_flow_run_id != parent or started.flow_runs.get(host) != flow_run_id:
        return "parent_flow_run_id: the parent did not start this host part; a host part runs only for its parent"
    return None


__all__ = ["PARENT_FLOW_NAME", "ParentRun", "parent_problem", "started_problem"]
