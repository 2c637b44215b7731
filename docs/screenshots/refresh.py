"""Refresh the README's screenshots of the Prefect UI from a real demo run (see refresh.sh).

Starts `prefect server start` on a free loopback port (private PREFECT_HOME), deploys this checkout with
`datagen deploy`, starts a process worker, runs the CPU demo deployment with `--watch`, then photographs
the flow run page and the report artifact with headless Chromium. Everything it starts is stopped.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.support.prefect_stack import PrefectStack  # noqa: E402

OUT = REPO / "docs" / "screenshots"
WINDOW = "1600,1100"
# Prefect's UI is a single-page app: give it virtual time to fetch and render before the shot.
RENDER_BUDGET_MS = "20000"


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit("no chromium found: apt-get install -y chromium")


def screenshot(url: str, path: Path) -> None:
    """Photograph ``url`` into ``path`` with headless Chromium."""
    subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--window-size={WINDOW}",
            f"--virtual-time-budget={RENDER_BUDGET_MS}",
            f"--screenshot={path}",
            url,
        ],
        check=True,
        capture_output=True,
        timeout=180,
    )
    print(f"wrote {path}")


def main() -> int:
    """Run the demo through a real server and worker and refresh the screenshots."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="datagen-screenshots-"))
    stack = PrefectStack(home=work / "prefect-home").start()
    try:
        env = stack.env(PYTHONPATH=str(REPO), DATAGEN_STATE_DIR=str(work / "state"))
        if not (REPO / "runs" / "_demo" / "tiny-model" / "config.json").is_file():
            subprocess.run(
                [sys.executable, "-m", "flows.cli_entry", "tiny-model", "runs/_demo/tiny-model"],
                cwd=REPO,
                env=env,
                check=True,
            )
        subprocess.run(
            [sys.executable, "-m", "flows.cli_entry", "deploy", "--name", "expand-manual"],
            cwd=REPO,
            env=env,
            check=True,
            capture_output=True,
        )
        stack.start_worker(
            "gpu-box",
            work / "worker",
            "gpu-box-worker",
            **{"PYTHONPATH": str(REPO), "DATAGEN_STATE_DIR": str(work / "state")},
        )
        result = stack.prefect(
            "deployment",
            "run",
            "expand/expand-manual",
            "--param",
            "config=demo-worker",
            "--watch",
            "--watch-timeout",
            "900",
            cwd=work,
        )
        print(result.stdout[-2000:])
        if result.returncode != 0:
            print(result.stderr[-2000:], file=sys.stderr)
            return result.returncode
        api = httpx.Client(base_url=stack.api_url, timeout=30)
        (flow_run,) = api.post("/flow_runs/filter", json={"limit": 1, "sort": "START_TIME_DESC"}).json()
        artifacts = api.post(
            "/artifacts/filter", json={"artifacts": {"key": {"any_": ["datagen-report"]}}, "limit": 1}
        ).json()
        args.out.mkdir(parents=True, exist_ok=True)
        screenshot(f"{stack.ui_url}/runs/flow-run/{flow_run['id']}", args.out / "flow-run.png")
        screenshot(
            f"{stack.ui_url}/artifacts/artifact/{artifacts[0]['id']}", args.out / "report-artifact.png"
        )
        return 0
    finally:
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
