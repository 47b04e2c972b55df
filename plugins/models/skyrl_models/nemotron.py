"""nemotron: the Nemotron-H model family (``nemotron_h``: Nemotron 3, a hybrid of
Mamba2, attention and mixture-of-experts layers).

``[model] family = "nemotron"`` with either ``preset`` (a tiny model with random
weights from the job's seed and a character-level tokenizer for the dataset's
alphabet) or ``path`` (a local Hugging Face folder, e.g. a downloaded
NVIDIA-Nemotron-3-Nano-30B-A3B).

The full-size architectures in :data:`FULL_CONFIGS` are configs only (no weights):
:func:`skyrl_models._nemotron_impl.full_config` builds their transformers config,
for sizing and planning; a job loads such a model from ``path``.

This module is what the ``skyrl`` entry point imports: it holds the options and
the presets only and imports neither torch nor transformers. The factory imports
the implementation (:mod:`skyrl_models._nemotron_impl`) when a job selects the family.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import option
from skyrl_models._options import PresetOrPath, claims_model_types, model_traits

from skyrl_models._nemotron_data import (  # noqa: F401 - also this module's public names
    MODEL_TYPES,
    LAYER_LETTERS,
    PRESETS,
    FULL_CONFIGS,
    INITIALIZER_RANGE,
    layer_types,
    _check_preset,
    _check_path,
)


@attrs.frozen
class NemotronConfig(PresetOrPath):
    """Options of ``[model]`` when ``family = "nemotron"``: exactly one of ``preset`` and ``path``."""

    preset: str | None = option(
        None,
        help="a tiny model with random weights: 'tiny-nemotron-h' (Mamba2, MoE, attention, MoE layers) or "
        "'tiny-nemotron-3-super' (the larger Nemotron 3 models' latent MoE: experts in a projected space, "
        "group-limited routing)",
        validator=_check_preset,
    )
    path: str | None = option(
        None, help="a local Hugging Face folder (config.json, *.safetensors, tokenizer files)", validator=_check_path
    )
    dtype: Literal["float32", "bfloat16"] = option("float32", help="dtype of the weights")
    attn_implementation: Literal["sdpa", "eager"] = option("sdpa", help="transformers attention implementation")

    def __attrs_post_init__(self) -> None:
        self.check_preset_or_path(PRESETS)


def make_family(config: NemotronConfig) -> Any:
    """The factory: a :class:`skyrl_host.interfaces.ModelFamily` (imports torch and transformers)."""
    from skyrl_models._nemotron_impl import NemotronFamily

    return NemotronFamily(config)


@hookimpl
def skyrl_register_models(register: Any) -> None:
    register(
        "nemotron",
        make_family,
        config=NemotronConfig,
        description="Nemotron-H (nemotron_h: Nemotron 3, hybrid Mamba2/attention/MoE): a tiny preset or a local folder",
        claims=claims_model_types(MODEL_TYPES, "nemotron"),
        traits=model_traits,
    )
