"""qwen: the Qwen3 model family: dense (``qwen3``), mixture-of-experts (``qwen3_moe``),
the hybrid linear-attention MoE models Qwen3-Next (``qwen3_next``) and Qwen3.5-MoE
(``qwen3_5_moe``, whose text model is ``qwen3_5_moe_text``), and the hybrid dense
Qwen3.5 text model (``qwen3_5_text``).

``[model] family = "qwen"`` with either ``preset`` (a tiny model with random
weights from the job's seed and a character-level tokenizer for the dataset's
alphabet) or ``path`` (a local Hugging Face folder, e.g. a downloaded
Qwen3-0.6B, Qwen3-30B-A3B, Qwen3-Next-80B-A3B or Qwen3.5-397B-A17B).

Qwen3-Next and Qwen3.5 mix Gated DeltaNet (linear attention) layers with gated full
attention layers (``layer_types``; three linear layers, then one full, repeating), and
every layer's MLP is a mixture of experts with a gated shared expert. Qwen3.5-MoE
checkpoints are vision-language models (``qwen3_5_moe``); this family loads their text
model as a ``Qwen3_5MoeForCausalLM`` (the vision tower is dropped), which saves as
``qwen3_5_moe_text``.

The full-size architectures in :data:`FULL_PRESETS` are configs only (no weights), for
``skyrl models show``; a job loads such a model from ``path``.

This module is what the ``skyrl`` entry point imports: it holds the options and
the presets only and imports neither torch nor transformers. The factory imports
the implementation (:mod:`skyrl_models._qwen_impl`) when a job selects the family.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import OptionError, gt, option
from skyrl_models._options import PresetOrPath, claims_model_types, model_traits

from skyrl_models._qwen_data import (  # noqa: F401 - also this module's public names
    MODEL_TYPES,
    ROUTER_KIND,
    LORA_TARGETS,
    PRESETS,
    MOE_PRESETS,
    PRESET_MODEL_TYPES,
    HYBRID_PRESETS,
    MAX_POSITION_EMBEDDINGS,
    INITIALIZER_RANGE,
    ARCH_KEYS,
    MOE_KEYS,
    FULL_PRESETS,
    _check_preset,
    _check_path,
)


@attrs.frozen
class QwenConfig(PresetOrPath):
    """Options of ``[model]`` when ``family = "qwen"``: exactly one of ``preset`` and ``path``."""

    preset: str | None = option(
        None,
        help="a tiny model with random weights: 'tiny' (Qwen3), 'tiny-moe' (Qwen3-MoE), "
        "'tiny-qwen3.5-moe' (Qwen3.5-MoE), 'tiny-qwen3-next' (Qwen3-Next) or 'tiny-qwen3.5' (Qwen3.5 dense)",
        validator=_check_preset,
    )
    path: str | None = option(
        None, help="a local Hugging Face folder (config.json, *.safetensors, tokenizer files)", validator=_check_path
    )
    dtype: Literal["float32", "bfloat16"] = option("float32", help="dtype of the weights")
    attn_implementation: Literal["sdpa", "eager"] = option("sdpa", help="transformers attention implementation")
    hidden_size: int | None = option(None, help="preset override: model width (default: the preset's)", validator=gt(0))
    num_layers: int | None = option(None, help="preset override: decoder layers", validator=gt(0))
    num_heads: int | None = option(None, help="preset override: attention (query) heads", validator=gt(0))
    num_kv_heads: int | None = option(
        None, help="preset override: key/value heads (default: num_heads); divides num_heads", validator=gt(0)
    )
    head_dim: int | None = option(None, help="preset override: size of one attention head", validator=gt(0))
    intermediate_size: int | None = option(
        None, help="preset override: MLP width (of each routed expert for the MoE presets)", validator=gt(0)
    )
    num_experts: int | None = option(None, help="preset override, MoE presets only: experts per layer", validator=gt(0))
    top_k: int | None = option(None, help="preset override, MoE presets only: experts per token", validator=gt(0))

    def __attrs_post_init__(self) -> None:
        self.check_preset_or_path(PRESETS)
        overrides = [k for k in ARCH_KEYS + MOE_KEYS if getattr(self, k) is not None]
        if self.path is not None and overrides:
            raise OptionError(
                overrides[0],
                "only applies to a preset; a model loaded from path keeps the architecture of its config.json",
            )
        if self.preset is None:
            return
        arch = self.architecture()
        if self.preset not in MOE_PRESETS:
            moe = [k for k in MOE_KEYS if getattr(self, k) is not None]
            if moe:
                names = ", ".join(repr(p) for p in MOE_PRESETS)
                raise OptionError(moe[0], f"only applies to a mixture-of-experts preset ({names}), not {self.preset!r}")
        if arch["num_heads"] % arch["num_kv_heads"]:
            raise OptionError(
                "num_kv_heads" if self.num_kv_heads is not None else "num_heads",
                f"expected num_kv_heads ({arch['num_kv_heads']}) to divide num_heads ({arch['num_heads']})",
            )
        if "top_k" in arch and arch["top_k"] > arch["num_experts"]:
            raise OptionError(
                "top_k" if self.top_k is not None else "num_experts",
                f"expected top_k ({arch['top_k']}) to be at most num_experts ({arch['num_experts']})",
            )

    def architecture(self) -> dict[str, int]:
        """The preset's numbers with this config's overrides applied (``num_kv_heads``
        follows ``num_heads`` unless set). Presets only."""
        if self.preset is None:
            raise ValueError("architecture() is for presets; this config loads a path")
        arch = dict(PRESETS[self.preset])
        for key in arch:
            if getattr(self, key) is not None:
                arch[key] = getattr(self, key)
        if self.num_heads is not None and self.num_kv_heads is None:
            arch["num_kv_heads"] = self.num_heads
        return arch

    @property
    def is_moe(self) -> bool:
        return self.preset in MOE_PRESETS

    @property
    def model_type(self) -> str | None:
        """The ``model_type`` the preset builds (None for a path)."""
        return None if self.preset is None else PRESET_MODEL_TYPES[self.preset]


def full_config(name: str) -> Any:
    """The transformers config of a full-size Qwen (no weights built); imports transformers."""
    from skyrl_models._qwen_impl import full_config as impl

    return impl(name)


def make_family(config: QwenConfig) -> Any:
    """The factory: a :class:`skyrl_host.interfaces.ModelFamily` (imports torch and transformers)."""
    from skyrl_models._qwen_impl import QwenFamily

    return QwenFamily(config)


@hookimpl
def skyrl_register_models(register: Any) -> None:
    register(
        "qwen",
        make_family,
        config=QwenConfig,
        description="Qwen3 dense and MoE, Qwen3-Next, Qwen3.5 dense and Qwen3.5-MoE models (qwen3, qwen3_moe, "
        "qwen3_next, qwen3_5_text, qwen3_5_moe): tiny presets or a local Hugging Face folder",
        claims=claims_model_types(MODEL_TYPES, "qwen"),
        traits=lambda c: model_traits(c, model_type=c.model_type, is_moe=c.is_moe, has_indexer=False),
    )
