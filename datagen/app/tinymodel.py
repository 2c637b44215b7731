"""Build a tiny random-weight Qwen3 model and its tokenizer, offline, deterministically, in seconds.

The demo and the tests serve this model with the CPU engine and render training rows with its chat
template, so it must look like a Qwen3 model from the outside:

* a byte-level BPE tokenizer trained in-process on a small built-in corpus, holding the Qwen special
  tokens, with ``<|im_end|>`` as eos and ``<|endoftext|>`` as pad;
* a chat template in the Qwen3 format (``datagen/templates/qwen3.jinja``);
* a ``qwen3`` model whose random weights are shaped so its samples are useful in a demo: the lm_head gets a
  constant per-token bias (through one residual dimension held constant, since Qwen3 has no lm_head bias)
  that makes ``<|im_end|>`` likely enough to end a fair share of answers early (finish reason "stop") and
  that suppresses the other special tokens and the tokens that do not decode to printable ASCII, so the
  engine's Qwen3 response parser never sees a stray ``<think>``/``<tool_call>`` and ``content`` is
  visible text.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
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
CHAT_TEMPLATE_RESOURCE = "qwen3.jinja"
TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "templates"

DEFAULT_VOCAB_SIZE = 2048
HIDDEN_SIZE = 64
INTERMEDIATE_SIZE = 128
NUM_LAYERS = 2
NUM_ATTENTION_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 16
MAX_POSITION_EMBEDDINGS = 4096
# The residual dimension held constant so the final norm emits a fixed value there: lm_head's column for
# this dimension then acts as a per-token logit bias.
BIAS_DIMENSION = 0
# Value of the constant dimension in every embedding: far above the other dimensions (std ~0.02 plus what
# two small layers add), so after the final RMSNorm it is sqrt(hidden_size) to within a fraction of a percent.
BIAS_DIMENSION_VALUE = 50.0
# Standard deviation (in logits) of the random, context-dependent part of the next-token scores: large
# enough for text to vary with context, small enough that sampling at temperature ~0.7 spreads widely.
RANDOM_LOGIT_STD = 1.0
# Logit bias of <|im_end|>, in units of RANDOM_LOGIT_STD: ~1-2 % per token at temperature 0.7-1.0, so roughly
# half of the answers stop before 64 tokens, while greedy decoding (where eos must beat the max of ~2k
# random scores) almost never stops on the first token.
EOS_LOGIT_BIAS = 2.5
# Logit bias of tokens that must never be sampled (other special tokens, non-printable bytes).
SUPPRESSED_LOGIT_BIAS = -40.0
DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 0.95
# Random contexts used to measure the spread of the untuned logits.
CALIBRATION_BATCH = 8
CALIBRATION_LENGTH = 32

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still answer questions if the data is good.
You are a helpful assistant. Answer the question step by step and explain your reasoning clearly.
What is the capital of France? The capital of France is Paris, a city on the river Seine.
Write a function that returns the sum of two numbers. Here is a simple solution in Python.
def add(x, y):
    return x + y

def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count

for index, value in enumerate(values):
    print(index, value)

What is 12 times 7? First multiply 10 by 7 to get 70, then 2 by 7 to get 14, and 70 plus 14 is 84.
Solve for x: 3x + 5 = 20. Subtract 5 from both sides to get 3x = 15, then divide by 3, so x = 5.
The weather today is sunny with a light breeze, and the temperature will reach twenty degrees.
To call a tool, return a JSON object with the function name and its arguments.
{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}
{"name": "search", "arguments": {"query": "latest news about science"}}
The result of the search shows three articles about new discoveries in physics and biology.
Please summarize the following text in two sentences, keeping the most important facts.
Large language models learn patterns from text and can generate answers, code, and explanations.
Speculative decoding uses a small draft model to propose tokens that a large model verifies.
Training data should be diverse: code, math, conversation, tool use, and writing in many languages.
SELECT name, COUNT(*) FROM users WHERE active = 1 GROUP BY name ORDER BY name;
git commit -m "Fix the bug in the parser" && git push origin main
Thank you for your question! I hope this helps. Let me know if you need anything else.
"""


def chat_template() -> str:
    """The Qwen3-format chat template shipped with datagen (package data)."""
    # A path next to this module rather than importlib.resources: ``datagen`` has no ``__init__`` (a
    # namespace package), which importlib.resources cannot read under an editable install.
    return (TEMPLATES_DIR / CHAT_TEMPLATE_RESOURCE).read_text(encoding="utf-8")


