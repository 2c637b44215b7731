"""SpecForge's and speculators' own data loading read a datagen dataset version as-is, every row unchanged.

The dataset: versions written by real merges on the real Qwen3 tokenizer and chat template
(:mod:`tests.support.trainer_rows`; single-turn, dataset multi-turn and tool rows, and every turn of on-policy
conversations), the second extending the first, and a third extending the second with the second run's
completions merged with ``tokenize.conversation_rows: per_conversation`` (one row per on-policy conversation,
loss on each of its assistant turns), exported by ``datagen export``. Each trainer
runs in its own venv (the PyPI wheel installed ``--no-deps`` plus its light dependencies,
:mod:`tests.support.trainer_venvs`) on the exact commands ``datagen export`` printed
(:mod:`tests.support.trainer_load`): SpecForge 0.2.0's ``load_config`` + ``prepare_prompt_tasks``, speculators
0.9.0's ``prepare-data`` console command + its ``TrainConfig`` + its training ``ArrowDataset``.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from datagen.app.cli import app
from datagen.dataset.export import find_export
from datagen.dataset.versions import DatasetVersion, ExportRecord
from datagen.output.store import Store
from tests.support.on_policy import SCRIPTS
from tests.support.qwen import build_qwen_tokenizer_dir
from tests.support.trainer_rows import merge_run, parquet_rows
from tests.support.trainer_venvs import ensure_venv

REPO = Path(__file__).resolve().parents[2]
LOADER = REPO / "tests" / "support" / "trainer_load.py"
LOAD_TIMEOUT_S = 900

Rows = list[tuple[list[int], list[int]]]


class Exported:
    """A dataset version, its export, the commands ``datagen export`` printed, and its Parquet rows."""

    def __init__(
        self, root: Path, tokenizer: Path, version: DatasetVersion, record: ExportRecord, output: str
    ) -> None:
        self.root = root
        self.tokenizer = tokenizer
        self.version = version
        self.record = record
        self.commands = [
            line.strip()
            for line in output.splitlines()
            if line.strip().startswith(("specforge ", "speculators "))
        ]
        self.rows: Rows = parquet_rows(version)

    def command(self, prefix: str) -> str:
        (line,) = [line for line in self.commands if line.startswith(prefix)]
        return line


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    tokenizer = build_qwen_tokenizer_dir(tmp_path_factory.mktemp("qwen3"), "qwen3")
    root = tmp_path_factory.mktemp("store")
    first = merge_run(root, tokenizer, "run-a", "alpha", 0)
    second = merge_run(root, tokenizer, "run-b", "beta", 100, base_version=first.dataset_version_url)
    # The second run's completions again, merged with one row per on-policy conversation, as the third version.
    third = merge_run(
        root,
        tokenizer,
        "run-c",
        "beta",
        100,
        base_version=second.dataset_version_url,
        conversation_rows="per_conversation",
    )
    result = CliRunner().invoke(app, ["export", third.dataset_version_url, "--tokenizer", str(tokenizer)])
    assert result.exit_code == 0, result.output
    store = Store(str(root))
    version = DatasetVersion.model_validate(store.read_json(third.dataset_version))
    record = find_export(store, version)
    assert record is not None
    # On-policy turns share their conversation's prompt id: in the first two versions every turn is a row (2 runs x
    # 2 shards each), in the third every conversation is one row whose mask trains each of its turns.
    per_turn = [url for url in version.parquet_urls() if "/run-c/" not in url]
    conversations = Counter(prompt_id for url in per_turn for prompt_id in _prompt_ids(url))
    assert sorted(n for n in conversations.values() if n > 1) == sorted(
        len(script[2]) for script in SCRIPTS.values() for _ in range(4)
    )
    whole = [part.url for part in third.parts]
    assert set(version.parquet_urls()) - set(per_turn) == set(whole)
    assert third.rows == second.rows - third.turns_in_conversation_rows
    assert third.turns_in_conversation_rows == 2 * sum(len(script[2]) - 1 for script in SCRIPTS.values())
    runs = sorted(_loss_runs(mask) for url in whole for mask in _masks(url))
    assert runs[-len(SCRIPTS) * 2 :] == sorted(
        len(script[2]) for script in SCRIPTS.values() for _ in range(2)
    )
    return Exported(root, tokenizer, version, record, result.output)


def _masks(url: str) -> list[list[int]]:
    import pyarrow.parquet as pq

    masks: list[list[int]] = pq.read_table(url, columns=["loss_mask"]).column("loss_mask").to_pylist()
    return masks


def _loss_runs(mask: list[int]) -> int:
    """Runs of trained tokens: one per assistant turn the row trains."""
    return sum(1 for index, bit in enumerate(mask) if bit and (index == 0 or not mask[index - 1]))


def _prompt_ids(url: str) -> list[str]:
    import pyarrow.parquet as pq

    ids: list[str] = pq.read_table(url, columns=["prompt_id"]).column("prompt_id").to_pylist()
    return ids


def load(trainer: str, workdir: Path, tokenizer: Path, commands: Sequence[str]) -> dict[str, Any]:
    """Run ``trainer``'s loading on ``commands`` in its venv; the rows it holds."""
    python = ensure_venv(trainer)
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "rows.json"
    subprocess.run(
        [str(python), str(LOADER), trainer, str(out), str(tokenizer), "--", " ;; ".join(commands)],
        check=True,
        timeout=LOAD_TIMEOUT_S,
        cwd=workdir,
        # The tokenizer is a local folder: nothing may reach for the Hugging Face Hub.
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )
    result: dict[str, Any] = json.loads(out.read_text())
    result["rows"] = [(list(ids), list(mask)) for ids, mask in result["rows"]]
    return result


