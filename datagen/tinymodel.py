"""Build a tiny random-weight Qwen3-architecture model and tokenizer, offline and in seconds.

Used by the demo and the tests: the CPU engine serves it, and its chat template renders training rows.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

_CORPUS = [
    "hello world this is a tiny corpus for a tiny tokenizer",
    "def add(x, y):\n    return x + y\n",
    "What is 2 + 2? The answer is: 4",
    "You are a helpful assistant. Answer the question step by step.",
]


def build_tiny_model(directory: str | Path, *, vocab_size: int = 1024, seed: int = 0) -> Path:
    """Write a tiny Qwen3 model and its tokenizer to ``directory``.

    Args:
        directory: Where to save (created if missing).
        vocab_size: Target BPE vocabulary size.
        seed: Seed of the random weights.

    Returns:
        The directory.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(out)
    eos_id = fast.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        eos_token_id=eos_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = eos_id
    model.save_pretrained(out)
    return out
