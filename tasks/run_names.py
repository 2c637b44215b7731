"""Which flow run names Prefect made up, so a name a person typed is kept and only those are replaced.

Prefect records no flag saying who chose a flow run's name, so a name counts as Prefect's only when one of its
generators could have produced exactly it:

- the API names a run created without one with coolname's two-word slug (``prefect.utilities.names.
  generate_slug(2)``: an adjective and an animal from coolname's own word lists, lower case, never two words
  sharing their first four letters, never a word of Prefect's ``IGNORE_LIST``);
- the default UI's run form (``/v2``, Prefect 3.9.1) fills its Name field with ``<Adjective>-<Animal>``: one of
  :data:`UI_ADJECTIVES` and an animal of at most six characters from the faker list it bundles
  (:data:`UI_ANIMALS`; ``tests/unit/test_run_form.py`` checks both lists against the installed UI).

Anything else (``nightly-test``, ``qwen 2k smoke``) is a name someone gave, and is kept; the others become
``expand-<run id>``.
"""

from __future__ import annotations

import functools
from datetime import UTC
from pathlib import Path
from typing import Any, Final

import coolname
from coolname.loader import load_config
from prefect.context import FlowRunContext
from prefect.runtime import flow_run as runtime_flow_run
from prefect.utilities.names import IGNORE_LIST

from datagen.app.run_request import CheckedParameters
from datagen.config import RunConfig, is_valid_slug
from datagen.escape import printable
from datagen.output.runs import make_run_id

# The two-word pattern of coolname's default config (``"2"``: the cartesian ``adj_any`` x ``subj``).
_SLUG_PATTERN: Final = "2"

# The run form's name: `${adjective}-${animal({maxCharCount: 6})}` (deployment_._id.run-*.js of the /v2 UI).
UI_ANIMAL_MAX_CHARS: Final = 6
UI_ADJECTIVES: Final = frozenset(
    """
Awesome Rustic Small Gorgeous Fantastic Sleek Intelligent Unbranded Refined Licensed Generic Practical
Ergonomic Handcrafted Tasty Handmade Incredible
""".split()  # noqa: SIM905 (a word list, kept readable)
)
UI_ANIMALS: Final = frozenset(
    """
Addax Aidi Ainu Akbash Akita Alabai Alpaca Alusky Ant Ape Asp Avocet Baboon Badger Baiji Barb Barbet Bass Bat
Baya Beagle Beago Bear Beaski Beaver Bee Beetle Bichir Bilby Bird Birman Bison Boas Bobcat Boggle Boiga Bombay
Bongo Bonobo Booby Borkie Bowfin Boxsky Briard Brug Caiman Camel Cantil Carp Cat Chipit Chipoo Chiton Chusky
Cicada Coati Cobras Cockle Collie Conure Coral Corkie Cougar Cow Coyote Crab Crane Crow Cuckoo Cuscus Daniff
Danios Daug Deer Dhole Dingo Discus Dodo Dog Donkey Dorgi Dorkie Douc Doxle Drever Duck Dugong Dunker Eagle
Earwig Eel Egret Eider Eland Elk Emu Ermine Eryops Falcon Feist Ferret Fish Flea Fly Fossa Fox Frog Frug Gar
Gecko Genet Gerbil Gibbon Gnat Goat Gollie Goose Gopher Grebe Grouse Guppy Hare Hawk Heron Hoopoe Horgi Hornet
Horse Human Husky Hyena Ibex Ibis Iguana Impala Indri Insect Jabiru Jacana Jackal Jaguar Jerboa Kagu Kakapo
Kea Keagle Kishu Kiwi Koala Kodkod Koolie Kowari Krait Krill Kudu Kuvasz Leech Lemur Liger Limpet Linnet Lion
Lizard Llama Loach Locust Loris Lynx Macaw Maggot Magpie Malchi Mamba Marmot Mauzer Mayfly Meagle Miki Mink
Mole Molly Monkey Moose Morkie Moth Mouse Mudi Mule Muskox Newt Nilgai Numbat Nutria Nyala Ocelot Okapi Olingo
Olm Onager Opah Oribi Osprey Otter Owl Ox Oyster Parrot Peagle Pig Pigeon Pika Pitsky Pomchi Pomsky Poodle
Poogle Possum Potoo Prawn Puffin Pug Puggle Puli Puma Pumi Python Quagga Quail Quokka Quoll Rabbit Raggle Rat
Rhea Robin Sable Saiga Salmon Saluki Sambar Saola Seal Serval Shark Sheep Shichi Shrew Shrimp Skua Skunk Sloth
Slug Snail Snake Somali Sphynx Spider Sponge Squid Stoat Stork Swan Taipan Takin Tang Tapir Tarpon Tetra
Thrush Tick Tiger Torkie Tosa Toucan Towhee Trout Tuna Turaco Turkey Uakari Uguisu Unau Urial Vicuña Viper
Vizsla Vole Walrus Wasp Weasel Wolf Wombat Worm Wrasse Xeme Xerus Yak Yarara Zebra Zebu Zokor Zonkey Zorse
Zuchon
""".split()  # noqa: SIM905 (a word list, kept readable)
)