def assert_same_rows(expected: Rows, loaded: Rows, *, ordered: bool) -> None:
    """Every row read, each one's input_ids and loss_mask equal to datagen's (in order, or as a multiset)."""
    assert len(loaded) == len(expected), f"{len(loaded)} rows read of {len(expected)}"
    if not ordered:
        expected, loaded = sorted(expected), sorted(loaded)
    for index, (want, got) in enumerate(zip(expected, loaded, strict=True)):
        assert got[0] == want[0], f"row {index}: input_ids differ"
        assert got[1] == want[1], f"row {index}: loss_mask differs"


def test_specforge_reads_every_row_of_the_version_unchanged(exported: Exported, tmp_path: Path) -> None:
    command = exported.command("specforge train")
    assert f"data.max_length={exported.record.longest_row_tokens}" in command
    loaded = load("specforge", tmp_path, exported.tokenizer, [command])
    assert loaded["prompts_path"] == exported.record.url
    assert loaded["max_length"] == max(len(ids) for ids, _ in exported.rows)
    assert_same_rows(exported.rows, loaded["rows"], ordered=True)


def test_speculators_prepare_data_and_train_read_every_row_of_the_version_unchanged(
    exported: Exported, tmp_path: Path
) -> None:
    prepare, train = exported.command("speculators prepare-data"), exported.command("speculators train")
    assert f"--seq-length {exported.record.longest_row_tokens}" in prepare
    loaded = load("speculators", tmp_path, exported.tokenizer, [prepare, train])
    assert loaded["total_seq_len"] == exported.record.longest_row_tokens
    assert loaded["seq_len"] == [len(ids) for ids, _ in loaded["rows"]]
    # prepare-data shuffles the rows (seed 0); every one is there, unchanged.
    assert_same_rows(exported.rows, loaded["rows"], ordered=False)


def test_a_row_that_differs_from_the_parquet_fails_the_loader_check(
    exported: Exported, tmp_path: Path
) -> None:
    # A copy of the export with one loss-mask bit flipped: the trainer reads it, and the check must fail.
    lines = Path(exported.record.url).read_text().splitlines()
    row = json.loads(lines[3])
    row["loss_mask"][-1] = 1 - row["loss_mask"][-1]
    lines[3] = json.dumps(row)
    changed = tmp_path / "changed.jsonl"
    changed.write_text("\n".join(lines) + "\n")
    command = exported.command("specforge train").replace(exported.record.url, str(changed))
    loaded = load("specforge", tmp_path / "run", exported.tokenizer, [command])
    with pytest.raises(AssertionError, match="row 3: loss_mask differs"):
        assert_same_rows(exported.rows, loaded["rows"], ordered=True)
    assert shlex.split(command)[-2] == f"data.prompts_path={changed}"
