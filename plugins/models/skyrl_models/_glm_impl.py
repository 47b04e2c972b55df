"""The GLM family's implementation (imports torch and transformers).

Imported by :func:`skyrl_models.glm.make_family` only when a job selects
``family = "glm"``, so discovery and ``skyrl validate`` stay light. GLM-5.3-Flash's
causal LM lives in :mod:`skyrl_models._glm5_next`, imported only for its model types.
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Any

from skyrl_host.errors import Problem, UserError
from skyrl_host.interfaces import RouterInfo
from skyrl_models import _hf
from skyrl_models._glm_data import (
    FULL_PRESETS,
    INITIALIZER_RANGE,
    LORA_TARGETS,
    MAX_POSITION_EMBEDDINGS,
    MODEL_TYPES,
    PRESETS,
)

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from skyrl_models.glm import GlmConfig

_CLASSES = {  # model_type -> (config class, causal-LM class) names in transformers
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM"),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
}
GLM5_NEXT_TYPES = ("glm5_next", "glm5_next_text")  # the vision-language model, its text model


def _classes(model_type: str) -> tuple[Any, Any]:
    if model_type == "glm5_next_text":
        from skyrl_models._glm5_next import Glm5NextTextConfig, Glm5NextTextForCausalLM

        return Glm5NextTextConfig, Glm5NextTextForCausalLM
    import transformers

    cfg_name, model_name = _CLASSES[model_type]
    return getattr(transformers, cfg_name), getattr(transformers, model_name)


def preset_config(config: GlmConfig, tokenizer: Any) -> Any:
    """The transformers config of a tiny preset."""
    model_type, arch = PRESETS[config.preset]  # type: ignore[index]
    cfg_cls, _ = _classes(model_type)
    hf = cfg_cls(
        **arch,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=False,
        **_hf.vocab_ids(tokenizer),
    )
    hf._attn_implementation = config.attn_implementation
    return hf


def full_config(name: str) -> Any:
    """The transformers config of a full-size preset (``glm-4.5``, ``glm-4.7-flash``, ...)."""
    if name not in FULL_PRESETS:
        raise KeyError(f"unknown full-size GLM {name!r}; known: {', '.join(sorted(FULL_PRESETS))}")
    model_type, arch = FULL_PRESETS[name]
    cfg_cls, _ = _classes(model_type)
    return cfg_cls(**arch)


def count_parameters(hf_config: Any) -> int:
    """Parameters of the causal LM ``hf_config`` describes, counted on the meta device
    (nothing is allocated)."""
    import torch

    _, model_cls = _classes(hf_config.model_type)
    with torch.device("meta"):
        model = model_cls(hf_config)
    return sum(p.numel() for p in model.parameters())


def routers(model: Any) -> list[RouterInfo]:
    """One :class:`RouterInfo` per MoE layer (``model.layers.<i>.mlp.gate``), in layer order;
    ``normalize`` is the config's ``norm_topk_prob``, ``scale`` its ``routed_scaling_factor``."""
    cfg = model.config
    out: list[RouterInfo] = []
    for i, layer in enumerate(model.model.layers):
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not hasattr(mlp, "gate") or not hasattr(mlp, "experts"):
            continue  # a dense layer
        out.append(
            _hf.group_topk_router(i, f"model.layers.{i}.mlp.gate", cfg)
        )
    return out


def _load_glm5_next(path: str, config: GlmConfig, model_type: str) -> tuple[Any, Any]:
    """A ``glm5_next_text`` folder (what this family saves) or a ``glm5_next`` one (the
    vision-language checkpoints, of which only the language model is loaded), as a
    ``Glm5NextTextForCausalLM`` + the folder's tokenizer."""
    from transformers import AutoTokenizer

    from skyrl_models import _glm5_next

    if not any((pathlib.Path(path) / name).is_file() for name in _hf.TOKENIZER_FILES):
        names = ", ".join(_hf.TOKENIZER_FILES)
        raise UserError(Problem(f"{path!r} has no tokenizer files (expected one of {names})", key="model.path"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise UserError(Problem(f"cannot load a tokenizer from {path!r}: {exc}", key="model.path")) from None
    dtype = _hf.DTYPES[config.dtype]
    try:
        if model_type == _glm5_next.VLM_MODEL_TYPE:
            model = _glm5_next.text_model_from_vlm_folder(
                path, dtype=dtype, attn_implementation=config.attn_implementation
            )
        else:
            model = _glm5_next.Glm5NextTextForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=config.attn_implementation
            )
    except OSError as exc:  # missing or unreadable weight files
        raise UserError(Problem(f"cannot load the model from {path!r}: {exc}", key="model.path")) from None
    return model.eval(), tokenizer


class GlmFamily(_hf.HFFamily):
    """A :class:`skyrl_host.interfaces.ModelFamily` for GLM-4.5/4.7, GLM-4.7-Flash, GLM-5
    and GLM-5.3-Flash's text model."""

    name = "glm"
    model_types = MODEL_TYPES
    lora_targets = LORA_TARGETS
    # GLM-5's sparse-attention indexer scores keys with a ReLU whose ties decide the
    # selection: it stays in high precision.
    precision_keep = _hf.PRECISION_KEEP + ("indexer",)

    def load_folder(self, path: str) -> tuple[Any, Any]:
        model_type = _hf.read_model_type(path)
        if model_type in GLM5_NEXT_TYPES:
            return _load_glm5_next(path, self.config, model_type)
        return super().load_folder(path)

    max_positions = MAX_POSITION_EMBEDDINGS

    def preset_config(self, tokenizer: Any) -> Any:
        return preset_config(self.config, tokenizer)

    def model_class(self, hf_config: Any) -> Any:
        return _classes(hf_config.model_type)[1]

    def routers(self, model: Any) -> list[RouterInfo]:
        return routers(model)
