"""What a human or CI passes (config_path, overrides, run id alone, the whole config) becomes one config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from datagen.app.request import RunOverrides, resolve_run_config
from datagen.config import parse_run_config
from datagen.errors import ConfigError
from datagen.output.runs import open_run
from datagen.output.store import Store


def _write(folder: Path, **changes: Any) -> Path:
    data: dict[str, Any] = {
        "model": {"path": "/models/m"},
        "datasets": [
            {"name": "a", "format": "metamath", "path": "a.json", "max_prompts": 50},
            {"name": "b", "format": "metamath", "path": "b.json"},
        ],
        "output": "out",
        **changes,
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_config_path_with_small_overrides(tmp_path: Path) -> None:
    path = _write(tmp_path / "configs")
    config = resolve_run_config(
        config_path=str(path), overrides=RunOverrides(run_id="r1", max_prompts=10, series="nightly")
    )
    assert config.run_id == "r1"
    assert config.series == "nightly"
    assert [d.max_prompts for d in config.datasets] == [10, 10]
    assert config.output == str(tmp_path / "configs" / "out")
    assert config.datasets[0].path == str(tmp_path / "configs" / "a.json")


def test_the_whole_config_wins_over_config_path(tmp_path: Path) -> None:
    whole = parse_run_config(
        {
            "model": {"path": "/m"},
            "datasets": [{"name": "x", "format": "metamath", "path": "/x"}],
            "output": "/o",
        }
    )
    config = resolve_run_config(config_path=str(tmp_path / "missing.yaml"), config=whole)
    assert config.datasets[0].name == "x"


def test_a_run_id_alone_resumes_the_stored_config(tmp_path: Path) -> None:
    path = _write(tmp_path, output=str(tmp_path / "store"))
    original = resolve_run_config(config_path=str(path), overrides=RunOverrides(run_id="r1", max_prompts=7))
    open_run(Store(original.output), original)
    # The file changed since, but the run keeps its stored config.
    _write(tmp_path, output=str(tmp_path / "store"), seed=99)

    resumed = resolve_run_config(config_path=str(path), overrides=RunOverrides(run_id="r1"))
    assert resumed.config_hash() == original.config_hash()
    assert [d.max_prompts for d in resumed.datasets] == [7, 7]
    resumed_by_output = resolve_run_config(overrides=RunOverrides(run_id="r1", output=original.output))
    assert resumed_by_output.config_hash() == original.config_hash()
    with pytest.raises(ConfigError, match="config never changes"):
        resolve_run_config(config_path=str(path), overrides=RunOverrides(run_id="r1", max_prompts=3))


def test_missing_inputs_are_explained(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Nothing to run"):
        resolve_run_config()
    with pytest.raises(ConfigError, match="does not exist on this host"):
        resolve_run_config(config_path=str(tmp_path / "nope.yaml"))
