"""The Qwen family's implementation (imports torch and transformers).

Imported by :func:`skyrl_models.qwen.make_family` only when a job selects
``family = "qwen"``, so discovery and ``skyrl validate`` stay light.

Without the ``flash-linear-attention`` / ``causal-conv1d`` kernels, transformers runs
the Gated DeltaNet layers of Qwen3-Next and Qwen3.5 with its PyTorch implementation
(chunked delta rule in a full forward, the recurrent one when decoding with a cache);
that is what runs on a CPU.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from skyrl_host.interfaces import RouterInfo
from skyrl_models import _hf
from skyrl_models._qwen_data import (
    FULL_PRESETS,
    HYBRID_PRESETS,
    INITIALIZER_RANGE,
    LORA_TARGETS,
    MAX_POSITION_EMBEDDINGS,
    MODEL_TYPES,
    ROUTER_KIND,
)

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from skyrl_models.qwen import QwenConfig

_CLASSES = {  # model_type -> (config class, causal-LM class) names in transformers
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
}

# Routers that renormalise their top-k weights whatever the config says:
# Qwen3_5MoeTopKRouter has no ``norm_topk_prob`` switch.
_ALWAYS_RENORMALISED = ("qwen3_5_moe", "qwen3_5_moe_text")


def _classes(model_type: str) -> tuple[Any, Any]:
    import transformers

    cfg_name, model_name = _CLASSES[model_type]
    return getattr(transformers, cfg_name), getattr(transformers, model_name)


def preset_config(config: QwenConfig, tokenizer: Any) -> Any:
    """The transformers config of a preset (Qwen3Config, Qwen3MoeConfig, Qwen3NextConfig,
    Qwen3_5MoeTextConfig or Qwen3_5TextConfig), for the tokenizer's vocabulary."""
    arch = config.architecture()
    model_type = config.model_type
    assert model_type is not None  # a preset
    common: dict[str, Any] = dict(
        hidden_size=arch["hidden_size"],
        num_hidden_layers=arch["num_layers"],
        num_attention_heads=arch["num_heads"],
        num_key_value_heads=arch["num_kv_heads"],
        head_dim=arch["head_dim"],
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=True,
        **_hf.vocab_ids(tokenizer),
    )
    if config.is_moe:
        common.update(
            moe_intermediate_size=arch["intermediate_size"],
            num_experts=arch["num_experts"],
            num_experts_per_tok=arch["top_k"],
        )
        if model_type in ("qwen3_moe", "qwen3_next"):  # Qwen3.5's config has neither switch
            common.update(
                intermediate_size=arch["intermediate_size"] * arch["top_k"],  # unused: every layer is sparse
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
    else:
        common.update(intermediate_size=arch["intermediate_size"])
    common.update(HYBRID_PRESETS.get(config.preset, {}))  # type: ignore[arg-type]
    cfg_cls, _ = _classes(model_type)
    hf = cfg_cls(**common)
    hf._attn_implementation = config.attn_implementation
    return hf


def full_config(name: str) -> Any:
    """The transformers config of a full-size preset (:data:`skyrl_models.qwen.FULL_PRESETS`):
    a config only; build it under ``torch.device("meta")`` to size it without allocating."""
    if name not in FULL_PRESETS:
        from skyrl_host.errors import did_you_mean

        names = ", ".join(repr(n) for n in FULL_PRESETS)
        raise KeyError(f"expected one of {names}, found {name!r}{did_you_mean(name, FULL_PRESETS)}")
    model_type, numbers = FULL_PRESETS[name]
    cfg_cls, _ = _classes(model_type)
    return cfg_cls(**copy.deepcopy(dict(numbers)))  # the table's lists and dicts stay untouched


def routers(model: Any) -> list[RouterInfo]:
    """One :class:`RouterInfo` per MoE layer, in layer order: the ``gate`` of each sparse
    MLP (``model.layers.<i>.mlp.gate``). Dense Qwen3 has none; Qwen3-MoE and Qwen3-Next
    skip the dense layers that ``decoder_sparse_step`` / ``mlp_only_layers`` make (their
    MLP has ``gate_proj``, no router). Every Qwen router is ``softmax_topk``: softmax over
    the experts, top-k, renormalised when ``norm_topk_prob`` (always for Qwen3.5), no scale."""
    cfg = model.config
    base = getattr(model, "model", model)
    names = {id(m): n for n, m in model.named_modules()}
    if getattr(cfg, "model_type", None) in _ALWAYS_RENORMALISED:
        normalize = True
    else:
        normalize = bool(getattr(cfg, "norm_topk_prob", False))
    out: list[RouterInfo] = []
    for i, layer in enumerate(base.layers):
        mlp = getattr(layer, "mlp", None)
        gate = getattr(mlp, "gate", None)
        if gate is None or not hasattr(mlp, "experts"):
            continue  # a dense MLP
        out.append(
            RouterInfo(
                layer=i,
                path=names[id(gate)],
                kind=ROUTER_KIND,
                n_experts=int(cfg.num_experts),
                top_k=int(cfg.num_experts_per_tok),
                normalize=normalize,
                scale=1.0,
            )
        )
    return out


class QwenFamily(_hf.HFFamily):
    """A :class:`skyrl_host.interfaces.ModelFamily` for Qwen3, Qwen3-MoE, Qwen3-Next, Qwen3.5 and Qwen3.5-MoE."""

    name = "qwen"
    model_types = MODEL_TYPES
    lora_targets = LORA_TARGETS

    max_positions = MAX_POSITION_EMBEDDINGS

    def preset_config(self, tokenizer: Any) -> Any:
        return preset_config(self.config, tokenizer)

    def model_class(self, hf_config: Any) -> Any:
        return _classes(hf_config.model_type)[1]

    def routers(self, model: Any) -> list[RouterInfo]:
        return routers(model)
