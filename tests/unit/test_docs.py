"""The docs match the code: the generated configuration reference, and every command a newcomer is told to type."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer

from datagen.app import cli
from datagen.app.configdoc import render_configuration_reference

REPO = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_up_to_date() -> None:
    current = (REPO / "docs" / "configuration.md").read_text()
    assert current == render_configuration_reference(), (
        "docs/configuration.md is stale: run `python -m datagen.app.configdoc > docs/configuration.md`"
    )


# The pages a newcomer follows command by command: every `datagen`, `make` and `prefect` command they name exists.
COMMAND_DOCS = ["README.md", "docs/first-run.md"]
FENCE = re.compile(r"```(?:bash|sh|yaml)?\n(.*?)```", re.S)
INLINE = re.compile(r"`((?:datagen|make|prefect) [^`]+)`")
PROGRAMS = {"datagen", "make", "prefect"}


def _commands(text: str) -> list[list[str]]:
    """Each command line of a page's code blocks and inline code, as words, from its program name on."""
    lines: list[str] = []
    for block in FENCE.findall(text):
        lines += block.replace("\\\n", " ").splitlines()
    lines += INLINE.findall(text)
    found: list[list[str]] = []
    for line in lines:
        line = re.sub(r"(^|\s)#.*$", "", line.removeprefix("- run: "))
        for part in re.split(r"&&|\|\||;|\|", line):
            words = part.replace("$(", " ").split()
            start = next((i for i, word in enumerate(words) if word in PROGRAMS), None)
            if start is not None and (start == 0 or "=" in words[start - 1] or words[start - 1] == "id"):
                found.append(words[start:])
    return found


def _subcommands(command: Any) -> dict[str, Any]:
    """A typer group's commands by name; empty for a command."""
    return dict(getattr(command, "commands", {}))


def _datagen_command(words: list[str]) -> tuple[Any, list[str]]:
    command = typer.main.get_command(cli.app)
    rest = words[1:]
    while _subcommands(command) and rest and not rest[0].startswith("-"):
        name = rest.pop(0)
        assert name in _subcommands(command), f"`{' '.join(words)}`: datagen has no command {name!r}"
        command = _subcommands(command)[name]
    return command, rest


def _options(words: list[str]) -> set[str]:
    return {word.split("=")[0] for word in words if word.startswith("--")}


@pytest.mark.parametrize("page", COMMAND_DOCS)
def test_every_datagen_and_make_command_a_page_names_exists_with_its_options(page: str) -> None:
    text = (REPO / page).read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))
    commands = _commands(text)
    assert any(words[0] == "datagen" for words in commands)
    for words in commands:
        if words[0] == "make":
            names = [word for word in words[1:] if not word.startswith("-") and "=" not in word]
            assert set(names) <= targets, f"{page}: `{' '.join(words)}` names a target the Makefile lacks"
        elif words[0] == "datagen":
            command, rest = _datagen_command(words)
            known = {opt for param in command.params for opt in param.opts + param.secondary_opts}
            assert _options(rest) <= known | {"--help"}, f"{page}: `{' '.join(words)}`: unknown options"


def test_every_prefect_command_the_pages_name_exists_with_its_options() -> None:
    from prefect.cli._app import _app  # Prefect's own command tree (cyclopts), its commands loaded on lookup

    for page in COMMAND_DOCS:
        for words in _commands((REPO / page).read_text()):
            if words[0] != "prefect":
                continue
            command = _app
            for word in words[1:]:
                if not re.fullmatch(r"[a-z][a-z-]*", word):
                    break
                try:
                    command = command[word]
                except KeyError:
                    break
            assert command is not _app, f"{page}: `{' '.join(words)}`: prefect has no such command"
            known = {name for argument in command.assemble_argument_collection() for name in argument.names}
            assert _options(words) <= known, f"{page}: `{' '.join(words)}`: unknown options"


def test_the_readmes_command_list_is_datagens() -> None:
    listed = re.search(
        r"^- `datagen --help`: (.*?)(?:\n- |\n\n|\Z)", (REPO / "README.md").read_text(), re.M | re.S
    )
    assert listed, "the README's More section lists datagen's commands"
    named = set(re.findall(r"`([a-z -]+)`", listed[1]))
    commands = {
        f"{name} {sub}" if _subcommands(command) else name
        for name, command in _subcommands(typer.main.get_command(cli.app)).items()
        for sub in (_subcommands(command) or [""])
    }
    assert named == commands
