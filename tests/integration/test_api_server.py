"""The CLI's temporary Prefect API server: once it is stopped, nothing Prefect still holds prints to the terminal."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The temporary server stops answering (a loaded host) while Prefect's log worker still holds a line: the
# drain is cut short, the server is stopped under the pending send, and the send fails. That failure must not
# print (in the CLI it came after the run's last line).
SCRIPT = textwrap.dedent(
    """
    import os
    import signal
    import sys
    from pathlib import Path

    from flows.api_server import LocalApiServer, prefect_api
    from prefect.events import emit_event
    from prefect.logging.handlers import APILogWorker

    def line(message):
        return {
            "name": "datagen", "level": 20, "message": message, "timestamp": "2026-12-02T00:00:00Z",
            "flow_run_id": None, "task_run_id": None,
        }

    folder = Path(sys.argv[1])
    server = LocalApiServer(folder / "api.log")
    server.spawn(with_settings=False)
    with prefect_api(folder, early=server):
        APILogWorker.instance().send(line("during the run"))
        APILogWorker.drain_all(timeout=60)
        os.kill(server.process.pid, signal.SIGSTOP)  # answers nothing from now on
        APILogWorker.instance().send(line("stuck"))
        emit_event(event="datagen.test.stuck", resource={"prefect.resource.id": "datagen.test"})
    print("LAST LINE", flush=True)
    """
)


def test_a_log_line_left_for_the_stopped_temporary_server_prints_nothing_after_the_last_line(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "LAST LINE"
    for chatter in ("Error logging to API", "EventsWorker", "Unable to connect"):
        assert chatter not in result.stderr, result.stderr[-3000:]


# A run's temporary server takes only this process's own auth string: the shell's auth string for a shared
# server (exported for `prefect server start`) is not inherited, and a stranger on loopback is refused.
AUTH_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import httpx
    from prefect import flow

    from flows.api_server import prefect_api

    @flow(name="auth-check")
    def answer() -> int:
        return 42

    with prefect_api(Path(sys.argv[1])) as api_url:
        print("FLOW", answer(), flush=True)
        for name, headers in {
            "none": {},
            "shell": {"Authorization": "Basic " + __import__("base64").b64encode(b"from-the-shell").decode()},
        }.items():
            status = httpx.post(f"{api_url}/flow_runs/filter", json={}, headers=headers).status_code
            print("STRANGER", name, status, flush=True)
    """
)


def test_the_temporary_server_takes_only_its_own_auth_string_and_refuses_strangers(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_SERVER_API_AUTH_STRING": "from-the-shell"}
    for name in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-c", AUTH_SCRIPT, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FLOW 42" in result.stdout
    assert "STRANGER none 401" in result.stdout
    assert "STRANGER shell 401" in result.stdout
