"""Generation: turn prepared prompt shards into completion records through the fleet's servers.

Owns the one dispatcher per flow process (:mod:`dispatcher`), the OpenAI/SGLang wire format (:mod:`wire`)
and one shard's generation with its checkpoints and done marker (:mod:`shard`).

May import: the shared top level (config, settings, errors, records), :mod:`datagen.engines` and
:mod:`datagen.output`.
"""

__all__ = ["dispatcher", "shard", "wire"]
