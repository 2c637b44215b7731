"""Relative locations in a config resolve against the config file's folder, never the caller's."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from datagen.config import load_run_config, resolve_relative_paths

REPO = Path(__file__).resolve().parents[2]


def test_relative_locations_join_the_config_folder_and_the_rest_is_untouched(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    data = {
        "model": {"path": "model", "tokenizer_path": "Qwen/Qwen3-8B"},
        "datasets": [{"name": "a", "format": "metamath", "path": "prompts/*.json"}],
        "output": "../out",
        "protected_prefixes": ["train", "s3://bucket/train", "/abs/train"],
        "training": {"kind": "pidfile", "pidfile": "run/t.pid", "checkpoint_glob": "/ckpt/*.pt"},
        "existing_corpus": {"dedupe_against": [{"kind": "prompt_ids", "path": "ids.txt"}]},
        "tokenize": {"base_version": "datasets/x/v0001.json"},
    }
    resolved = resolve_relative_paths(data, str(tmp_path))

    assert resolved["model"]["path"] == str(tmp_path / "model")
    assert resolved["model"]["tokenizer_path"] == "Qwen/Qwen3-8B"  # a hub id: no such folder here
    assert resolved["datasets"][0]["path"] == str(tmp_path / "prompts" / "*.json")
    assert resolved["output"] == str(tmp_path.parent / "out")
    assert resolved["protected_prefixes"] == [str(tmp_path / "train"), "s3://bucket/train", "/abs/train"]
    assert resolved["training"]["pidfile"] == str(tmp_path / "run" / "t.pid")
    assert resolved["training"]["checkpoint_glob"] == "/ckpt/*.pt"
    assert resolved["existing_corpus"]["dedupe_against"][0]["path"] == str(tmp_path / "ids.txt")
    assert resolved["tokenize"]["base_version"] == "datasets/x/v0001.json"  # a key in the output store
    assert data["output"] == "../out"  # the input is not modified


def test_an_s3_config_folder_joins_as_a_url() -> None:
    resolved = resolve_relative_paths(
        {"datasets": [{"path": "../prompts/a.json"}], "output": "out"}, "s3://bucket/configs"
    )
    assert resolved["datasets"][0]["path"] == "s3://bucket/prompts/a.json"
    assert resolved["output"] == "s3://bucket/configs/out"


def test_the_demo_config_means_the_same_files_from_any_working_folder(tmp_path: Path) -> None:
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        config = load_run_config(REPO / "configs" / "demo.yaml")
    finally:
        os.chdir(cwd)
    assert config.output == str(REPO)
    assert config.model.path == str(REPO / "runs" / "_demo" / "tiny-model")
    assert all(Path(dataset.path).is_file() for dataset in config.datasets)
    assert yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())["output"] == ".."
