"""kimi: the Kimi K2 model family (the DeepSeek-V3 architecture, ``deepseek_v3``).

``[model] family = "kimi"`` with either ``preset = "tiny-kimi"`` (a tiny
DeepSeek-V3 model: MLA attention, a dense first layer, then MoE layers with
sigmoid group-limited top-k routing and one shared expert; random weights from
the job's seed, a character-level tokenizer for the dataset's alphabet) or
``path`` (a local Hugging Face folder of model type ``deepseek_v3``, or
``kimi_k25``, whose text model is loaded).

The full-size Kimi K2 architectures (``kimi-k2``, ``kimi-k2.6``, ``kimi-k2.7``)
are known as configurations only (:data:`FULL_PRESETS`, :func:`full_config` in
the implementation): nobody builds a trillion-parameter model from random weights.

This module is what the ``skyrl`` entry point imports: it holds the options and
the presets only and imports neither torch nor transformers. The factory imports
the implementation (:mod:`skyrl_models._kimi_impl`) when a job selects the family.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import option
from skyrl_toolkit.routing import KEY_INDEXER_MODEL_TYPES
from skyrl_models._options import PresetOrPath, claims_model_types, model_traits

from skyrl_models._kimi_data import (  # noqa: F401 - also this module's public names
    MODEL_TYPES,
    MAX_POSITION_EMBEDDINGS,
    INITIALIZER_RANGE,
    PRESETS,
    PRESET_MODEL_TYPES,
    FULL_PRESETS,
    FULL_MODEL_TYPES,
    _check_preset,
    _check_path,
)


@attrs.frozen
class KimiConfig(PresetOrPath):
    """Options of ``[model]`` when ``family = "kimi"``: exactly one of ``preset`` and ``path``."""

    preset: str | None = option(
        None, help="a tiny model with random weights: 'tiny-kimi' (DeepSeek-V3 / Kimi K2 architecture) or "
        "'tiny-deepseek-v3.2' (DeepSeek-V3.2: with the sparse-attention indexer) or 'tiny-kimi-linear' "
        "(Kimi Linear: Kimi Delta Attention and MLA layers)",
        validator=_check_preset,
    )
    path: str | None = option(
        None, help="a local Hugging Face folder (deepseek_v3, deepseek_v32, kimi_linear or kimi_k25; config.json, *.safetensors, tokenizer files)",
        validator=_check_path,
    )
    dtype: Literal["float32", "bfloat16"] = option("float32", help="dtype of the weights")
    attn_implementation: Literal["sdpa", "eager"] = option("sdpa", help="transformers attention implementation")

    def __attrs_post_init__(self) -> None:
        self.check_preset_or_path(PRESETS)

    @property
    def model_type(self) -> str | None:
        """The ``model_type`` the preset builds (None for a path: its config.json says)."""
        return None if self.preset is None else PRESET_MODEL_TYPES[self.preset]

    @property
    def has_indexer(self) -> bool | None:
        """Whether the preset attends through a sparse-attention key indexer (GLM-5,
        DeepSeek-V3.2), whose picks ``r3`` replays; None for a path (its config.json says)."""
        if self.preset is None:
            return None
        return PRESET_MODEL_TYPES.get(self.preset) in KEY_INDEXER_MODEL_TYPES


def make_family(config: KimiConfig) -> Any:
    """The factory: a :class:`skyrl_host.interfaces.ModelFamily` (imports torch and transformers)."""
    from skyrl_models._kimi_impl import KimiFamily

    return KimiFamily(config)


@hookimpl
def skyrl_register_models(register: Any) -> None:
    register(
        "kimi",
        make_family,
        config=KimiConfig,
        description="Kimi K2, Kimi Linear and DeepSeek-V3.2 models (deepseek_v3, kimi_k25's text model, kimi_linear, "
        "deepseek_v32): a tiny preset or a local Hugging Face folder",
        claims=claims_model_types(MODEL_TYPES, "kimi"),
        traits=lambda c: model_traits(c, model_type=c.model_type, has_indexer=c.has_indexer),
    )
