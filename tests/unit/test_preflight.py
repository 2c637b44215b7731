"""Preflight lists every problem, each with its fix, before anything is stopped."""

from __future__ import annotations

from pathlib import Path

import pytest

from datagen.app.preflight import run_preflight
from datagen.config import RunConfig
from datagen.errors import PreflightError
from datagen.samples import sample_path


def _config(tmp_path: Path, model_dir: Path, **changes: object) -> RunConfig:
    data: dict[str, object] = {
        "run_id": "pre-1",
        "model": {"path": str(model_dir)},
        "datasets": [{"name": "metamath", "format": "metamath", "path": sample_path("metamath")}],
        "output": str(tmp_path / "out"),
        "protected_prefixes": [str(tmp_path / "train")],
        **changes,
    }
    return RunConfig.model_validate(data)


def test_a_good_config_passes_every_check(tmp_path: Path, tiny_model_dir: Path) -> None:
    report = run_preflight(_config(tmp_path, tiny_model_dir))
    assert all(check.ok for check in report.checks)
    assert {check.name for check in report.checks} >= {"output location", "datasets readable", "engine"}


def test_all_problems_are_reported_at_once_with_their_fixes(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = _config(
        tmp_path,
        tmp_path / "no-model",
        output=str(tmp_path / "train" / "expansion"),
        datasets=[
            {
                "name": "metamath",
                "format": "metamath",
                "path": str(tmp_path / "missing.json"),
                "category": "math",
                "max_prompts": 3,
            }
        ],
        mix={"category_caps": {"math": 0.5}},
        training={"kind": "pidfile", "pidfile": str(tmp_path / "trainer.pid")},
    )
    with pytest.raises(PreflightError) as raised:
        run_preflight(config)
    problems = raised.value.problems
    joined = "\n".join(problems)
    assert "protected prefix" in joined and "choose an `output`" in joined
    assert "missing.json" in joined and "datasets[].path" in joined
    assert "no config.json" in joined
    assert "mix: mix.category_caps cannot all hold" in joined
    assert len(problems) >= 3
    assert not (tmp_path / "train").exists(), "preflight must not write under a protected prefix"


def test_changed_config_for_an_existing_run_fails_preflight(tmp_path: Path, tiny_model_dir: Path) -> None:
    from datagen.output.runs import open_run, open_store

    config = _config(tmp_path, tiny_model_dir)
    open_run(open_store(config), config)
    changed = config.model_copy(update={"seed": 42})
    with pytest.raises(PreflightError, match="different configuration"):
        run_preflight(changed)
