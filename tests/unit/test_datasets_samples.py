"""The bundled sample files: present for every format, up to date, and readable with counted rejections."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from datagen.errors import DatasetError
from datagen.prompts.datasets import FORMATS, iter_rows
from datagen.prompts.prepare import inspect_dataset
from datagen.samples import sample_path

GENERATOR = Path(__file__).resolve().parents[1] / "fixtures" / "datasets" / "build_samples.py"


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_samples", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("format", FORMATS)
def test_bundled_samples_match_their_generator(format: str, tmp_path: Path) -> None:
    generator = load_generator()
    kind, _ = generator.SAMPLES[format]
    assert sample_path(format).endswith(f"{format}.{kind}")
    fresh = tmp_path / f"{format}.{kind}"
    generator.write_rows(fresh, kind, generator.SAMPLES[format][1])
    assert [row.data for row in iter_rows(sample_path(format))] == [row.data for row in iter_rows(str(fresh))]


@pytest.mark.parametrize("format", FORMATS)
def test_every_sample_gives_several_prompts_and_counts_its_bad_rows(format: str) -> None:
    report = inspect_dataset(format, sample_path(format), multi_turn="every_turn")
    assert 4 <= report.rows_read <= 8
    assert report.prompts >= 3
    assert report.prompts + sum(report.rejections.values()) >= report.rows_read


def test_unknown_sample_format_is_a_clear_error() -> None:
    with pytest.raises(DatasetError, match="No bundled sample"):
        sample_path("alpaca")
