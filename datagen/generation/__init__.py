"""Generation: turn prepared prompt shards into completion records through the fleet's servers.

Owns the one dispatcher per flow process (:mod:`dispatcher`, wiring its parts: admission and server choice in
:mod:`dispatch_admission`, one try in :mod:`dispatch_attempt`, the retry policy in :mod:`retry`, the server
table and health in :mod:`dispatch_health`, counters in :mod:`dispatch_stats`, its thread in
:mod:`dispatch_loop`) and its state and stats (:mod:`dispatch_state`),
the OpenAI chat-completions wire format (:mod:`openai_chat`), SGLang's ``/generate`` format for exact tokens
(:mod:`sglang_generate`) and one shard's generation with its checkpoints and done marker (:mod:`shard`).

May import: the shared top level (config, settings, errors, records), :mod:`datagen.engines` and
:mod:`datagen.output`.
"""

__all__ = [
    "dispatch_admission",
    "dispatch_attempt",
    "dispatch_health",
    "dispatch_loop",
    "dispatch_state",
    "dispatch_stats",
    "dispatcher",
    "openai_chat",
    "retry",
    "sglang_generate",
    "shard",
]
