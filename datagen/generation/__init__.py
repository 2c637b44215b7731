"""Generation: turn prepared prompt shards into completion records through the fleet's servers.

Owns the one dispatcher per flow process (:mod:`dispatcher`) and its state and stats (:mod:`dispatch_state`),
the OpenAI chat-completions wire format (:mod:`wire`), SGLang's ``/generate`` format for exact tokens
(:mod:`generate_api`) and one shard's generation with its checkpoints and done marker (:mod:`shard`).

May import: the shared top level (config, settings, errors, records), :mod:`datagen.engines` and
:mod:`datagen.output`.
"""

__all__ = ["dispatch_state", "dispatcher", "generate_api", "shard", "wire"]
