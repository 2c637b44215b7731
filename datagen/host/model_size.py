"""How big a model is, from its ``config.json`` alone: parameters, weight bytes, KV bytes per token.

The planner uses it to decide whether one GPU holds the model (data parallel) or tensor parallelism is
needed, and to size CPU KV caches by tokens. Estimates count the embedding, attention and MLP/MoE
projections (norms and biases are noise at this scale); linear-attention layers of hybrid models are
counted like attention layers, which errs on the large side.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

BYTES_PER_GIB = 1024**3
BYTES_PER_MIB = 1024**2
DTYPE_BYTES = {
    "float32": 4.0,
    "float": 4.0,
    "float16": 2.0,
    "half": 2.0,
    "bfloat16": 2.0,
    "float8_e4m3fn": 1.0,
    "float8": 1.0,
}
# Weights of a checkpoint without a dtype are assumed bf16 (how Qwen-class models ship).
DEFAULT_DTYPE_BYTES = 2.0
# The KV cache of a GPU server is bf16 unless configured otherwise.
KV_CACHE_DTYPE_BYTES = 2
# Model types whose layers mix (gated-delta / mamba) linear attention with full attention.
HYBRID_MODEL_TYPES = frozenset(
    {"qwen3_next", "qwen3_5", "qwen3_5_moe", "jamba", "bamba", "falcon_h1", "nemotron_h", "granitemoehybrid"}
)
FULL_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})


class ModelShape(BaseModel):
    """The dimensions of a decoder-only model that decide its memory."""

    model_config = ConfigDict(extra="forbid")

    model_type: str | None = None
    hidden_size: int
    num_layers: int
    vocab_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    dtype_bytes: float = DEFAULT_DTYPE_BYTES
    max_position_embeddings: int | None = None
    hybrid: bool = False
    full_attention_layers: int

    @property
    def params(self) -> int:
        """Estimated parameter count."""
        embed = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embed
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        attention = 2 * self.hidden_size * q_out + 2 * self.hidden_size * kv_out
        if self.num_experts:
            mlp = self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size
            mlp += 3 * self.hidden_size * self.shared_expert_intermediate_size
            mlp += self.hidden_size * self.num_experts  # router
        else:
            mlp = 3 * self.hidden_size * self.intermediate_size
        return embed + lm_head + self.num_layers * (attention + mlp)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights in their checkpoint dtype."""
        return int(self.params * self.dtype_bytes)

    def kv_bytes_per_token(self, dtype_bytes: float = KV_CACHE_DTYPE_BYTES) -> int:
        """KV cache bytes one token takes across the full-attention layers (whole model, one replica)."""
        return int(self.full_attention_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes)


def _get(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


def _dtype_bytes(config: dict[str, Any]) -> float:
    quantization = config.get("quantization_config") or {}
    bits = quantization.get("bits") or quantization.get("weight_bits")
    if isinstance(bits, int | float) and bits > 0:
        return float(bits) / 8
    if "fp8" in str(quantization.get("quant_method", "")).lower():
        return 1.0
    dtype = str(_get(config, "dtype", "torch_dtype", default="")).replace("torch.", "")
    return DTYPE_BYTES.get(dtype, DEFAULT_DTYPE_BYTES)


def shape_from_config(config: dict[str, Any]) -> ModelShape:
    """Read a model's shape from the contents of its ``config.json``.

    Multimodal wrappers keep the language model under ``text_config``; that part is read.

    Args:
        config: The parsed ``config.json``.

    Returns:
        The shape.

    Raises:
        ValueError: A dimension the estimate needs is missing.

    """
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else None
    merged = {**config, **text} if text else config
    hidden = _get(merged, "hidden_size", "d_model", "n_embd")
    layers = _get(merged, "num_hidden_layers", "n_layer", "num_layers")
    vocab = _get(merged, "vocab_size")
    heads = _get(merged, "num_attention_heads", "n_head")
    if not all(isinstance(value, int) and value > 0 for value in (hidden, layers, vocab, heads)):
        raise ValueError(
            "config.json lacks hidden_size, num_hidden_layers, vocab_size or num_attention_heads: "
            "cannot estimate the model's memory"
        )
    kv_heads = _get(merged, "num_key_value_heads", "num_kv_heads", default=heads)
    head_dim = _get(merged, "head_dim", default=hidden // heads)
    experts = _get(merged, "num_experts", "n_routed_experts", "num_local_experts", default=0)
    moe_intermediate = _get(merged, "moe_intermediate_size", default=0)
    layer_types = [str(kind) for kind in merged.get("layer_types") or []]
    model_type = _get(merged, "model_type")
    linear_layers = [kind for kind in layer_types if kind not in FULL_ATTENTION_LAYER_TYPES]
    hybrid = (
        bool(linear_layers)
        or model_type in HYBRID_MODEL_TYPES
        or config.get("model_type") in HYBRID_MODEL_TYPES
    )
    full_layers = layers - len(linear_layers) if layer_types else layers
    if hybrid and not layer_types and merged.get("full_attention_interval"):
        full_layers = layers // int(merged["full_attention_interval"])
    return ModelShape(
        model_type=config.get("model_type") or model_type,
        hidden_size=hidden,
        num_layers=layers,
        vocab_size=vocab,
        intermediate_size=_get(merged, "intermediate_size", "ffn_dim", default=4 * hidden),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_experts=experts or 0,
        moe_intermediate_size=moe_intermediate or 0,
        shared_expert_intermediate_size=_get(merged, "shared_expert_intermediate_size", default=0),
        tie_word_embeddings=bool(_get(merged, "tie_word_embeddings", default=False)),
        dtype_bytes=_dtype_bytes(merged),
        max_position_embeddings=_get(merged, "max_position_embeddings"),
        hybrid=hybrid,
        full_attention_layers=max(1, full_layers),
    )


def read_model_shape(model_path: str | Path) -> ModelShape | None:
    """The shape of the model in a local directory; None when it has no readable ``config.json``.

    Raises:
        ValueError: ``config.json`` exists but lacks the dimensions the estimate needs.

    """
    config_file = Path(model_path) / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    return shape_from_config(config)
