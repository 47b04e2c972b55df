"""qwen: the Qwen3 model family, dense (``qwen3``) and mixture-of-experts (``qwen3_moe``).

``[model] family = "qwen"`` with either ``preset`` (a tiny model with random
weights from the job's seed and a character-level tokenizer for the dataset's
alphabet) or ``path`` (a local Hugging Face folder, e.g. a downloaded
Qwen3-0.6B or Qwen3-30B-A3B).

This module is what the ``skyrl`` entry point imports: it holds the options and
the presets only and imports neither torch nor transformers. The factory imports
the implementation (:mod:`skyrl_models._qwen_impl`) when a job selects the family.
"""

from __future__ import annotations

import os
from typing import Any, Literal, Mapping

import attrs

from skyrl_host import hookimpl
from skyrl_host.config import OptionError, gt, option
from skyrl_host.errors import did_you_mean
from skyrl_models._options import check_hf_folder

MODEL_TYPES = ("qwen3", "qwen3_moe")
"""The transformers ``model_type`` values this family loads from a path."""

# Presets: the architecture numbers; the vocabulary comes from the tokenizer.
# "tiny" is the 165k-parameter Qwen3 that learns reverse_digits on a CPU in minutes.
PRESETS: Mapping[str, Mapping[str, int]] = {
    "tiny": {
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 4,
        "head_dim": 32,
        "intermediate_size": 256,
    },
    "tiny-moe": {
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 4,
        "head_dim": 32,
        "intermediate_size": 64,  # per expert (Qwen3MoeConfig.moe_intermediate_size)
        "num_experts": 8,
        "top_k": 2,
    },
}
MOE_PRESETS = ("tiny-moe",)
MAX_POSITION_EMBEDDINGS = 512  # of the presets
INITIALIZER_RANGE = 0.02  # std of the presets' random weights

ARCH_KEYS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")
MOE_KEYS = ("num_experts", "top_k")


def _check_preset(_inst: Any, _attr: Any, value: str | None) -> None:
    if value is not None and value not in PRESETS:
        names = ", ".join(repr(p) for p in PRESETS)
        raise ValueError(f"expected one of {names}, found {value!r}{did_you_mean(value, PRESETS)}")


_check_preset.__doc__ = "one of " + ", ".join(repr(p) for p in PRESETS)


_check_path = check_hf_folder


@attrs.frozen
class QwenConfig:
    """Options of ``[model]`` when ``family = "qwen"``: exactly one of ``preset`` and ``path``."""

    preset: str | None = option(
        None, help="a tiny model with random weights: 'tiny' (Qwen3) or 'tiny-moe' (Qwen3-MoE)", validator=_check_preset
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
        None, help="preset override: MLP width (of each expert for 'tiny-moe')", validator=gt(0)
    )
    num_experts: int | None = option(None, help="preset override, MoE presets only: experts per layer", validator=gt(0))
    top_k: int | None = option(None, help="preset override, MoE presets only: experts per token", validator=gt(0))

    def __attrs_post_init__(self) -> None:
        if self.preset is not None and self.path is not None:
            raise OptionError("path", f"give either preset or path, not both (preset is {self.preset!r})")
        if self.preset is None and self.path is None:
            names = " or ".join(repr(p) for p in PRESETS)
            raise OptionError("preset", f"missing: give preset = {names}, or path = a local Hugging Face folder")
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
                raise OptionError(
                    moe[0], f"only applies to a mixture-of-experts preset ('tiny-moe'), not {self.preset!r}"
                )
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
    def resolved_path(self) -> str | None:
        return None if self.path is None else os.path.abspath(os.path.expanduser(self.path))


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
        description="Qwen3 dense and MoE models (qwen3, qwen3_moe): tiny presets or a local Hugging Face folder",
    )
