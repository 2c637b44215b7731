"""How big a model is, from its ``config.json`` alone: parameters, weight bytes, per-token and per-request state.

The planner uses it to decide whether one GPU holds the model (data parallel) or tensor parallelism is
needed, and how many requests fit a server. Estimates count the embedding, attention, linear-attention
(Gated DeltaNet) and MLP/MoE projections, a multimodal wrapper's vision tower, and MTP layers separately
(they are loaded only with speculative decoding); norms and biases are noise at this scale.

Hybrid models (Qwen3.5/3.6, Qwen3-Next) keep a KV cache only for their full-attention layers (bytes per
token) and a fixed recurrent state per request for each linear-attention layer: a convolution state of
``(2 * key_heads * key_dim + value_heads * value_dim) * (conv_kernel - 1)`` elements (model dtype) and an
SSM state of ``value_heads * key_dim * value_dim`` elements in ``mamba_ssm_dtype`` (float32 by default),
the shapes SGLang's mamba pool allocates (``sglang/srt/configs/mamba_utils.py``).
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
# SGLang keeps the SSM state in float32 unless the config's mamba_ssm_dtype says otherwise.
DEFAULT_SSM_STATE_BYTES = 4.0


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
    linear_attention_layers: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    ssm_state_dtype_bytes: float = DEFAULT_SSM_STATE_BYTES
    attention_output_gate: bool = False
    mtp_layers: int = 0
    vision_params: int = 0

    @property
    def params(self) -> int:
        """Estimated parameter count of what a server loads without speculative decoding (no MTP layers)."""
        embed = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embed
        linear = self.linear_attention_layers * self._linear_attention_params
        return (
            embed
            + lm_head
            + self.num_layers * self._mlp_params
            + linear
            + self.vision_params
            + (self.full_attention_layers * self._attention_params)
        )

    @property
    def mtp_params(self) -> int:
        """Parameters of the MTP layers: a fusing projection plus one full-attention decoder layer each."""
        return self.mtp_layers * (
            2 * self.hidden_size * self.hidden_size + self._attention_params + self._mlp_params
        )

    @property
    def _attention_params(self) -> int:
        # An output gate doubles the query projection (Qwen3.5/3.6 attn_output_gate).
        q_out = self.num_attention_heads * self.head_dim * (2 if self.attention_output_gate else 1)
        kv_out = self.num_kv_heads * self.head_dim
        return (
            self.hidden_size * q_out
            + self.num_attention_heads * self.head_dim * self.hidden_size
            + (2 * self.hidden_size * kv_out)
        )

    @property
    def _linear_attention_params(self) -> int:
        value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        projections = self.hidden_size * (self._conv_dim + value_dim + 2 * self.linear_num_value_heads)
        return projections + value_dim * self.hidden_size + self._conv_dim * self.linear_conv_kernel_dim

    @property
    def _conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )

    @property
    def _mlp_params(self) -> int:
        if self.num_experts:
            mlp = self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size
            mlp += 3 * self.hidden_size * self.shared_expert_intermediate_size
            return mlp + self.hidden_size * self.num_experts  # router
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights in their checkpoint dtype (MTP layers excluded, see :attr:`mtp_weight_bytes`)."""
        return int(self.params * self.dtype_bytes)

    @property
    def mtp_weight_bytes(self) -> int:
        """Bytes of the MTP layers, loaded only with speculative decoding."""
        return int(self.mtp_params * self.dtype_bytes)

    def kv_bytes_per_token(self, dtype_bytes: float = KV_CACHE_DTYPE_BYTES) -> int:
        """KV cache bytes one token takes across the full-attention layers (whole model, one replica)."""
        return int(self.full_attention_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes)

    def recurrent_state_bytes_per_request(self) -> int:
        """Fixed state one request holds across the linear-attention layers (whole model, one replica)."""
        conv = self._conv_dim * max(0, self.linear_conv_kernel_dim - 1) * self.dtype_bytes
        ssm = (
            self.linear_num_value_heads
            * self.linear_key_head_dim
            * self.linear_value_head_dim
            * self.ssm_state_dtype_bytes
        )
        return int(self.linear_attention_layers * (conv + ssm))


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
    linear_layers = sum(1 for kind in layer_types if kind not in FULL_ATTENTION_LAYER_TYPES)
    hybrid = (
        bool(linear_layers)
        or model_type in HYBRID_MODEL_TYPES
        or config.get("model_type") in HYBRID_MODEL_TYPES
    )
    full_layers = layers - linear_layers if layer_types else layers
    if hybrid and not layer_types and merged.get("full_attention_interval"):
        full_layers = layers // int(merged["full_attention_interval"])
        linear_layers = layers - full_layers
    ssm_dtype = str(merged.get("mamba_ssm_dtype") or "").replace("torch.", "")
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
        linear_attention_layers=linear_layers if hybrid else 0,
        linear_num_key_heads=_get(merged, "linear_num_key_heads", default=0),
        linear_num_value_heads=_get(merged, "linear_num_value_heads", default=0),
        linear_key_head_dim=_get(merged, "linear_key_head_dim", default=0),
        linear_value_head_dim=_get(merged, "linear_value_head_dim", default=0),
        linear_conv_kernel_dim=_get(merged, "linear_conv_kernel_dim", default=0),
        ssm_state_dtype_bytes=DTYPE_BYTES.get(ssm_dtype, DEFAULT_SSM_STATE_BYTES),
        attention_output_gate=bool(merged.get("attn_output_gate", False)),
        mtp_layers=int(_get(merged, "mtp_num_hidden_layers", "num_nextn_predict_layers", default=0) or 0),
        vision_params=_vision_params(config.get("vision_config")),
    )


def _vision_params(vision: Any) -> int:
    """Parameters of a multimodal wrapper's vision tower (ViT blocks plus the patch merger)."""
    if not isinstance(vision, dict):
        return 0
    depth = int(vision.get("depth") or 0)
    width = int(vision.get("hidden_size") or 0)
    mlp = int(vision.get("intermediate_size") or 4 * width)
    merged_width = width * int(vision.get("spatial_merge_size") or 1) ** 2
    out = int(vision.get("out_hidden_size") or width)
    blocks = depth * (4 * width * width + 2 * width * mlp)
    return blocks + merged_width * merged_width + merged_width * out


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
