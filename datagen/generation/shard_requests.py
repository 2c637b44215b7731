"""The requests of one prompt shard, built from its prompts the same way in every attempt.

This module owns what a shard sends: each prompt times ``samples_per_prompt`` as plain requests
(:func:`build_requests`), or as on-policy conversations (:func:`build_conversations`), each with the sampling
setting its prompt id draws and, when the sampling has a seed, a seed of its own derived from it. A rerun builds
the very same requests, so their keys find the results an earlier attempt stored
(:mod:`~datagen.generation.shard`).
"""

from __future__ import annotations

from datagen.config import RunConfig
from datagen.generation.conversation import Conversation, ConversationChains, Prepare
from datagen.generation.openai_chat import GenerationRequest
from datagen.output.store import Store
from datagen.records import PromptRecord, PromptShardRef, SamplingParams


def build_requests(store: Store, config: RunConfig, shard: PromptShardRef) -> list[GenerationRequest]:
    """Every request of a shard: each prompt times ``samples_per_prompt``, in prompt order.

    With a sampling mix (``datasets[].sampling_mix``), each prompt samples with the setting its id draws
    (:func:`~datagen.config.prompts.choose_setting`), the same in every attempt. When the sampling has a seed,
    each request gets its own seed derived from it, the prompt id and the sample index, so samples of one
    prompt differ and a rerun draws the same ones.

    Args:
        store: The store holding the prompt shard.
        config: The run configuration.
        shard: The prompt shard.

    Returns:
        The requests.

    """
    dataset = config.dataset(shard.dataset)
    requests = []
    for line in store.iter_lines(shard.path):
        # Straight from the JSON bytes: pydantic's own parser, no intermediate dicts.
        prompt = PromptRecord.model_validate_json(line)
        setting, sampling = config.sampling_for_prompt(dataset, prompt.prompt_id)
        for sample_index in range(sampling.samples_per_prompt):
            requests.append(
                GenerationRequest(
                    prompt=prompt,
                    sample_index=sample_index,
                    sampling=_sampling_for_request(sampling, prompt.prompt_id, sample_index),
                    sampling_setting=setting,
                    dataset=shard.dataset,
                )
            )
    return requests


def build_conversations(
    store: Store, config: RunConfig, shard: PromptShardRef, prepare: Prepare | None = None
) -> ConversationChains:
    """Every on-policy conversation of a shard: each prompt times ``samples_per_prompt``, in prompt order.

    Each prompt samples with the setting of its dataset's mix its id draws, as :func:`build_requests`; seeds
    are derived per turn (:func:`~datagen.generation.conversation.turn_seed`).

    Args:
        store: The store holding the prompt shard.
        config: The run configuration.
        shard: The prompt shard.
        prepare: Renders each turn's prompt into ids as the turn is built (exact-token mode).

    Returns:
        The shard's conversations, none of them started.

    """
    dataset = config.dataset(shard.dataset)
    conversations = []
    for line in store.iter_lines(shard.path):
        prompt = PromptRecord.model_validate_json(line)
        setting, sampling = config.sampling_for_prompt(dataset, prompt.prompt_id)
        for sample_index in range(sampling.samples_per_prompt):
            conversations.append(Conversation(prompt, sample_index, sampling, setting, shard.dataset))
    return ConversationChains(conversations, prepare)


def _sampling_for_request(sampling: SamplingParams, prompt_id: str, sample_index: int) -> SamplingParams:
    return sampling.seeded_for(prompt_id, sample_index)
