"""How a Hugging Face architecture maps onto megatron-core: :func:`describe` (light: no
torch, no megatron-core import; ``skyrl validate`` runs it on a folder's config.json)."""

from __future__ import annotations

import math
from typing import Any

import attrs

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3", "llama", "mistral", "qwen2")
# Dense GQA decoders without q/k norms: Llama (and SmolLM), Mistral, Qwen2 / Qwen2.5 (biases on q, k and v).
_PLAIN_DENSE = ("llama", "mistral", "qwen2")


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
    qk_norm: bool = True  # RMSNorm on each query and key head
    qkv_bias: bool = False  # biases on the q, k and v projections
    rotary_percent: float = 1.0  # the share of each head's dimensions RoPE rotates (the first ones)
    dense_layers: int = 0  # MoE models: the first layers with a dense MLP instead
    dense_ffn: int = 0  # their MLP width
    shared_ffn: int = 0  # the shared expert's width (0: none)
    score: str = "softmax"  # the router's score function: "softmax" or "sigmoid"
    expert_bias: bool = False  # a correction bias added to the scores for the choice only
    scaling: float | None = None  # the chosen experts' weights are multiplied by this
    route_groups: int = 0  # group-limited routing: experts in this many groups ...
    topk_groups: int = 0  # ... of which each token uses the best this many
    # multi-latent attention (DeepSeek-V3, Kimi K2); kv_lora = 0: ordinary attention
    q_lora: int = 0  # the query's latent width (0: a plain q_proj)
    kv_lora: int = 0
    rope_dim: int = 0  # each head's rotated dimensions (the rest of head_dim is not rotated)
    v_dim: int = 0
    rope_interleave: bool = False  # the checkpoint lays the rotated dimensions out in (even, odd) pairs
    # RoPE scaling, as transformers computes it (rope_parameters): "default", "linear" or "yarn"
    rope_type: str = "default"
    rope_factor: float = 1.0
    yarn_original_max: int = 0  # the pretraining context the yarn ramp is measured against
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_truncate: bool = True  # the ramp's bounds rounded to whole dimensions
    attention_factor: float = 1.0  # yarn: cos and sin of the rotated dimensions are multiplied by this
    mscale_all_dim: float = 0.0  # yarn + multi-latent attention: the softmax scale is multiplied by mscale(factor, this)^2

    @property
    def mla(self) -> bool:
        return self.kv_lora > 0

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
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    if getattr(cfg, "attention_bias", False) and mt != "glm4_moe":
        raise NotExpressible(f"{mt}: attention_bias = true (the mapped layers have no biases)")
    if getattr(cfg, "mlp_bias", False):
        raise NotExpressible(f"{mt}: mlp_bias = true (the mapped MLPs have no biases)")
    window = getattr(cfg, "sliding_window", None)
    if window and (getattr(cfg, "use_sliding_window", False) or (mt == "mistral" and window < int(cfg.max_position_embeddings))):
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
        **_rope_scaling(mt, cfg, rope),
    )
    if mt == "qwen3":
        return Architecture(ffn=int(cfg.intermediate_size), **common)
    if mt in _PLAIN_DENSE:  # no q/k norms; Qwen2's q, k and v projections carry biases
        return Architecture(ffn=int(cfg.intermediate_size), qk_norm=False, qkv_bias=mt == "qwen2", **common)
    if mt == "glm4_moe":
        return _glm4_moe(cfg, rope, common)
    if mt == "deepseek_v3":
        return _deepseek_v3(cfg, rope, common)
    # qwen3_moe: every layer a MoE layer, no shared expert
    if list(getattr(cfg, "mlp_only_layers", []) or []) or int(getattr(cfg, "decoder_sparse_step", 1) or 1) != 1:
        raise NotExpressible(f"{mt}: dense layers between MoE layers (mlp_only_layers / decoder_sparse_step) are not mapped")
    return Architecture(
        ffn=int(cfg.moe_intermediate_size), experts=int(cfg.num_experts), top_k=int(cfg.num_experts_per_tok),
        norm_topk=bool(getattr(cfg, "norm_topk_prob", True)), **common,
    )


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context ``factor`` times the original."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_scaling(mt: str, cfg: Any, rope: dict) -> dict:
    """The RoPE scaling keys of :class:`Architecture` for a config's rope parameters, with the
    values transformers derives from them (yarn's factor, attention factor and ramp)."""
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind == "default":
        return {}
    if kind == "linear":
        if getattr(cfg, "kv_lora_rank", None):
            raise NotExpressible(f"{mt}: rope_type 'linear' with multi-latent attention (megatron-core's MLA rotary takes 'rope' or 'yarn')")
        return dict(rope_type="linear", rope_factor=float(rope["factor"]))
    if kind != "yarn":
        raise NotExpressible(f"{mt}: rope_type {kind!r} (mapped: default, linear, yarn)")
    original = rope.get("original_max_position_embeddings")
    if not original:
        raise NotExpressible(f"{mt}: yarn without original_max_position_embeddings")
    factor = float(rope.get("factor") or cfg.max_position_embeddings / original)
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    attention = rope.get("attention_factor")
    if attention is None:  # transformers' rule
        attention = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim) if mscale and mscale_all_dim else _mscale(factor)
    if factor <= 1 and attention != 1.0:
        raise NotExpressible(f"{mt}: yarn with factor {factor} <= 1 and attention_factor {attention} (megatron-core scales only longer contexts)")
    truncate = bool(rope.get("truncate", True))
    if getattr(cfg, "kv_lora_rank", None) and not truncate:
        raise NotExpressible(f"{mt}: yarn with truncate = false and multi-latent attention (megatron-core's MLA rounds the ramp)")
    return dict(
        rope_type="yarn", rope_factor=factor, yarn_original_max=int(original),
        yarn_beta_fast=float(rope.get("beta_fast") or 32), yarn_beta_slow=float(rope.get("beta_slow") or 1),
        yarn_truncate=truncate, attention_factor=float(attention),
        # DeepSeek-V3's attention also sharpens its softmax by mscale(factor, mscale_all_dim)^2
        mscale_all_dim=float(mscale_all_dim or 0.0) if mt == "deepseek_v3" else 0.0,
    )


