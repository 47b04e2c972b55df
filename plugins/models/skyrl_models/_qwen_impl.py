"""The Qwen family's implementation (imports torch and transformers).

Imported by :func:`skyrl_models.qwen.make_family` only when a job selects
``family = "qwen"``, so discovery and ``skyrl validate`` stay light.
"""

from __future__ import annotations

from typing import Any

from skyrl_models import _hf
from skyrl_models.qwen import INITIALIZER_RANGE, MAX_POSITION_EMBEDDINGS, MODEL_TYPES, QwenConfig


def preset_config(config: QwenConfig, tokenizer: Any) -> Any:
    """The transformers config (Qwen3Config or Qwen3MoeConfig) of a preset."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    arch = config.architecture()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=arch["hidden_size"],
        num_hidden_layers=arch["num_layers"],
        num_attention_heads=arch["num_heads"],
        num_key_value_heads=arch["num_kv_heads"],
        head_dim=arch["head_dim"],
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    if config.is_moe:
        hf = Qwen3MoeConfig(
            **common,
            intermediate_size=arch["intermediate_size"] * arch["top_k"],  # unused: every layer is sparse
            moe_intermediate_size=arch["intermediate_size"],
            num_experts=arch["num_experts"],
            num_experts_per_tok=arch["top_k"],
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    else:
        hf = Qwen3Config(**common, intermediate_size=arch["intermediate_size"])
    hf._attn_implementation = config.attn_implementation
    return hf


class QwenFamily(_hf.HFFamily):
    """A :class:`skyrl_host.interfaces.ModelFamily` for Qwen3 and Qwen3-MoE."""

    name = "qwen"
    model_types = MODEL_TYPES

    def build_preset(self, alphabet: str | None, seed: int) -> tuple[Any, Any]:
        """Random weights from ``seed`` (float32, then cast to ``dtype``), eval mode."""
        from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

        tokenizer = _hf.char_tokenizer(alphabet, model_max_length=MAX_POSITION_EMBEDDINGS)
        hf_config = preset_config(self.config, tokenizer)
        cls = Qwen3MoeForCausalLM if self.config.is_moe else Qwen3ForCausalLM
        with _hf.seeded(seed):
            model = cls(hf_config)
        _hf.set_special_ids(model, tokenizer)
        model = model.to(_hf.DTYPES[self.config.dtype])
        return model.eval(), tokenizer
