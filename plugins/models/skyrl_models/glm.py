"""glm: the GLM mixture-of-experts family (Zhipu / Z.ai).

Model types: ``glm4_moe`` (GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7), ``glm4_moe_lite``
(GLM-4.7-Flash, multi-head latent attention), ``glm_moe_dsa`` (GLM-5, MLA with
DeepSeek sparse attention) and the text model of ``glm5_next`` (GLM-5.3-Flash:
linear attention with forget gates and sparse-attention MLA layers, hyper-connections).
All route DeepSeek-V3 style: sigmoid scores plus an ``e_score_correction_bias`` for
the choice, group-limited top-k, renormalised weights times ``routed_scaling_factor``.

``[model] family = "glm"`` with either ``preset`` (a tiny model with random weights
from the job's seed and a character-level tokenizer for the dataset's alphabet) or
``path`` (a local Hugging Face folder).

GLM-5.3-Flash: transformers ships it as the vision-language
``Glm5NextForConditionalGeneration`` and the bare decoder ``Glm5NextTextModel``, with
no causal LM for the text model. This family brings one
(:class:`skyrl_models._glm5_next.Glm5NextTextForCausalLM`, registered with
``AutoModelForCausalLM`` for ``glm5_next_text`` in the process that loads it): a
``glm5_next`` folder (the published checkpoints) loads its language model only
(``model.language_model.*`` and ``lm_head``; the vision tower is not read), and the
family saves the text model (``model_type = "glm5_next_text"``), which it loads back.

This module is what the ``skyrl`` entry point imports: options and presets only, no
torch or transformers. The factory imports :mod:`skyrl_models._glm_impl`.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import option
from skyrl_host.routing import KEY_INDEXER_MODEL_TYPES
from skyrl_models._options import PresetOrPath, check_hf_folder, claims_model_types, preset_validator, model_traits

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


@attrs.frozen
class GlmConfig(PresetOrPath):
    """Options of ``[model]`` when ``family = "glm"``: exactly one of ``preset`` and ``path``."""

    preset: str | None = option(
        None,
        help="a tiny model with random weights: " + ", ".join(repr(p) for p in PRESETS),
        validator=_check_preset,
    )
    path: str | None = option(
        None, help="a local Hugging Face folder (config.json, *.safetensors, tokenizer files)", validator=_check_path
    )
    dtype: Literal["float32", "bfloat16"] = option("float32", help="dtype of the weights")
    attn_implementation: Literal["sdpa", "eager"] = option("sdpa", help="transformers attention implementation")

    def __attrs_post_init__(self) -> None:
        self.check_preset_or_path(PRESETS)

    @property
    def has_indexer(self) -> bool | None:
        """Whether the preset attends through a sparse-attention key indexer (GLM-5,
        DeepSeek-V3.2), whose picks ``r3`` replays; None for a path (its config.json says)."""
        if self.preset is None:
            return None
        return PRESETS[self.preset][0] in KEY_INDEXER_MODEL_TYPES


def full_config(name: str) -> Any:
    """The transformers config of a full-size GLM (no weights built); imports transformers."""
    from skyrl_models._glm_impl import full_config as impl

    return impl(name)


def make_family(config: GlmConfig) -> Any:
    """The factory: a :class:`skyrl_host.interfaces.ModelFamily` (imports torch and transformers)."""
    from skyrl_models._glm_impl import GlmFamily

    return GlmFamily(config)


@hookimpl
def skyrl_register_models(register: Any) -> None:
    register(
        "glm",
        make_family,
        config=GlmConfig,
        description="GLM MoE models (glm4_moe, glm4_moe_lite, glm_moe_dsa, glm5_next's text model): "
        "tiny presets or a local Hugging Face folder",
        claims=claims_model_types(MODEL_TYPES, "glm"),
        traits=lambda c: model_traits(c, has_indexer=c.has_indexer),
    )
