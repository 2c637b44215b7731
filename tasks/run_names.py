"""Which flow run names Prefect made up, so a name a person typed is kept and only those are replaced.

Prefect records no flag saying who chose a flow run's name, so a name counts as Prefect's only when one of its
generators could have produced exactly it:

- the API names a run created without one with coolname's two-word slug (``prefect.utilities.names.
  generate_slug(2)``: an adjective and an animal from coolname's own word lists, lower case, never two words
  sharing their first four letters, never a word of Prefect's ``IGNORE_LIST``);
- the default UI's run form (``/v2``, Prefect 3.9.1) fills its Name field with ``<Adjective>-<Animal>``: one of
  :data:`UI_ADJECTIVES` and an animal of at most six characters from the faker list it bundles
  (:data:`UI_ANIMALS`; ``tests/unit/test_run_form.py`` checks both lists against the installed UI).

Anything else (``nightly-test``, ``qwen 2k smoke``) is a name someone gave.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Final

import coolname
from coolname.loader import load_config
from prefect.utilities.names import IGNORE_LIST

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
