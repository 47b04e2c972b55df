"""The data of the ``glm`` family that its face (:mod:`skyrl_models.glm`) and its
implementation (:mod:`skyrl_models._glm_impl`) share: model types, presets and
light helpers (no torch, no transformers), so neither imports the other."""

from __future__ import annotations

from typing import Any, Mapping


from skyrl_models._options import check_hf_folder, preset_validator

MODEL_TYPES = ("glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "glm5_next", "glm5_next_text")
"""The transformers ``model_type`` values this family loads from a path (``glm5_next``:
its language model)."""

LORA_TARGETS = (
    # attention: GQA (glm4_moe) and MLA (glm4_moe_lite, glm_moe_dsa)
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    # dense and shared-expert MLPs
    "gate_proj",
    "up_proj",
    "down_proj",
    # routed experts: fused 3-D parameters of ``mlp.experts``
    "gate_up_proj",
    # linear attention of glm5_next (q/k/v/o_proj above): beta, output gate, forget gate
    "b_proj",
    "g_a_proj",
    "g_b_proj",
    "f_a_proj",
    "f_b_proj",
)
"""Module / parameter names LoRA may target (attention and expert projections)."""

MAX_POSITION_EMBEDDINGS = 512  # of the tiny presets
INITIALIZER_RANGE = 0.02

# Tiny presets: (model_type, transformers config kwargs); the vocabulary comes from
# the tokenizer. Three layers, the first dense (as in the real models), so two MoE
# layers with 8 experts in 2 groups, top-2 from the best group.
_TINY_MOE = dict(
    hidden_size=64,
    num_hidden_layers=3,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)
_TINY_MLA = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
)
PRESETS: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    "tiny-glm4-moe": (
        "glm4_moe",
        dict(
            _TINY_MOE,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            first_k_dense_replace=1,
            use_qk_norm=True,
        ),
    ),
    "tiny-glm4-moe-lite": ("glm4_moe_lite", dict(_TINY_MOE, **_TINY_MLA, mlp_layer_types=["dense", "sparse", "sparse"])),
    # GLM-5: MLA whose keys a sparse-attention indexer picks (the best 8 per query); layer
    # 2 reuses layer 1's pick (``indexer_types = "shared"``, as GLM-5 configs may set with
    # ``index_topk_freq``), so both indexer paths that r3 replays are exercised.
    "tiny-glm-moe-dsa": (
        "glm_moe_dsa",
        dict(
            _TINY_MOE,
            **_TINY_MLA,
            first_k_dense_replace=1,
            index_topk=8,
            index_head_dim=32,
            index_n_heads=2,
            indexer_types=["full", "full", "shared"],
        ),
    ),
    # GLM-5.3-Flash's text model: one layer of each kind in four. Layer 0: linear
    # attention + dense MLP; 1: sparse-attention MLA running its indexer; 2: the same
    # reusing layer 1's key choice; 3: linear attention again; 1-3 are MoE. No rotary
    # part (qk_rope_head_dim = 0, as the model requires). The indexer keeps 2 pools of 4
    # keys (+ the current partial pool), so prompts of a dozen tokens already attend
    # sparsely; 16 indexer heads make exact ties between pool scores (ReLU zeros, which
    # topk may break differently in a full forward and a cached decode) improbable.
    "tiny-glm5-next": (
        "glm5_next_text",
        dict(
            _TINY_MOE,
            **dict(_TINY_MLA, qk_rope_head_dim=0),
            num_hidden_layers=4,
            layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
            indexer_types=["full", "full", "shared", "full"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            linear_num_heads=2,
            linear_head_dim=16,
            linear_conv_kernel_dim=4,
            hc_mult=4,
            index_topk=8,
            index_kpool=4,
            index_head_dim=16,
            index_n_heads=16,
        ),
    ),
}

# Full-size architectures (config only, no weights), from the published config.json
# files as best known. The vocabulary is the real one.
FULL_PRESETS: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    "glm-4.5": (  # 355B total / 32B active; GLM-4.6 and GLM-4.7 share it
        "glm4_moe",
        dict(
            vocab_size=151552,
            hidden_size=5120,
            intermediate_size=12288,
            moe_intermediate_size=1536,
            num_hidden_layers=92,
            num_attention_heads=96,
            num_key_value_heads=8,
            head_dim=128,
            n_routed_experts=160,
            n_shared_experts=1,
            num_experts_per_tok=8,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            first_k_dense_replace=3,
            norm_topk_prob=True,
            use_qk_norm=True,
            partial_rotary_factor=0.5,
            max_position_embeddings=131072,
        ),
    ),
    "glm-4.5-air": (  # 106B / 12B
        "glm4_moe",
        dict(
            vocab_size=151552,
            hidden_size=4096,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=46,
            num_attention_heads=96,
            num_key_value_heads=8,
            head_dim=128,
            n_routed_experts=128,
            n_shared_experts=1,
            num_experts_per_tok=8,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            use_qk_norm=False,
            partial_rotary_factor=0.5,
            max_position_embeddings=131072,
        ),
    ),
    "glm-4.7-flash": (  # 30B / 3B, MLA
        "glm4_moe_lite",
        dict(
            vocab_size=154880,
            hidden_size=2048,
            intermediate_size=10240,
            moe_intermediate_size=1536,
            num_hidden_layers=47,
            num_attention_heads=20,
            num_key_value_heads=20,
            q_lora_rank=768,
            kv_lora_rank=512,
            qk_nope_head_dim=192,
            qk_rope_head_dim=64,
            v_head_dim=256,
            n_routed_experts=64,
            n_shared_experts=1,
            num_experts_per_tok=4,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.8,
            norm_topk_prob=True,
            max_position_embeddings=202752,
        ),
    ),
    "glm-5": (  # ~744B / ~40B, MLA + DeepSeek sparse attention
        "glm_moe_dsa",
        dict(
            vocab_size=154880,
            hidden_size=6144,
            intermediate_size=12288,
            moe_intermediate_size=2048,
            num_hidden_layers=78,
            num_attention_heads=64,
            num_key_value_heads=64,
            q_lora_rank=2048,
            kv_lora_rank=512,
            qk_nope_head_dim=192,
            qk_rope_head_dim=64,
            v_head_dim=256,
            n_routed_experts=256,
            n_shared_experts=1,
            num_experts_per_tok=8,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            first_k_dense_replace=3,
            norm_topk_prob=True,
            index_topk=2048,
            index_head_dim=128,
            index_n_heads=32,
            max_position_embeddings=202752,
        ),
    ),
}
FULL_PRESETS = {**FULL_PRESETS, "glm-4.6": FULL_PRESETS["glm-4.5"], "glm-4.7": FULL_PRESETS["glm-4.5"]}
# GLM-5.3-Flash's text model: transformers' Glm5NextTextConfig defaults, which its
# documentation names after zai-org/GLM-5.3-Flash (an empty mapping = exactly those):
# 45 layers (34 Kimi-Delta linear-attention, 11 MLA with the sparse-attention indexer;
# the first 3 dense), hidden 4096, 288 routed experts top-8, 4 hyper-connection streams;
# ~313B parameters, ~17.4B active on the meta device. Not checked against the
# checkpoint's own config.json (none can be downloaded here): a folder's config wins.
FULL_PRESETS = {**FULL_PRESETS, "glm-5.3-flash": ("glm5_next_text", {})}


_check_preset = preset_validator(PRESETS, FULL_PRESETS, full_config="skyrl_models.glm.full_config")


_check_path = check_hf_folder
