"""The run form Prefect's UI draws from the `expand` deployments' parameter schema, and their descriptions.

The schema is the one `prefect deploy` stores (``parameter_schema`` of the flow's function): every field is
titled by its key (what ``--param`` and the YAML use), none by a class name, each has a short description,
every optional field shows its default, and only ``config`` is required (expand-manual gives it no default,
so a click on Run never starts a run that halts training).
"""

from __future__ import annotations

import functools
import random
import re
from pathlib import Path
from typing import Any

import yaml
from prefect.utilities.callables import parameter_schema

from datagen.app.deploy import PREFECT_FILE, _deploy_copy, configs_note, form_schema
from datagen.app.run_request import RunRequest, SamplingChoice, config_names
from flows.expand import _expand
from tasks.run_names import UI_ADJECTIVES, UI_ANIMAL_MAX_CHARS, UI_ANIMALS, given_run_name

REPO = Path(__file__).resolve().parents[2]
CLASS_NAMES = {"SamplingChoice", "RunRequest", "HostRequest", "RunConfig", "Parameters"}
# Long enough for what and why in a line or two, short enough not to fill the form.
MAX_DESCRIPTION = 200


def _schema() -> dict[str, Any]:
    return parameter_schema(_expand).model_dump_for_openapi()


def _titled(schema: Any) -> list[tuple[str, str]]:
    """(path, title) of every titled node under the top level."""
    found: list[tuple[str, str]] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("title"), str) and path:
                found.append((path, node["title"]))
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else key)
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, f"{path}[{index}]")

    walk(schema, "")
    return found


def test_the_form_is_titled_by_yaml_key_with_no_class_name_and_no_duplicate_label() -> None:
    schema = _schema()
    titles = _titled(schema)
    assert [(path, title) for path, title in titles if title in CLASS_NAMES] == []
    for name, field in schema["properties"].items():
        assert field["title"] == name
    sampling = schema["definitions"]["SamplingChoice"]
    assert sampling["title"] == "sampling"
    for name, field in sampling["properties"].items():
        assert field["title"] == name
    top = [field["title"] for field in schema["properties"].values()]
    assert len(top) == len(set(top))


def test_every_field_has_a_short_description_and_every_optional_one_its_default() -> None:
    schema = _schema()
    fields = {**schema["properties"]}
    fields.update(
        {f"sampling.{k}": v for k, v in schema["definitions"]["SamplingChoice"]["properties"].items()}
    )
    for name, field in fields.items():
        description = field.get("description") or ""
        assert description, name
        assert len(description) <= MAX_DESCRIPTION, (name, len(description))
        assert "``" not in description, name  # the form shows reStructuredText markup as it is
    assert schema["required"] == ["config"]
    for name, field in schema["properties"].items():
        if name != "config":
            assert "default" in field, name
    assert schema["properties"]["retry_failed"]["default"] is False


def test_the_form_holds_the_run_choices_only() -> None:
    schema = _schema()
    assert set(schema["properties"]) == set(RunRequest.model_fields)
    assert set(schema["definitions"]) == {"SamplingChoice"}
    assert set(schema["definitions"]["SamplingChoice"]["properties"]) == set(SamplingChoice.model_fields)


def test_expand_manual_has_no_default_config_and_its_deployed_description_names_the_configs(
    tmp_path: Path,
) -> None:
    source = REPO / PREFECT_FILE
    names = config_names(REPO / "configs")
    assert "demo-worker" in names and "qwen36-27b-8xgpu" in names

    copy = yaml.safe_load(_deploy_copy(source, "git-abc", names, tmp_path).read_text())

    deployments = {entry["name"]: entry for entry in copy["deployments"]}
    manual = deployments["expand-manual"]
    assert not manual.get("parameters")
    assert manual["description"].endswith(configs_note(names))
    assert ", ".join(names) in manual["description"]
    # The nightly names its config; the host part is started by the parent run: neither gets the list.
    assert configs_note(names) not in deployments["expand-nightly"]["description"]
    assert configs_note(names) not in deployments["expand-host"]["description"]
    assert {entry["version"] for entry in copy["deployments"]} == {"git-abc"}
    assert not (REPO / "deployments" / "git-abc").exists()


def test_a_typed_name_is_kept_and_only_names_prefects_generators_make_are_replaced() -> None:
    from prefect.utilities.names import generate_slug

    # Typed names, two-word ones included: no generator of Prefect makes these.
    for typed in (
        "nightly-test",
        "smoke-test",
        "qwen-rerun",
        "Generic-Test",
        "golden-Camel",
        "qwen 2k smoke test",
        "nightly-rerun-3",
        "ab-ab",
    ):
        assert given_run_name(typed) == typed, typed
    # The API's names for a run created without one, and the default UI's prefilled Name.
    for _ in range(2000):
        assert given_run_name(generate_slug(2)) is None
    for _ in range(500):
        assert given_run_name(_ui_prefilled_name()) is None
    assert given_run_name("golden-camel") is None and given_run_name("Generic-Baboon") is None
    assert given_run_name("expand-20261204-010000-ab12cd") is None  # ours, from an earlier attempt
    assert given_run_name(None) is None and given_run_name("") is None


