"""Refresh docs/screenshots/*.png from the Prefect UI users get (see refresh.sh; ``make screenshots``).

Everything runs as the README's Deploy section has it, on a copy of this checkout (a fresh clone: tracked and
untracked files, one commit): ``prefect server start`` on a free port with an auth string and
``PREFECT_UI_API_URL``, ``datagen deploy``, a process worker, then runs of ``expand-manual`` on the CPU demo
config. Headless Chromium (Debian's ``chromium``) photographs, in Prefect's default UI:

- ``run-form.png``: the deployment's run form, whole (config, the run's choices, the sampling section);
- ``deployment-parameters.png``: the deployment page's Parameters tab;
- ``flow-run-progress.png``: a run mid-generation, its Artifacts tab (the progress card among them);
- ``flow-run-logs.png``: the same run's Logs tab, newest first: the progress line the tab polls every 5 s;
- ``report-artifact.png``: that run's report artifact, and ``report-training.png`` its trainers' commands;
- ``server-plan-artifact.png``: its server plan, each server's exact command;
- ``flow-run-failed.png``: a run refused for an unknown dataset, its one ``run failed:`` line.

Chromium is driven through its DevTools protocol (``--remote-debugging-port``), not ``--screenshot`` alone:
the server asks for its auth string, which the UI keeps in the page's ``localStorage``, so the script logs in
once the way the UI's login page does. Everything it starts is stopped; the PNGs want a look before a commit.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml
from websockets.sync.client import ClientConnection, connect

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.support.prefect_stack import PrefectStack, copy_checkout, free_port  # noqa: E402

OUT = REPO / "docs" / "screenshots"
WIDTH, HEIGHT = 1600, 1000
# The run form is photographed whole: every field of the run's choices, the sampling section included.
FORM_HEIGHT = 2200
# How long a page gets to fetch and render (Prefect's UI is a single-page app that polls its API).
RENDER_S = 8.0
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    f"--window-size={WIDTH},{HEIGHT}",
]
# Long enough answers that the run is still generating when the progress shot is taken.
WATCH_SAMPLING = {"max_tokens": 192, "samples_per_prompt": 48}
# The watched run's config: demo-worker, also exported for the trainers (the report then holds their commands).
# Written into the clone after `datagen deploy`, so the run form's list of configs stays the checkout's.
WATCH_CONFIG = "demo-screenshots"
RUN_TIMEOUT_S = 900.0
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit("no chromium found: apt-get install -y chromium")


class Browser:
    """One headless Chromium page, driven through the DevTools protocol."""

    def __init__(self, profile: Path) -> None:
        port = free_port()
        self.process = subprocess.Popen(
            [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--remote-debugging-port={port}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=2).json()
                page = next(target for target in targets if target["type"] == "page")
                break
            except (httpx.HTTPError, StopIteration):
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise SystemExit("chromium did not start its DevTools endpoint") from None
                time.sleep(0.5)
        self.socket: ClientConnection = connect(page["webSocketDebuggerUrl"], max_size=None)
        self.ids = itertools.count(1)
        self.call("Page.enable")
        self.resize(HEIGHT)

    def resize(self, height: int) -> None:
        """Give the page a viewport ``WIDTH`` x ``height`` (a tall one photographs a long page whole)."""
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=WIDTH,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one DevTools command and return its result (events in between are skipped)."""
        number = next(self.ids)
        self.socket.send(json.dumps({"id": number, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=120))
            if message.get("id") == number:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result

    def open(self, url: str, render_s: float = RENDER_S) -> None:
        """Load ``url`` and give the app time to render."""
        self.call("Page.navigate", url=url)
        time.sleep(render_s)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page."""
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def shot(self, path: Path) -> None:
        """Write the page as it shows now to ``path`` (PNG)."""
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        print(f"wrote {path}")

    def close(self) -> None:
        """Stop Chromium."""
        with contextlib.suppress(Exception):
            self.socket.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


@contextlib.contextmanager
def browser(profile: Path) -> Iterator[Browser]:
    """A fresh headless Chromium (its own profile folder), stopped on exit."""
    page = Browser(profile)
    try:
        yield page
    finally:
        page.close()


def _progress(stack: PrefectStack, flow_run_id: str) -> float | None:
    """The run's progress artifact, in percent, once there is one."""
    found = stack.api.post(
        "/artifacts/filter",
        json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}, "type": {"any_": ["progress"]}}},
    ).json()
    return float(found[0]["data"]) if found else None


def _artifact_id(stack: PrefectStack, flow_run_id: str, key: str) -> str:
    found = stack.api.post(
        "/artifacts/filter",
        json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}, "key": {"any_": [key]}}},
    ).json()
    if not found:
        raise SystemExit(f"the run has no {key} artifact")
    return str(found[0]["id"])


