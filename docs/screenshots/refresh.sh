#!/usr/bin/env bash
# Refresh docs/screenshots/*.png (`make screenshots`): on a copy of the checkout, a real Prefect server (free
# port, auth string, PREFECT_UI_API_URL), `datagen deploy` and a process worker run the CPU demo; headless
# Chromium (Debian: `apt-get install -y chromium`) photographs the run form, the deployment's parameters, a run
# mid-generation, its report artifact and a failed run. Options: --out DIR. Run from anywhere; takes a few
# minutes. Look at the PNGs before committing them.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
exec "$python" "$repo/docs/screenshots/refresh.py" "$@"
