"""The Nemotron-H family's implementation (imports torch and transformers).

Imported by :func:`skyrl_models.nemotron.make_family` only when a job selects
``family = "nemotron"``, so discovery and ``skyrl validate`` stay light.

Without the ``mamba-ssm`` / ``causal-conv1d`` CUDA kernels, transformers runs the
Mamba2 layers with its PyTorch implementation (chunked scan), in training and in
generation; that is what runs on a CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from skyrl_host.interfaces import RouterInfo
from skyrl_models import _hf
from skyrl_models._nemotron_data import (
    FULL_CONFIGS,
    INITIALIZER_RANGE,
    MODEL_TYPES,
    PRESETS,
    layer_types,
)

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from skyrl_models.nemotron import NemotronConfig

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "up_proj", "down_proj",
                "fc1_latent_proj", "fc2_latent_proj")
"""Names of the ``nn.Linear`` modules LoRA adapts: attention projections, the Mamba2
input/output projections, the dense MLPs (shared experts, ``mlp`` layers) and the
latent MoE's projections into and out of the experts' space (Nemotron 3 Super). The
routers (``mixer.gate``) are left alone, and the routed experts are fused 3-D
parameters (``mixer.experts.up_proj`` / ``down_proj``), not modules, so no name here
reaches them."""


def _hf_config(numbers: Mapping[str, Any], **extra: Any) -> Any:
    from transformers import NemotronHConfig

    numbers = dict(numbers)
    pattern = numbers.pop("pattern")
    return NemotronHConfig(
        layers_block_type=layer_types(pattern),
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=False,
        mlp_hidden_act="relu2",
        norm_topk_prob=True,
        **numbers,
        **extra,
    )


def preset_config(config: NemotronConfig, tokenizer: Any) -> Any:
    """The NemotronHConfig of a preset, for the tokenizer's vocabulary."""
    hf = _hf_config(
        PRESETS[config.preset],  # type: ignore[index]
        **_hf.vocab_ids(tokenizer),
    )
    hf._attn_implementation = config.attn_implementation
    return hf


def full_config(name: str) -> Any:
    """The NemotronHConfig of a full-size architecture (:data:`FULL_CONFIGS`): a config
    only; build it under ``torch.device("meta")`` to size it without allocating."""
    if name not in FULL_CONFIGS:
        from skyrl_host.errors import did_you_mean

        names = ", ".join(repr(n) for n in FULL_CONFIGS)
        raise KeyError(f"expected one of {names}, found {name!r}{did_you_mean(name, FULL_CONFIGS)}")
    return _hf_config(FULL_CONFIGS[name])


def routers(model: Any) -> list[RouterInfo]:
    """One :class:`RouterInfo` per MoE layer, in layer order: the ``gate`` of each
    MoE mixer (``model.layers.<i>.mixer.gate``); Mamba2, attention and dense layers
    have none. ``normalize`` is the config's ``norm_topk_prob``, ``scale`` its
    ``routed_scaling_factor``."""
    cfg = model.config
    base = getattr(model, "model", model)
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for i, layer in enumerate(base.layers):
        if getattr(layer, "block_type", None) != "moe":
            continue
        gate = layer.mixer.gate
        out.append(
            _hf.group_topk_router(i, names[id(gate)], cfg)
        )
    return out


class NemotronFamily(_hf.HFFamily):
    """A :class:`skyrl_host.interfaces.ModelFamily` for Nemotron-H (``nemotron_h``)."""

    name = "nemotron"
    model_types = MODEL_TYPES
    lora_targets = LORA_TARGETS

    @property
    def max_positions(self) -> int:  # type: ignore[override]
        return int(PRESETS[self.config.preset]["max_position_embeddings"])  # type: ignore[index]

    def preset_config(self, tokenizer: Any) -> Any:
        return preset_config(self.config, tokenizer)

    def model_class(self, hf_config: Any) -> Any:
        from transformers import NemotronHForCausalLM

        return NemotronHForCausalLM

    def routers(self, model: Any) -> list[RouterInfo]:
        return routers(model)