def main() -> int:
    """Run the demo through a real server and worker and refresh the screenshots."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="datagen-screenshots-"))
    port = free_port()
    # The UI told where the API is by name, as a browser elsewhere would reach it (README, server step).
    stack = PrefectStack(home=work / "prefect-home", port=port, ui_api_url=f"http://localhost:{port}/api")
    stack.launch()
    try:
        clone = copy_checkout(REPO, work / "datagen")
        env = stack.env(PYTHONPATH=str(clone), DATAGEN_STATE_DIR=str(work / "state"))
        tiny = REPO / "runs" / "_demo" / "tiny-model"
        if (tiny / "config.json").is_file():
            shutil.copytree(tiny, clone / "runs" / "_demo" / "tiny-model")
        else:
            subprocess.run(
                [sys.executable, "-m", "flows.cli_entry", "tiny-model", "runs/_demo/tiny-model"],
                cwd=clone,
                env=env,
                check=True,
            )
        # Before the deploy: the deployments offer the checkout's configs, and refuse any other name.
        watch_config = yaml.safe_load((clone / "configs" / "demo-worker.yaml").read_text())
        watch_config["tokenize"]["formats"] = ["parquet", "jsonl"]
        (clone / "configs" / f"{WATCH_CONFIG}.yaml").write_text(yaml.safe_dump(watch_config, sort_keys=False))
        stack.wait_ready()
        subprocess.run(
            [sys.executable, "-m", "flows.cli_entry", "deploy"],
            cwd=clone,
            env=env,
            check=True,
            capture_output=True,
        )
        stack.start_worker(
            "gpu-box",
            work / "worker",
            "gpu-box-worker",
            PYTHONPATH=str(clone),
            DATAGEN_STATE_DIR=str(work / "state"),
        )
        deployment = stack.api.get("/deployments/name/expand/expand-manual").json()
        ui = f"http://localhost:{port}/v2"
        args.out.mkdir(parents=True, exist_ok=True)
        with browser(work / "chromium") as page:
            # The UI's login page keeps the auth string, base64, in localStorage under this key.
            page.open(f"{ui}/dashboard", render_s=3)
            login = base64.b64encode(stack.auth_string.encode()).decode()
            page.evaluate(f"localStorage.setItem('prefect-password', {json.dumps(login)})")

            page.resize(FORM_HEIGHT)
            page.open(f"{ui}/deployments/deployment/{deployment['id']}/run")
            page.shot(args.out / "run-form.png")
            page.resize(HEIGHT)
            page.open(f"{ui}/deployments/deployment/{deployment['id']}?tab=Parameters")
            page.shot(args.out / "deployment-parameters.png")

            failed = stack.create_flow_run(
                "expand/expand-manual", config="demo-worker", datasets=["no-such-dataset"]
            )
            print("failed run:", stack.wait_final(failed, RUN_TIMEOUT_S))
            page.open(f"{ui}/runs/flow-run/{failed}")
            page.shot(args.out / "flow-run-failed.png")

            watched = stack.create_flow_run(
                "expand/expand-manual", config=WATCH_CONFIG, sampling=WATCH_SAMPLING
            )
            deadline = time.monotonic() + RUN_TIMEOUT_S
            # Mid-generation: a fifth of the requests answered, or the run's end if it is quicker.
            while time.monotonic() < deadline:
                done = _progress(stack, watched)
                if (done is not None and done >= 20) or stack.flow_run(watched)["state_type"] in FINAL:
                    break
                time.sleep(2)
            page.open(f"{ui}/runs/flow-run/{watched}?tab=Artifacts")
            page.shot(args.out / "flow-run-progress.png")
            # The Logs tab newest first (the UI keeps the choice of its sort menu in localStorage).
            page.evaluate("localStorage.setItem('prefect-log-sort-order', JSON.stringify('TIMESTAMP_DESC'))")
            page.open(f"{ui}/runs/flow-run/{watched}?tab=Logs")
            page.shot(args.out / "flow-run-logs.png")
            print("watched run:", stack.wait_final(watched, RUN_TIMEOUT_S))
            page.open(f"{ui}/artifacts/artifact/{_artifact_id(stack, watched, 'datagen-report')}")
            page.shot(args.out / "report-artifact.png")
            found = page.evaluate(
                "(() => { const h = [...document.querySelectorAll('h2')]"
                ".find(e => e.innerText.includes('Training on this version'));"
                " if (h) { h.scrollIntoView(); return true } return false })()"
            )
            if not found:
                raise SystemExit("the report artifact has no 'Training on this version' section")
            time.sleep(1)
            page.shot(args.out / "report-training.png")
            page.open(f"{ui}/artifacts/artifact/{_artifact_id(stack, watched, 'server-plan')}")
            page.shot(args.out / "server-plan-artifact.png")
        return 0
    finally:
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