@functools.cache
def _slug_word_lists() -> tuple[tuple[frozenset[str], ...], ...]:
    """Each two-word alternative of coolname's default config, as the words each position may take."""
    config: dict[str, Any] = dict(load_config(Path(coolname.__file__).parent / "data"))

    def words(name: str) -> frozenset[str]:
        entry = config[name]
        if entry["type"] == "words":
            return frozenset(entry["words"])
        assert entry["type"] == "nested", f"coolname list {name}: {entry['type']}"
        return frozenset().union(*(words(part) for part in entry["lists"]))

    alternatives = []
    for name in config[_SLUG_PATTERN]["lists"]:
        entry = config[name]
        assert entry["type"] == "cartesian" and len(entry["lists"]) == 2, f"coolname pattern {name}"
        alternatives.append(tuple(words(part) for part in entry["lists"]))
    return tuple(alternatives)


def _is_coolname_slug(words: list[str]) -> bool:
    """True when ``generate_slug(2)`` of Prefect could return these two words."""
    first, second = words
    if first == second or first[:4] == second[:4] or IGNORE_LIST.intersection(words):
        return False
    return any(first in head and second in tail for head, tail in _slug_word_lists())


def is_generated_run_name(name: str) -> bool:
    """True when ``name`` is one Prefect could have made up: the API's slug or the run form's prefill."""
    words = name.split("-")
    if len(words) != 2:
        return False
    if _is_coolname_slug(words):
        return True
    adjective, animal = words
    return adjective in UI_ADJECTIVES and animal in UI_ANIMALS and len(animal) <= UI_ANIMAL_MAX_CHARS


def generated_run_id() -> str:
    """The run id of a run started without one: stable for the flow run (its id and creation time)."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return make_run_id()
    created = context.flow_run.created
    return make_run_id(seed=str(context.flow_run.id), now=created.astimezone(UTC) if created else None)


def run_id_of(parameters: dict[str, Any]) -> str | None:
    """The run id a flow run's parameters give, if any, for its name (never reads the box's configs).

    The operator's flow receives its config resolved, run id included; a deployment's run gives its
    ``run_id`` parameter, else takes the flow run's own (:func:`generated_run_id`), as its body does.
    """
    run_id = parameters.get("run_id")
    config = parameters.get("config")
    if not run_id and isinstance(config, RunConfig | dict):  # the operator's flow: a whole config
        run_id = config.run_id if isinstance(config, RunConfig) else config.get("run_id")
    return run_id if isinstance(run_id, str) and is_valid_slug(run_id) else None


def given_run_name(name: str | None) -> str | None:
    """The name a person gave the flow run at creation (the run form's Name, ``--flow-run-name``), if any.

    A name one of Prefect's generators could have produced (:func:`is_generated_run_name`) counts as Prefect's,
    and so does ours, ``expand-<run id>``, from an earlier attempt. Control characters in it are shown as their
    escapes (the name is renamed to that at the run's start), so the name never forges a log line.
    """
    if not name or is_generated_run_name(name) or name.startswith("expand-"):
        return None
    return printable(name)


def expand_run_name() -> str:
    """The `expand` flow run's name: the one given at creation when a person gave one, else ``expand-<run id>``.

    ``expand-<run id>`` uses the given run id, else the one the run will generate.
    """
    context = FlowRunContext.get()
    given = given_run_name(context.flow_run.name if context and context.flow_run else None)
    if given is not None:
        return given
    parameters = dict(runtime_flow_run.parameters or {})
    config = parameters.get("config")
    if isinstance(config, CheckedParameters) and config.refusal is not None:
        return "expand-refused"
    return f"expand-{run_id_of(parameters) or generated_run_id()}"