def build_tiny_model(directory: str | Path, *, vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0) -> Path:
    """Write a tiny Qwen3 model and its tokenizer to ``directory``.

    The same ``seed`` (and ``vocab_size``) always produces byte-identical weights and tokenizer files.

    Args:
        directory: Where to save (created if missing).
        vocab_size: Upper bound of the BPE vocabulary (the small corpus may yield fewer merges).
        seed: Seed of the random weights.

    Returns:
        The directory, loadable with ``AutoTokenizer`` / ``AutoModelForCausalLM`` and servable by
        ``transformers serve``.

    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(vocab_size)
    tokenizer.save_pretrained(out)
    model = _build_model(tokenizer, seed)
    model.save_pretrained(out)
    logger.info("built tiny model directory=%s vocab=%d seed=%d", out, len(tokenizer), seed)
    return out


def _build_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    fast_class: Any = PreTrainedTokenizerFast
    tokenizer = fast_class(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[token for token in SPECIAL_TOKENS if token not in {EOS_TOKEN, PAD_TOKEN}],
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    tokenizer.chat_template = chat_template()
    return tokenizer


def _printable(text: str) -> bool:
    """Tell whether decoded text is printable ASCII (newline and tab allowed)."""
    return all(" " <= char <= "~" or char in "\n\t" for char in text)


def _logit_bias(tokenizer: Any) -> list[float]:
    """The per-token logit bias in units of RANDOM_LOGIT_STD (see the module docstring)."""
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    special_ids = set(tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS))
    bias = [0.0] * len(tokenizer)
    for token_id in range(len(tokenizer)):
        if token_id == eos_id:
            bias[token_id] = EOS_LOGIT_BIAS
        # A lone byte of a multi-byte character decodes to U+FFFD, so it is suppressed too.
        elif token_id in special_ids or not _printable(tokenizer.decode([token_id])):
            bias[token_id] = SUPPRESSED_LOGIT_BIAS
    return bias


def _build_model(tokenizer: Any, seed: int) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_ATTENTION_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id,
        # Untied: the lm_head carries the bias column, the embeddings the constant dimension.
        tie_word_embeddings=False,
    )
    # Fork the global RNG so building a model never changes the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = Qwen3ForCausalLM(config)
        model.eval()
        with torch.no_grad():
            _hold_bias_dimension(model)
            _calibrate_lm_head(model, _logit_bias(tokenizer), eos_id, seed)
    generation = model.generation_config
    generation.eos_token_id = eos_id
    generation.pad_token_id = tokenizer.pad_token_id
    generation.bos_token_id = None
    # Sample by default (as Qwen3 checkpoints do): `transformers serve --continuous-batching` keeps the
    # model's do_sample for every request, so without it a request's temperature would be ignored. No
    # top-k cut, so the eos share is what the bias above sets.
    generation.do_sample = True
    generation.temperature = DEFAULT_TEMPERATURE
    generation.top_p = DEFAULT_TOP_P
    generation.top_k = 0
    return model


def _hold_bias_dimension(model: Any) -> None:
    """Make BIAS_DIMENSION of the residual stream the same constant at every position and layer."""
    inner = model.model
    inner.embed_tokens.weight[:, BIAS_DIMENSION] = BIAS_DIMENSION_VALUE
    for layer in inner.layers:
        # Nothing writes into the constant dimension, and no layer reads it.
        layer.self_attn.o_proj.weight[BIAS_DIMENSION, :] = 0.0
        layer.mlp.down_proj.weight[BIAS_DIMENSION, :] = 0.0
        layer.input_layernorm.weight[BIAS_DIMENSION] = 0.0
        layer.post_attention_layernorm.weight[BIAS_DIMENSION] = 0.0


def _calibrate_lm_head(model: Any, bias: list[float], eos_id: int, seed: int) -> None:
    """Scale lm_head so random scores have RANDOM_LOGIT_STD, then write the bias into its constant column."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    contexts = torch.randint(
        0, model.config.vocab_size, (CALIBRATION_BATCH, CALIBRATION_LENGTH), generator=generator
    )
    hidden = model.model(input_ids=contexts).last_hidden_state
    head = model.lm_head.weight
    head[:, BIAS_DIMENSION] = 0.0
    random_scores = hidden @ head.T
    # The spread across the vocabulary at one position is what sampling sees; a shift shared by every token
    # of a position cancels in the softmax, so it is left out of the measurement.
    spread = float(random_scores.std(dim=-1).mean())
    head *= RANDOM_LOGIT_STD / spread
    # eos gets no context-dependent part: its score is exactly the bias, which makes its share predictable.
    head[eos_id, :] = 0.0
    constant = float(hidden[..., BIAS_DIMENSION].mean())
    head[:, BIAS_DIMENSION] = torch.tensor(bias) * RANDOM_LOGIT_STD / constant
