"""Checkpoints are ordered by step number, never by the text of their names."""

from __future__ import annotations

import os
from pathlib import Path

from datagen.host.training import checkpoint_step, newest_checkpoint


def test_step_numbers_order_checkpoints_that_a_text_sort_gets_wrong(tmp_path: Path) -> None:
    names = ["checkpoint-9.pt", "checkpoint-10.pt", "checkpoint-100.pt", "latest.pt"]
    assert max(names, key=checkpoint_step) == "checkpoint-100.pt"
    assert sorted(names)[-1] == "latest.pt" and checkpoint_step("latest.pt") == -1


def test_the_newest_checkpoint_breaks_mtime_ties_by_step(tmp_path: Path) -> None:
    for step in (9, 10):
        path = tmp_path / f"checkpoint-{step}.pt"
        path.write_bytes(b"x")
        os.utime(path, ns=(1_000_000_000, 1_000_000_000))  # a coarse file system: the same mtime
    assert newest_checkpoint(str(tmp_path / "*.pt")) == str(tmp_path / "checkpoint-10.pt")
