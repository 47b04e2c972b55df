"""The Kimi family's implementation (imports torch and transformers).

Imported by :func:`skyrl_models.kimi.make_family` only when a job selects
``family = "kimi"``, so discovery and ``skyrl validate`` stay light.
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Any, Sequence

import torch

from skyrl_host.errors import Problem, UserError
from skyrl_host.interfaces import RouterInfo
from skyrl_models import _hf
from skyrl_models._kimi_data import (
    FULL_MODEL_TYPES,
    FULL_PRESETS,
    INITIALIZER_RANGE,
    MAX_POSITION_EMBEDDINGS,
    MODEL_TYPES,
    PRESET_MODEL_TYPES,
    PRESETS,
)

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from skyrl_models.kimi import KimiConfig

_CLASSES = {  # model_type -> (config class, causal-LM class) names in transformers
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM"),
}


def _classes(model_type: str) -> tuple[Any, Any]:
    import transformers

    cfg_name, model_name = _CLASSES[model_type]
    return getattr(transformers, cfg_name), getattr(transformers, model_name)

# Linear layers LoRA adapts: MLA attention projections, the dense MLP and the
# shared experts (the routed experts are fused 3-D parameters, not nn.Linear).
LORA_TARGETS: tuple[str, ...] = (
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    # Kimi Linear: MLA without q_lora, and Kimi Delta Attention
    "q_proj",
    "k_proj",
    "v_proj",
    "f_a_proj",
    "f_b_proj",
    "b_proj",
    "g_a_proj",
    "g_b_proj",
)


def preset_config(config: KimiConfig, tokenizer: Any) -> Any:
    """The ``DeepseekV3Config`` (or ``DeepseekV32Config``) of a tiny preset."""
    cfg_cls, _ = _classes(PRESET_MODEL_TYPES[config.preset])  # type: ignore[index]
    extra = {} if cfg_cls.__name__ == "KimiLinearConfig" else {"num_mtp_layers": 0}
    hf = cfg_cls(
        **PRESETS[config.preset],  # type: ignore[index]
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=INITIALIZER_RANGE,
        **extra,
        **_hf.vocab_ids(tokenizer),
    )
    hf._attn_implementation = config.attn_implementation
    return hf


def full_config(name: str) -> Any:
    """The config of a full-size architecture: ``DeepseekV3Config`` for Kimi K2
    ('kimi-k2', 'kimi-k2.6', 'kimi-k2.7'), ``DeepseekV32Config`` for 'deepseek-v3.2'
    (:data:`FULL_MODEL_TYPES`): a configuration only, no weights are built."""
    from transformers import AutoConfig

    if name not in FULL_PRESETS:
        names = ", ".join(repr(p) for p in FULL_PRESETS)
        raise ValueError(f"expected one of {names}, found {name!r}")
    return AutoConfig.for_model(FULL_MODEL_TYPES.get(name, "deepseek_v3"), **dict(FULL_PRESETS[name]))


def estimate_parameters(hf_config: Any) -> tuple[int, int]:
    """(total, active per token) parameters of a ``DeepseekV3Config``, counted on
    a model built on the meta device (no memory is allocated for weights).
    Active = total minus the routed experts a token does not use."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    e, k = hf_config.n_routed_experts, hf_config.num_experts_per_tok
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            inactive += sum(p.numel() for p in experts.parameters()) * (e - k) // e
    return total, total - inactive


def routers(model: Any) -> list[RouterInfo]:
    """One :class:`RouterInfo` per MoE layer (the dense first layers have none), in
    layer order; ``path`` is the dotted name of the layer's ``mlp.gate``; ``normalize``
    is the config's ``norm_topk_prob``, ``scale`` its ``routed_scaling_factor``."""
    names = {id(m): n for n, m in model.named_modules()}
    base = model.model if hasattr(model, "model") else model
    cfg = model.config
    out: list[RouterInfo] = []
    for i, layer in enumerate(base.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "e_score_correction_bias"):
            continue  # a dense MLP (its gate_proj is not a router)
        info = _hf.group_topk_router(i, names[id(gate)], _RouterConfig(cfg))
        out.append(info)
    return out


class _RouterConfig:
    """A config view with ``n_routed_experts`` (Kimi Linear names it ``num_local_experts``)."""

    def __init__(self, cfg: Any):
        self._cfg = cfg

    def __getattr__(self, name: str) -> Any:
        if name == "n_routed_experts" and not hasattr(self._cfg, name):
            return self._cfg.num_local_experts
        return getattr(self._cfg, name)


def _text_model_of_kimi_k25(path: str, cfg: KimiConfig) -> Any:
    """Load a ``kimi_k25`` folder and keep its language model as a plain
    ``DeepseekV3ForCausalLM`` (the vision tower and projector are dropped)."""
    from transformers import DeepseekV3ForCausalLM
    from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration

    try:
        full = Kimi_K25ForConditionalGeneration.from_pretrained(
            path, dtype=_hf.DTYPES[cfg.dtype], attn_implementation=cfg.attn_implementation
        )
    except OSError as exc:
        raise UserError(Problem(f"cannot load the model from {path!r}: {exc}", key="model.path")) from None
    text_config = full.config.text_config
    with torch.device("meta"):
        causal = DeepseekV3ForCausalLM(text_config)
    causal.model = full.model.language_model
    causal.lm_head = full.lm_head
    causal.generation_config = full.generation_config
    return causal.eval()


class KimiFamily(_hf.HFFamily):
    """A :class:`skyrl_host.interfaces.ModelFamily` for the DeepSeek-V3 / Kimi K2 architecture."""

    name = "kimi"
    model_types = MODEL_TYPES
    lora_targets: Sequence[str] = LORA_TARGETS

    def load_folder(self, path: str) -> tuple[Any, Any]:
        if _hf.read_model_type(path) != "kimi_k25":
            return super().load_folder(path)  # kimi_k25 is handled here
        from transformers import AutoTokenizer

        if not any((pathlib.Path(path) / n).is_file() for n in _hf.TOKENIZER_FILES):
            names = ", ".join(_hf.TOKENIZER_FILES)
            message = f"{path!r} has no tokenizer files (expected one of {names})"
            raise UserError(Problem(message, key="model.path"))
        return _text_model_of_kimi_k25(path, self.config), AutoTokenizer.from_pretrained(path)

    max_positions = MAX_POSITION_EMBEDDINGS

    def preset_config(self, tokenizer: Any) -> Any:
        return preset_config(self.config, tokenizer)

    def model_class(self, hf_config: Any) -> Any:
        return _classes(hf_config.model_type if hf_config.model_type in _CLASSES else "deepseek_v3")[1]

    def routers(self, model: Any) -> list[RouterInfo]:
        return routers(model)
