#!/usr/bin/env bash
# Refresh docs/screenshots/*.png: a real Prefect server and worker run the CPU demo deployment, then headless
# Chromium (Debian: `apt-get install -y chromium`) photographs the flow run page and the report artifact.
# Run from anywhere; takes a few minutes on a laptop. Look at the PNGs before committing them.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
exec "$python" "$repo/docs/screenshots/refresh.py" "$@"
