"""Run identity: config.json first, a changed config under the same run id is refused, ids never collide."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from datagen.config import RunConfig
from datagen.errors import RunConfigMismatchError
from datagen.output.runs import make_run_id, open_run
from datagen.output.store import Store


def _config(tmp_path: Path, **changes: object) -> RunConfig:
    data = {
        "run_id": "r1",
        "model": {"path": "/models/m"},
        "datasets": [{"name": "metamath", "format": "metamath", "path": "/data/m.json"}],
        "output": str(tmp_path / "out"),
        **changes,
    }
    return RunConfig.model_validate(data)


def test_first_open_writes_config_then_reopen_resumes_with_same_incarnation(tmp_path: Path) -> None:
    config = _config(tmp_path)
    store = Store(config.output)
    first = open_run(store, config)
    second = open_run(store, config)
    assert (first.resumed, second.resumed) == (False, True)
    assert first.incarnation == second.incarnation
    assert store.list("runs/r1") == ["runs/r1/config.json"]


def test_changed_config_under_same_run_id_is_refused_with_the_way_out(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "out"))
    open_run(store, _config(tmp_path))
    with pytest.raises(RunConfigMismatchError) as raised:
        open_run(store, _config(tmp_path, seed=7))
    assert "different configuration" in str(raised.value)
    assert "--run-id" in str(raised.value)


def test_two_openers_racing_on_a_new_run_agree_on_one_config(tmp_path: Path) -> None:
    config = _config(tmp_path)
    store = Store(config.output)
    handles = []

    def opener() -> None:
        handles.append(open_run(store, config))

    threads = [threading.Thread(target=opener) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({handle.incarnation for handle in handles}) == 1
    assert sum(not handle.resumed for handle in handles) == 1


def test_generated_run_ids_are_unique_and_sortable() -> None:
    ids = {make_run_id() for _ in range(2000)}
    assert len(ids) == 2000
    assert make_run_id(seed="0a1b2c3d-aaaa-bbbb").endswith("-0a1b2c3daaaa")
