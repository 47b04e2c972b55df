"""How a Hugging Face architecture maps onto megatron-core: :func:`describe` (light: no
torch, no megatron-core import; ``skyrl validate`` runs it on a folder's config.json)."""

from __future__ import annotations

from typing import Any

import attrs

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")


class NotExpressible(ValueError):
    """A Hugging Face architecture (or one of its features) this backend cannot build on megatron-core."""


@attrs.frozen
class Architecture:
    """How a Hugging Face model maps onto a megatron-core GPTModel."""

    model_type: str
    num_layers: int
    hidden: int
    heads: int
    groups: int  # key/value heads
    head_dim: int
    ffn: int  # dense MLP width (MoE: each expert's)
    vocab: int
    tied: bool
    rope_theta: float
    eps: float
    max_positions: int
    experts: int = 0  # 0: dense
    top_k: int = 0
    norm_topk: bool = True

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def check_model_type(model_type: Any) -> None:
    """:class:`NotExpressible` unless ``model_type`` is one this backend maps."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise NotExpressible(
            f"model_type {model_type!r} is not mapped onto megatron-core by this backend (mapped: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}); train it with [backend] name = \"torch\""
        )


def describe(config: Any) -> Architecture:
    """The :class:`Architecture` of a transformers config (or anything with its keys as
    attributes), or :class:`NotExpressible` with what is missing."""
    cfg = _text_config(config)
    mt = getattr(cfg, "model_type", "?")
    check_model_type(mt)
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise NotExpressible(f"{mt}: rope_type {rope_type!r} (only plain RoPE is mapped; megatron-core's yarn/llama3 scaling is not wired)")
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    if getattr(cfg, "attention_bias", False):
        raise NotExpressible(f"{mt}: attention_bias = true (the mapped layers have no biases)")
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        raise NotExpressible(f"{mt}: sliding-window attention (megatron-core's local attention has no window)")
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise NotExpressible(f"{mt}: hidden_act {act!r} (only SwiGLU MLPs are mapped)")
    common = dict(
        model_type=mt, num_layers=int(cfg.num_hidden_layers), hidden=int(cfg.hidden_size), heads=int(cfg.num_attention_heads),
        groups=int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
        head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads),
        vocab=int(cfg.vocab_size), tied=bool(getattr(config, "tie_word_embeddings", getattr(cfg, "tie_word_embeddings", False))),
        rope_theta=float(theta), eps=float(cfg.rms_norm_eps), max_positions=int(cfg.max_position_embeddings),
    )
    if mt == "qwen3":
        return Architecture(ffn=int(cfg.intermediate_size), **common)
    # qwen3_moe: every layer a MoE layer, no shared expert
    if list(getattr(cfg, "mlp_only_layers", []) or []) or int(getattr(cfg, "decoder_sparse_step", 1) or 1) != 1:
        raise NotExpressible(f"{mt}: dense layers between MoE layers (mlp_only_layers / decoder_sparse_step) are not mapped")
    return Architecture(
        ffn=int(cfg.moe_intermediate_size), experts=int(cfg.num_experts), top_k=int(cfg.num_experts_per_tok),
        norm_topk=bool(getattr(cfg, "norm_topk_prob", True)), **common,
    )
