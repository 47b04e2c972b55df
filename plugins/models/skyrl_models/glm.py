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

from typing import Any, Literal

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import option
from skyrl_toolkit.routing import KEY_INDEXER_MODEL_TYPES
from skyrl_models._options import PresetOrPath, claims_model_types, model_traits

from skyrl_models._glm_data import (  # noqa: F401 - also this module's public names
    MODEL_TYPES,
    LORA_TARGETS,
    MAX_POSITION_EMBEDDINGS,
    INITIALIZER_RANGE,
    PRESETS,
    FULL_PRESETS,
    _check_preset,
    _check_path,
)


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
