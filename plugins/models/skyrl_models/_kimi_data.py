"""The data of the ``kimi`` family that its face (:mod:`skyrl_models.kimi`) and its
implementation (:mod:`skyrl_models._kimi_impl`) share: model types, presets and
light helpers (no torch, no transformers), so neither imports the other."""

from __future__ import annotations

from typing import Any, Mapping


from skyrl_models._options import check_hf_folder, preset_validator

MODEL_TYPES = ("deepseek_v3", "kimi_k25", "deepseek_v32", "kimi_linear")
"""The transformers ``model_type`` values this family loads from a path
(``kimi_k25``: the vision-language Kimi K2.5+, of which the text model is loaded)."""

MAX_POSITION_EMBEDDINGS = 512  # of the tiny preset
INITIALIZER_RANGE = 0.02  # std of the tiny preset's random weights

# The tiny preset: DeepseekV3Config keyword arguments; the vocabulary comes from
# the tokenizer. Layer 0 is dense (first_k_dense_replace = 1), layers 1-2 are MoE.
PRESETS: Mapping[str, Mapping[str, Any]] = {
    "tiny-kimi": {
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "v_head_dim": 16,
        "intermediate_size": 128,  # the dense layer's MLP
        "moe_intermediate_size": 32,  # each expert (and the shared expert)
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 4,  # 4 groups of 2 experts...
        "topk_group": 2,  # ...of which the best 2 groups are eligible
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.827,
        "tie_word_embeddings": False,
    },
}
# DeepSeek-V3.2 (``deepseek_v32``): tiny-kimi's numbers plus the sparse-attention
# indexer (DSA), which keeps the best ``index_topk`` keys of each query.
PRESETS = {
    **PRESETS,
    "tiny-deepseek-v3.2": {
        **PRESETS["tiny-kimi"],
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 8,
    },
    # Kimi Linear (``kimi_linear``): 3 Kimi Delta Attention (linear attention) layers, then
    # one MLA layer (without q_lora); layer 0's MLP is dense, the others MoE as in tiny-kimi.
    "tiny-kimi-linear": {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "v_head_dim": 16,
        "linear_num_heads": 4,
        "linear_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.446,
        "tie_word_embeddings": False,
    },
}
PRESET_MODEL_TYPES: Mapping[str, str] = {
    "tiny-kimi": "deepseek_v3",
    "tiny-deepseek-v3.2": "deepseek_v32",
    "tiny-kimi-linear": "kimi_linear",
}
"""The transformers ``model_type`` each preset builds (and saves)."""

# Kimi K2 (moonshotai/Kimi-K2-Instruct config.json, as published): ~1.04T
# parameters, ~32B active per token. K2.6 and K2.7 are taken to reuse the K2 text
# architecture (K2.5/K2.6 ship it as the deepseek_v3 text config of kimi_k25).
_KIMI_K2: Mapping[str, Any] = {
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 384,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "max_position_embeddings": 131072,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rms_norm_eps": 1e-6,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "tie_word_embeddings": False,
    "num_mtp_layers": 0,
}
# DeepSeek-V3.2 (deepseek-ai/DeepSeek-V3.2-Exp): transformers' DeepseekV32Config
# defaults, which its documentation names after that checkpoint and which are the
# published config.json's numbers (61 layers, the first 3 dense, 256 experts top-8 in 8
# groups of which 4 are eligible, MLA, the indexer keeping 2,048 keys with 64 heads of
# 128): an empty mapping means exactly those defaults. ~671B parameters, ~37B active
# (its multi-token-prediction layer is not part of transformers' model).
FULL_PRESETS: Mapping[str, Mapping[str, Any]] = {
    "kimi-k2": _KIMI_K2,
    "kimi-k2.6": _KIMI_K2,
    "kimi-k2.7": _KIMI_K2,
    "deepseek-v3.2": {},
}
FULL_MODEL_TYPES: Mapping[str, str] = {"deepseek-v3.2": "deepseek_v32"}
"""The ``model_type`` of each full-size architecture not built as ``deepseek_v3``."""


_check_preset = preset_validator(PRESETS, FULL_PRESETS)


_check_path = check_hf_folder