@functools.cache
def _ui_run_form_words() -> tuple[list[str], list[str]]:
    """The adjectives and the animals the installed default UI's run form picks its prefilled Name from."""
    import prefect

    assets = Path(prefect.__file__).parent / "server" / "ui-v2" / "assets"
    (script,) = [text for path in assets.glob("*.js") if "maxCharCount" in (text := path.read_text())]
    generator = re.search(r"=\(\)=>`\$\{(\w+)\(\)\}-\$\{(\w+)\(\{maxCharCount:(\d+)\}\)\}`", script)
    assert generator, "the run form's name generator moved: update tasks/run_names.py"
    adjectives_fn, animals_fn, max_chars = generator.groups()
    assert int(max_chars) == UI_ANIMAL_MAX_CHARS

    def picked_list(function: str) -> str:
        found = re.search(rf"function {re.escape(function)}\(e\)\{{return \w+\((\w+),e\)\}}", script)
        assert found, function
        return found.group(1)

    def words(variable: str) -> list[str]:
        found = re.search(rf"\b{re.escape(variable)}=(\[[^\]]*\]|`[^`]*`\.split\(`\.`\))", script)
        assert found, variable
        text = found.group(1)
        return (
            text[1 : -len("`.split(`.`)")].split(".")
            if text.startswith("`")
            else re.findall(r"`([^`]*)`", text)
        )

    return words(picked_list(adjectives_fn)), words(picked_list(animals_fn))


def _ui_prefilled_name() -> str:
    adjectives, animals = _ui_run_form_words()
    return (
        f"{random.choice(adjectives)}-{random.choice([a for a in animals if len(a) <= UI_ANIMAL_MAX_CHARS])}"
    )


def test_the_run_form_name_lists_are_the_installed_uis() -> None:
    adjectives, animals = _ui_run_form_words()
    assert set(adjectives) == UI_ADJECTIVES
    assert {animal for animal in animals if len(animal) <= UI_ANIMAL_MAX_CHARS} == UI_ANIMALS


def test_the_stored_form_schema_draws_optional_fields_plainly_and_the_server_still_takes_null() -> None:
    from prefect.utilities.schema_tools.validation import validate

    drawn = form_schema(_schema())

    for name in ("run_id", "max_prompts", "series", "output", "datasets", "sampling"):
        field = drawn["properties"][name]
        assert "anyOf" not in field and "default" not in field and field["type"], name
    assert drawn["properties"]["max_prompts"]["type"] == "integer"
    assert drawn["properties"]["retry_failed"] == _schema()["properties"]["retry_failed"]
    # sampling: a plain section (no None toggle) titled by its key, its own fields plain, no class left over.
    sampling = drawn["properties"]["sampling"]
    assert sampling["type"] == "object" and sampling["title"] == "sampling"
    assert sampling["description"] == _schema()["properties"]["sampling"]["description"]
    assert "definitions" not in drawn and "$ref" not in str(drawn)
    top_p = sampling["properties"]["top_p"]
    assert top_p["type"] == "number" and top_p["maximum"] == 1 and "default" not in top_p
    assert [name for name, field in sampling["properties"].items() if "anyOf" in field] == []
    # What the UI's JSON mode and `prefect deployment run` send: unset choices as null, or left out.
    unset = dict.fromkeys(["run_id", "max_prompts", "series", "output", "sampling", "datasets"])
    for sent in (
        {"config": "demo", **unset},
        {"config": "demo"},
        {"config": "demo", "sampling": {}},
        {"config": "demo", **unset, "sampling": {"temperature": None, "top_p": 0.5}},
    ):
        assert [
            error.message for error in validate(sent, drawn, preprocess=True, ignore_required=False)
        ] == []
    wrong = {"config": "demo", "max_prompts": "many", "sampling": {"top_p": 5}}
    errors = validate(wrong, drawn, preprocess=True, ignore_required=False)
    assert sorted(str(list(error.path)) for error in errors) == ["['max_prompts']", "['sampling', 'top_p']"]
    unknown = {"config": "demo", "sampling": {"restart_command": ["sh"]}}
    assert validate(unknown, drawn, preprocess=True, ignore_required=False)


def test_an_untouched_sampling_section_changes_nothing() -> None:
    assert RunRequest(config="demo", sampling={}).sampling is None
    assert RunRequest(config="demo", sampling={"seed": None}).sampling is None
    assert not RunRequest(config="demo", run_id="r1", sampling={}).changes_config()
    chosen = RunRequest(config="demo", sampling={"enable_thinking": False})
    assert chosen.sampling == SamplingChoice(enable_thinking=False) and chosen.changes_config()
