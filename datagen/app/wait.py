"""``datagen wait``: wait for a flow run's final state through Prefect's REST API; its exit code says which.

For CI: ``prefect deployment run --watch`` follows the run's event and log streams and exits 1 when they
close, which a Prefect API restart or a network blip does, even for a run that goes on to Completed. This
polls the flow run's state instead, and an API that does not answer is waited for (said once per outage),
so only the run's own end decides the exit code. It talks HTTP only (httpx), so the core never imports
Prefect.
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Callable

import httpx
from pydantic import BaseModel, ConfigDict

from datagen.errors import ConfigError

# Prefect's final state types; any other (PENDING, SCHEDULED, RUNNING, PAUSED, CANCELLING) is waited out.
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CRASHED", "CANCELLED"})
WAIT_POLL_S = 5.0
WAIT_REQUEST_TIMEOUT_S = 10.0
HTTP_NOT_FOUND = 404


class FlowRunEnd(BaseModel):
    """A flow run's final state as the API reports it."""

    model_config = ConfigDict(extra="forbid")

    flow_run_id: str
    name: str
    state_type: str
    state_name: str
    message: str | None = None

    @property
    def completed(self) -> bool:
        """Whether the run ended Completed (the only end a CI job should call a success)."""
        return self.state_type == "COMPLETED"


def _headers() -> dict[str, str]:
    """Prefect's own client authentication: ``PREFECT_API_KEY`` (Cloud) or ``PREFECT_API_AUTH_STRING``."""
    key = os.environ.get("PREFECT_API_KEY")
    if key:
        return {"Authorization": f"Bearer {key}"}
    auth = os.environ.get("PREFECT_API_AUTH_STRING")
    if auth:
        return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}
    return {}


def wait_for_flow_run(
    api_url: str,
    flow_run_id: str,
    *,
    timeout_s: float | None = None,
    poll_s: float = WAIT_POLL_S,
    say: Callable[[str], None] = print,
) -> FlowRunEnd | None:
    """Poll a flow run until it reaches a final state.

    Args:
        api_url: Prefect's API (``PREFECT_API_URL``, e.g. ``http://127.0.0.1:4200/api``).
        flow_run_id: The flow run.
        timeout_s: Give up after this long (None: wait as long as the run lasts).
        poll_s: Seconds between two reads of the state.
        say: Where state changes and API outages are reported.

    Returns:
        The final state; None when ``timeout_s`` passed first (the run goes on).

    Raises:
        ConfigError: The API answers that no such flow run exists (or refuses the credentials).
    """
    url = f"{api_url.rstrip('/')}/flow_runs/{flow_run_id}"
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    last_state: str | None = None
    away_since: float | None = None
    with httpx.Client(timeout=WAIT_REQUEST_TIMEOUT_S, headers=_headers()) as client:
        while True:
            try:
                response = client.get(url)
                if response.status_code == HTTP_NOT_FOUND or response.status_code in {401, 403}:
                    raise ConfigError(
                        f"the Prefect API at {api_url} answered {response.status_code} for flow run "
                        f"{flow_run_id}: check the id (the run's page shows it) and PREFECT_API_URL / "
                        "PREFECT_API_AUTH_STRING"
                    )
                response.raise_for_status()
                data = response.json()
            except httpx.HTTPError as error:
                if away_since is None:
                    away_since = time.monotonic()
                    say(f"Prefect API not answering ({type(error).__name__}): still waiting for the run")
            else:
                if away_since is not None:
                    say(f"Prefect API answering again after {time.monotonic() - away_since:.0f} s")
                    away_since = None
                state = data.get("state") or {}
                state_type = str(state.get("type") or "PENDING")
                if state_type != last_state:
                    say(f"flow run {data.get('name', flow_run_id)}: {state.get('name') or state_type}")
                    last_state = state_type
                if state_type in FINAL_STATES:
                    return FlowRunEnd(
                        flow_run_id=flow_run_id,
                        name=str(data.get("name", "")),
                        state_type=state_type,
                        state_name=str(state.get("name") or state_type),
                        message=state.get("message"),
                    )
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))
