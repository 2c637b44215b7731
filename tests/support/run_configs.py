"""The config of a whole `datagen run` against one external OpenAI-compatible test server.

The whole-run fault tests (an S3 outage, a frozen Prefect API, a full disk, a fleet that fails everything)
each start the real CLI on one dataset of numbered questions; they differ only in the output, the
generation settings and how hard they load the server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml


def write_prompts(path: Path, count: int, question: str) -> Path:
    """``count`` OpenAI-messages rows, ``{question} 000?`` ... at ``path``."""
    path.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"{question} {index:03d}?"}]}) + "\n"
            for index in range(count)
        )
    )
    return path


def external_run_config(
    path: Path,
    *,
    server_url: str,
    model_dir: Path,
    prompts: Path,
    dataset: str,
    shard_size: int,
    in_flight: int,
    output: str,
    protected: str,
    generation: dict[str, Any],
) -> Path:
    """Write the run's YAML config at ``path``: one external server, one dataset, no training job."""
    config = {
        "model": {"path": str(model_dir)},
        "fleet": {"engine": "external", "external_urls": [server_url], "max_inflight_per_server": in_flight},
        "sampling": {"temperature": 0.7, "max_tokens": 8},
        "datasets": [
            {"name": dataset, "format": "openai_messages", "path": str(prompts), "shard_size": shard_size}
        ],
        "output": output,
        "protected_prefixes": [protected],
        "generation": generation,
        "training": {"kind": "none"},
    }
    path.write_text(yaml.safe_dump(config))
    return path
