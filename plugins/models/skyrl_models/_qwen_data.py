"""The data of the ``qwen`` family that its face (:mod:`skyrl_models.qwen`) and its
implementation (:mod:`skyrl_models._qwen_impl`) share: model types, presets and
light helpers (no torch, no transformers), so neither imports the other."""

from __future__ import annotations

from typing import Any, Mapping


from skyrl_models._options import check_hf_folder, preset_validator

MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text")
"""The transformers ``model_type`` values this family loads from a path (``qwen3_5_moe``:
the vision-language Qwen3.5-MoE checkpoint, of which the text model is loaded)."""

ROUTER_KIND = "softmax_topk"  # softmax over the experts, top-k, optionally renormalised

LORA_TARGETS = (
    # attention (qwen3_next and qwen3_5_moe: gated attention, q_proj carries the gate)
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    # dense MLPs and shared experts
    "gate_proj",
    "up_proj",
    "down_proj",
    # Gated DeltaNet (linear attention): qwen3_next fuses q/k/v/z and b/a ...
    "in_proj_qkvz",
    "in_proj_ba",
    # ... qwen3_5_moe keeps them apart
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "out_proj",
)
"""Names of the ``nn.Linear`` modules LoRA adapts. The routers (``mlp.gate``) and the
shared-expert gates (``mlp.shared_expert_gate``) are left alone; the routed experts are
fused 3-D parameters (``mlp.experts.gate_up_proj`` / ``down_proj``), not modules, so no
name here reaches them."""

# Presets: the architecture numbers a job may override; the vocabulary comes from the
# tokenizer. "tiny" is the 165k-parameter Qwen3 that learns reverse_digits on a CPU in minutes.
PRESETS: Mapping[str, Mapping[str, int]] = {
    "tiny": {
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 4,
        "head_dim": 32,
        "intermediate_size": 256,
    },
    "tiny-moe": {
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 4,
        "head_dim": 32,
        "intermediate_size": 64,  # per expert (Qwen3MoeConfig.moe_intermediate_size)
        "num_experts": 8,
        "top_k": 2,
    },
    # hybrid: 3 Gated DeltaNet layers, then 1 gated-attention layer; every MLP is MoE
    "tiny-qwen3.5-moe": {
        "hidden_size": 64,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 32,
        "intermediate_size": 32,  # per routed expert (moe_intermediate_size)
        "num_experts": 8,
        "top_k": 2,
    },
    "tiny-qwen3-next": {
        "hidden_size": 64,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 32,
        "intermediate_size": 32,  # per routed expert (moe_intermediate_size)
        "num_experts": 8,
        "top_k": 2,
    },
    # Qwen3.5 dense: the same hybrid layer pattern, every MLP dense
    "tiny-qwen3.5": {
        "hidden_size": 64,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 32,
        "intermediate_size": 128,
    },
}
MOE_PRESETS = ("tiny-moe", "tiny-qwen3.5-moe", "tiny-qwen3-next")

PRESET_MODEL_TYPES: Mapping[str, str] = {
    "tiny": "qwen3",
    "tiny-moe": "qwen3_moe",
    "tiny-qwen3.5-moe": "qwen3_5_moe_text",
    "tiny-qwen3-next": "qwen3_next",
    "tiny-qwen3.5": "qwen3_5_text",
}
"""The transformers ``model_type`` each preset builds (and saves)."""

# The hybrid presets' fixed numbers (not overridable): Gated DeltaNet heads, the shared
# expert, the layer pattern (``full_attention_interval``: every 4th layer is full
# attention) and an untied output head (as in the published models).
_HYBRID_LINEAR: Mapping[str, Any] = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "tie_word_embeddings": False,
}
HYBRID_PRESETS: Mapping[str, Mapping[str, Any]] = {
    **{name: dict(_HYBRID_LINEAR, shared_expert_intermediate_size=64) for name in ("tiny-qwen3.5-moe", "tiny-qwen3-next")},
    "tiny-qwen3.5": dict(_HYBRID_LINEAR),  # dense: no shared expert
}
MAX_POSITION_EMBEDDINGS = 512  # of the presets
INITIALIZER_RANGE = 0.02  # std of the presets' random weights

ARCH_KEYS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")
MOE_KEYS = ("num_experts", "top_k")

# Full-size architectures: (model_type, transformers config keyword arguments), configs
# only (no weights are ever built here). The numbers of the published config.json files
# (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, Qwen/Qwen3-Next-80B-A3B-Instruct, and the
# text_config of Qwen/Qwen3.5-397B-A17B); multi-token-prediction layers are not built.
_QWEN3_MOE = dict(
    vocab_size=151936,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    head_dim=128,
    num_key_value_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    max_position_embeddings=40960,
    tie_word_embeddings=False,
)
_HYBRID = dict(
    head_dim=256,
    num_key_value_heads=2,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    num_experts=512,
    num_experts_per_tok=10,
    full_attention_interval=4,
    max_position_embeddings=262144,
    tie_word_embeddings=False,
)
FULL_PRESETS: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    "qwen3-30b-a3b": (  # 30.5B total / 3.3B active
        "qwen3_moe",
        dict(
            _QWEN3_MOE,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
        ),
    ),
    "qwen3-235b-a22b": (  # 235B / 22B
        "qwen3_moe",
        dict(
            _QWEN3_MOE,
            hidden_size=4096,
            intermediate_size=12288,
            moe_intermediate_size=1536,
            num_hidden_layers=94,
            num_attention_heads=64,
        ),
    ),
    "qwen3-next-80b-a3b": (  # 80B / 3B (3.9B with the embeddings and the head)
        "qwen3_next",
        dict(
            _HYBRID,
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=5120,  # unused: every layer is MoE
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            num_hidden_layers=48,
            num_attention_heads=16,
            linear_num_value_heads=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.25},
        ),
    ),
    "qwen3.5-397b-a17b": (  # 397B / 17B (the text model: the vision tower is not counted)
        "qwen3_5_moe_text",
        dict(
            _HYBRID,
            vocab_size=248320,
            hidden_size=4096,
            moe_intermediate_size=1024,
            shared_expert_intermediate_size=1024,
            num_hidden_layers=60,
            num_attention_heads=32,
            linear_num_value_heads=64,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        ),
    ),
}


_check_preset = preset_validator(PRESETS, FULL_PRESETS)


_check_path = check_hf_folder