def _sigmoid_router(mt: str, cfg: Any) -> dict:
    """DeepSeek-V3's router (GLM-4.5 and Kimi K2 use it) as megatron-core expresses it."""
    top_k, groups, topk_groups = int(cfg.num_experts_per_tok), int(getattr(cfg, "n_group", 1) or 1), int(getattr(cfg, "topk_group", 1) or 1)
    if not getattr(cfg, "norm_topk_prob", True):
        raise NotExpressible(f"{mt}: norm_topk_prob = false (megatron-core's sigmoid router always normalises the chosen weights)")
    if groups > 1 and int(cfg.n_routed_experts) // groups < 2:
        raise NotExpressible(f"{mt}: group-limited routing with fewer than 2 experts per group (a group scores by its best 2)")
    shared = int(getattr(cfg, "n_shared_experts", 0) or 0)
    return dict(
        ffn=int(cfg.moe_intermediate_size), experts=int(cfg.n_routed_experts), top_k=top_k, norm_topk=True,
        dense_layers=int(getattr(cfg, "first_k_dense_replace", 0) or 0), dense_ffn=int(cfg.intermediate_size),
        shared_ffn=shared * int(cfg.moe_intermediate_size), score="sigmoid", expert_bias=True,
        scaling=float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0),
        route_groups=groups if groups > 1 else 0, topk_groups=topk_groups if groups > 1 else 0,
    )


def _deepseek_v3(cfg: Any, rope: dict, common: dict) -> Architecture:
    """DeepSeek-V3 / Kimi K2: multi-latent attention (query and key/value latents with their
    RMSNorms, a decoupled rotary part shared by the heads' keys), the sigmoid router, dense
    first layers and a shared expert."""
    mt = "deepseek_v3"
    if getattr(cfg, "attention_bias", False):
        raise NotExpressible(f"{mt}: attention_bias = true (megatron-core's MLA projections have no biases here)")
    nope, rot = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim)
    common = dict(common, head_dim=nope)  # megatron-core's qk_head_dim: the heads' unrotated part
    return Architecture(
        qk_norm=False, q_lora=int(getattr(cfg, "q_lora_rank", None) or 0), kv_lora=int(cfg.kv_lora_rank),
        rope_dim=rot, v_dim=int(cfg.v_head_dim), rope_interleave=bool(getattr(cfg, "rope_interleave", True)),
        **_sigmoid_router(mt, cfg), **common,
    )


def _glm4_moe(cfg: Any, rope: dict, common: dict) -> Architecture:
    """GLM-4.5 / GLM-4.6: partial RoPE, optional q/k biases and norms, dense first layers,
    a shared expert, a sigmoid router with a correction bias, group-limited top-k and a
    scaling factor (DeepSeek-V3's router, which megatron-core has)."""
    partial = float(rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0)
    return Architecture(
        qk_norm=bool(getattr(cfg, "use_qk_norm", False)), qkv_bias=bool(getattr(cfg, "attention_bias", False)),
        rotary_percent=partial, **_sigmoid_router("glm4_moe", cfg), **common,
    )
