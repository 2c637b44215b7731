"""Prompts: read instruction datasets, normalise rows, and choose which prompts a run generates for.

Owns the dataset readers (:mod:`datasets`), prompt preparation as a chain of named rules (:mod:`prepare`,
:mod:`rules`) and the target mix (:mod:`mix`).

May import: the shared top level (config, settings, errors, records) and :mod:`datagen.output` (the store and
layout that prompt shards are written to).
"""

__all__ = ["datasets", "mix", "prepare", "rules"]
