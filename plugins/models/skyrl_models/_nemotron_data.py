"""The data of the ``nemotron`` family that its face (:mod:`skyrl_models.nemotron`) and its
implementation (:mod:`skyrl_models._nemotron_impl`) share: model types, presets and
light helpers (no torch, no transformers), so neither imports the other."""

from __future__ import annotations

from typing import Any, Mapping


from skyrl_models._options import check_hf_folder, preset_validator

MODEL_TYPES = ("nemotron_h",)
"""The transformers ``model_type`` values this family loads from a path."""

# Layer patterns use Nemotron-H's letters: M = Mamba2 ("linear_attention"),
# * = attention ("full_attention"), E = mixture of experts ("moe"), - = dense MLP ("mlp").
LAYER_LETTERS: Mapping[str, str] = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}

# Presets with weights: the NemotronHConfig numbers; the vocabulary comes from the tokenizer.
PRESETS: Mapping[str, Mapping[str, Any]] = {
    "tiny-nemotron-h": {
        "pattern": "ME*E",  # Mamba2, MoE, attention, MoE
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 2,
        "conv_kernel": 4,
        "chunk_size": 16,
        "intermediate_size": 128,  # dense "mlp" layers (none in the pattern)
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 64,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 512,
    },
    # The larger Nemotron 3 models (Super, Ultra) route their experts in a latent space:
    # the MoE input is projected down to ``moe_latent_size`` before the routed experts and
    # back up after them (``fc1_latent_proj`` / ``fc2_latent_proj``; the router and the
    # shared expert see the full hidden state), with group-limited top-k routing. Their
    # multi-token-prediction layers are not part of transformers' forward (it skips
    # ``mtp.*`` weights when loading), so they are not here either.
    "tiny-nemotron-3-super": {
        "pattern": "ME*EME",  # Mamba2, latent MoE, attention, latent MoE, Mamba2, latent MoE
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 2,
        "conv_kernel": 4,
        "chunk_size": 16,
        "intermediate_size": 128,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 32,
        "moe_latent_size": 32,
        "moe_shared_expert_intermediate_size": 64,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 512,
    },
}

# Full-size architectures: config only, never built with weights here. Numbers of the
# published Hugging Face config.json as best known (NVIDIA-Nemotron-3-Nano-30B-A3B:
# 52 layers = 23 Mamba2 + 23 MoE + 6 attention; 31.6B parameters, ~3.6B active).
FULL_CONFIGS: Mapping[str, Mapping[str, Any]] = {
    "nemotron-3-nano-30b-a3b": {
        "pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "vocab_size": 131072,
        "hidden_size": 2688,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "mamba_num_heads": 64,
        "mamba_head_dim": 64,
        "ssm_state_size": 128,
        "n_groups": 8,
        "conv_kernel": 4,
        "chunk_size": 128,
        "intermediate_size": 1856,
        "n_routed_experts": 128,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 262144,
    },
}
INITIALIZER_RANGE = 0.02  # std of the presets' random weights


def layer_types(pattern: str) -> list[str]:
    """``"ME*E"`` -> ``["linear_attention", "moe", "full_attention", "moe"]``."""
    return [LAYER_LETTERS[c] for c in pattern]


_check_preset = preset_validator(PRESETS, FULL_CONFIGS)


_check_path = check_hf_folder
