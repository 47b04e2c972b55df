"""The data of the ``hf`` family that its face (:mod:`skyrl_models.hf`) and its
implementation (:mod:`skyrl_models._generic_impl`) share: model types, presets and
light helpers (no torch, no transformers), so neither imports the other."""

from __future__ import annotations

import json
import pathlib
from typing import Any, Mapping


from skyrl_models._options import preset_validator

MAX_POSITION_EMBEDDINGS = 512  # of the tiny presets
INITIALIZER_RANGE = 0.02

# The tiny presets' shared numbers: 2 layers of width 64, grouped-query attention (4 query
# heads, 2 key/value heads of 16), an MLP of 128; the vocabulary comes from the tokenizer.
_DENSE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=128)
# MoE presets: 4 experts of 64, top-2 (Qwen2-MoE adds its gated shared expert).
PRESETS: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    "tiny-llama": ("llama", dict(_DENSE, tie_word_embeddings=False)),
    "tiny-qwen2": ("qwen2", dict(_DENSE, tie_word_embeddings=True)),
    "tiny-mistral": ("mistral", dict(_DENSE, sliding_window=None, tie_word_embeddings=False)),
    "tiny-gemma3": ("gemma3_text", dict(_DENSE, sliding_window=64, query_pre_attn_scalar=16,
                                        layer_types=["sliding_attention", "full_attention"])),
    "tiny-phi3": ("phi3", dict(_DENSE, tie_word_embeddings=False)),
    "tiny-olmo2": ("olmo2", dict(_DENSE, tie_word_embeddings=False)),
    "tiny-mixtral": ("mixtral", dict(_DENSE, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=None, tie_word_embeddings=False)),
    "tiny-qwen2-moe": ("qwen2_moe", dict(_DENSE, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                         decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)),
}
MOE_PRESETS = ("tiny-mixtral", "tiny-qwen2-moe")


def folder_config(path: str) -> dict[str, Any] | None:
    """A folder's config.json as a dict (None when it cannot be read: the path's own
    validator says why)."""
    try:
        data = json.loads((pathlib.Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def claims(section: Mapping[str, Any]) -> tuple[int, str] | None:
    """How strongly this family claims a ``[model]`` table without ``family``: any folder
    (``path``) with a readable config.json, at the lowest priority (1): a specific family
    that covers its ``model_type`` claims it higher (2). A preset name of ours is ours."""
    if isinstance(section.get("preset"), str) and section["preset"] in PRESETS:
        return 1, f"preset {section['preset']!r} is one of family 'hf''s"
    path = section.get("path")
    data = folder_config(path) if isinstance(path, str) else None
    if data is None:
        return None
    return 1, f"no specific family covers config.json's model_type {data.get('model_type')!r}"


_check_preset = preset_validator(PRESETS)
