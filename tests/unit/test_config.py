"""Run configs: the examples validate, mistakes are reported with the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from datagen.config import RunConfig, load_run_config, parse_run_config
from datagen.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]

MINIMAL = {
    "model": {"path": "/models/m"},
    "datasets": [{"name": "metamath", "format": "metamath", "path": "/data/m.json"}],
    "output": "/tmp/out",
}


@pytest.mark.parametrize("name", sorted(path.name for path in (REPO / "configs").glob("*.yaml")))
def test_example_configs_validate(name: str) -> None:
    config = load_run_config(REPO / "configs" / name)
    assert config.datasets


def test_the_nightly_gives_training_back_by_seven_within_six_hours_of_its_halt() -> None:
    import datetime as dt

    window = load_run_config(REPO / "configs" / "qwen36-27b-nightly.yaml").window
    halted = dt.datetime(2026, 12, 7, 1, 0, tzinfo=dt.UTC)
    assert window.deadline(halted) == dt.datetime(2026, 12, 7, 7, 0, tzinfo=dt.UTC)
    # Halted late (another run held the GPUs until 02:30): still 07:00; halted after 07:00: six hours, not a day.
    assert window.deadline(halted + dt.timedelta(hours=1.5)) == dt.datetime(2026, 12, 7, 7, 0, tzinfo=dt.UTC)
    late = dt.datetime(2026, 12, 7, 8, 0, tzinfo=dt.UTC)
    assert window.deadline(late) == late + dt.timedelta(hours=6)


def test_unknown_key_is_named_with_the_fix() -> None:
    data = {**MINIMAL, "fleet": {"engine": "transformers", "max_inflight": 4}}
    with pytest.raises(ConfigError) as raised:
        parse_run_config(data, source="run.yaml")
    message = str(raised.value)
    assert "run.yaml" in message
    assert "fleet.max_inflight: unknown key" in message


def test_missing_required_field_and_bad_value_are_both_reported() -> None:
    data = {"datasets": [{"name": "Bad Name!", "format": "metamath", "path": "x"}], "output": "/o"}
    with pytest.raises(ConfigError) as raised:
        parse_run_config(data)
    message = str(raised.value)
    assert "model: required" in message
    assert "datasets.0.name" in message


def test_unknown_dataset_format_lists_the_allowed_ones() -> None:
    data = {**MINIMAL, "datasets": [{"name": "x", "format": "alpaca", "path": "x"}]}
    with pytest.raises(ConfigError, match="infinity_instruct"):
        parse_run_config(data)


def test_external_engine_without_urls_is_refused() -> None:
    with pytest.raises(ConfigError, match="external_urls"):
        parse_run_config({**MINIMAL, "fleet": {"engine": "external"}})


def test_duplicate_dataset_names_are_refused() -> None:
    dataset = MINIMAL["datasets"][0]
    with pytest.raises(ConfigError, match="repeated: metamath"):
        parse_run_config({**MINIMAL, "datasets": [dataset, dataset]})


def test_missing_file_and_bad_yaml_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_run_config(broken)


def test_config_hash_ignores_run_id_but_not_content() -> None:
    first = RunConfig.model_validate({**MINIMAL, "run_id": "a"})
    second = RunConfig.model_validate({**MINIMAL, "run_id": "b"})
    third = RunConfig.model_validate({**MINIMAL, "run_id": "a", "seed": 1})
    assert first.config_hash() == second.config_hash()
    assert first.config_hash() != third.config_hash()


def test_conversation_rows_at_its_default_keeps_older_runs_config_hash() -> None:
    plain = RunConfig.model_validate(MINIMAL)
    assert "conversation_rows" not in plain.identity_dict()["tokenize"]
    assert "formats" not in plain.identity_dict()["tokenize"]
    default = RunConfig.model_validate({**MINIMAL, "tokenize": {"conversation_rows": "per_turn"}})
    whole = RunConfig.model_validate({**MINIMAL, "tokenize": {"conversation_rows": "per_conversation"}})
    jsonl = RunConfig.model_validate({**MINIMAL, "tokenize": {"formats": ["parquet", "jsonl"]}})
    assert default.config_hash() == plain.config_hash()
    assert whole.config_hash() != plain.config_hash()
    assert whole.identity_dict()["tokenize"]["conversation_rows"] == "per_conversation"
    assert "conversation_rows" not in jsonl.identity_dict()["tokenize"]
    assert jsonl.identity_dict()["tokenize"]["formats"] == ["parquet", "jsonl"]


def test_per_dataset_sampling_overrides_only_what_they_set() -> None:
    data = {
        **MINIMAL,
        "sampling": {"temperature": 0.6, "max_tokens": 100},
        "datasets": [
            {
                "name": "a",
                "format": "metamath",
                "path": "x",
                "sampling": {"max_tokens": 7, "enable_thinking": False},
            }
        ],
    }
    config = parse_run_config(data)
    sampling = config.sampling_for(config.datasets[0])
    assert (sampling.temperature, sampling.max_tokens, sampling.enable_thinking) == (0.6, 7, False)


MIX = [
    {"name": "cold", "weight": 3, "temperature": 0.2, "enable_thinking": False, "max_tokens": 50},
    {"name": "hot", "weight": 1, "temperature": 1.0, "top_k": 20, "max_tokens": 300},
]


def _mixed(mix: list[dict[str, object]]) -> RunConfig:
    dataset = {
        "name": "a",
        "format": "metamath",
        "path": "x",
        "sampling": {"top_p": 0.8},
        "sampling_mix": mix,
    }
    return parse_run_config({**MINIMAL, "sampling": {"max_tokens": 100}, "datasets": [dataset]})


def test_a_sampling_mix_gives_each_prompt_one_setting_by_its_id_in_proportion_to_the_weights() -> None:
    config = _mixed(MIX)
    dataset = config.datasets[0]
    drawn = [config.sampling_for_prompt(dataset, f"prompt-{i}") for i in range(4000)]
    again = [config.sampling_for_prompt(dataset, f"prompt-{i}") for i in range(4000)]
    assert drawn == again, "a resume draws what the first attempt drew"
    names = [name for name, _ in drawn]
    assert names.count("cold") / len(names) == pytest.approx(0.75, abs=0.03)
    by_name = dict(drawn)
    cold, hot = by_name["cold"], by_name["hot"]
    # Each setting changes only what it sets, over the dataset's sampling (top_p) and the run's (max_tokens).
    assert (cold.temperature, cold.enable_thinking, cold.max_tokens, cold.top_p, cold.top_k) == (
        0.2,
        False,
        50,
        0.8,
        None,
    )
    assert (hot.temperature, hot.enable_thinking, hot.max_tokens, hot.top_p, hot.top_k) == (
        1.0,
        None,
        300,
        0.8,
        20,
    )
    assert config.max_tokens_for(dataset) == 300, "the plan sizes the context for the longest setting"


def test_a_dataset_without_a_mix_samples_as_before_and_keeps_its_config_hash() -> None:
    plain = parse_run_config(MINIMAL)
    assert plain.sampling_for_prompt(plain.datasets[0], "p") == (None, plain.sampling_for(plain.datasets[0]))
    assert "sampling_mix" not in plain.identity_dict()["datasets"][0]
    assert _mixed(MIX).config_hash() != _mixed(MIX[:1]).config_hash()


@pytest.mark.parametrize(
    ("mix", "expected"),
    [
        ([{"name": "a", "weight": 1}, {"name": "a", "weight": 2}], "more than once: a"),
        ([{"name": "a", "weight": 0}], "weight"),
        ([{"name": "a", "weight": 1, "samples_per_prompt": 2}], "samples_per_prompt: unknown key"),
        ([{"name": "a", "weight": 1, "top_p": 1.5}], "top_p"),
    ],
)
def test_a_bad_sampling_mix_is_refused_naming_the_field(mix: list[dict[str, object]], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        _mixed(mix)


def test_cli_overrides_replace_top_level_keys(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(MINIMAL))
    config = load_run_config(path, overrides={"run_id": "night-1", "output": "s3://b/x", "seed": None})
    assert (config.run_id, config.output, config.seed) == ("night-1", "s3://b/x", 0)


def test_the_nightly_is_the_8xgpu_config_with_a_series_a_window_a_restart_and_a_base_version() -> None:
    box = yaml.safe_load((REPO / "configs" / "qwen36-27b-8xgpu.yaml").read_text())
    nightly = yaml.safe_load((REPO / "configs" / "qwen36-27b-nightly.yaml").read_text())
    differ = {key for key in box.keys() | nightly.keys() if box.get(key) != nightly.get(key)}
    assert differ <= {"series", "window", "training", "tokenize"}
