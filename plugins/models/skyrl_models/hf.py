"""hf: any transformers causal language model, from a local folder or a tiny preset.

``[model] family = "hf"`` loads what ``transformers.AutoModelForCausalLM`` loads:
Qwen2.5, Llama 3, Mistral, Gemma 2 / 3, Phi-3 / 4, OLMo 2, SmolLM, Mixtral, Qwen2-MoE,
OLMoE and the rest of transformers' causal LMs. With ``path`` and no ``family`` the
job picks the family from the folder's ``config.json``: the specific family that covers
its ``model_type`` (qwen, glm, kimi, nemotron), else this one (``skyrl validate`` says
which it chose and why).

Nothing here is a list of architectures: what the model can do is found by probing it
when it loads (:mod:`skyrl_models._generic_impl`): the LoRA targets are the names of its
``nn.Linear`` modules, the MoE routers are the modules whose output has the softmax top-k
shape and numbers (so ``r3`` replays them), packed rows come from the backend's own probe
of the attention. An MoE whose routers compute their weights otherwise is refused for
``r3`` at validate, with the reason.

This module is what the ``skyrl`` entry point imports: options and presets only, no
torch or transformers. The factory imports :mod:`skyrl_models._generic_impl`.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import OptionError, option
from skyrl_models._options import PresetOrPath, check_hf_folder, model_traits

from skyrl_models._hf_data import (  # noqa: F401 - also this module's public names
    MAX_POSITION_EMBEDDINGS,
    INITIALIZER_RANGE,
    PRESETS,
    MOE_PRESETS,
    folder_config,
    claims,
    _check_preset,
)


@attrs.frozen
class HfConfig(PresetOrPath):
    """Options of ``[model]`` when ``family = "hf"``: exactly one of ``preset`` and ``path``."""

    preset: str | None = option(
        None,
        help="a tiny model with random weights: " + ", ".join(f"'{p}' ({t})" for p, (t, _) in PRESETS.items()),
        validator=_check_preset,
    )
    path: str | None = option(
        None, help="a local Hugging Face folder of any transformers causal LM (config.json, weights, tokenizer)",
        validator=check_hf_folder,
    )
    dtype: Literal["float32", "bfloat16"] = option("float32", help="dtype of the weights")
    attn_implementation: Literal["sdpa", "eager"] = option("sdpa", help="transformers attention implementation")
    trust_remote_code: bool = option(
        False,
        help="run the Python code a folder ships for its architecture (config.json auto_map): only for folders you "
        "trust; without it such a folder is refused",
    )

    def __attrs_post_init__(self) -> None:
        self.check_preset_or_path(PRESETS)
        if self.path is not None:
            from skyrl_models._model_types import light_problem  # config.json alone: validate stays light

            problem = light_problem(self.path, trust_remote_code=self.trust_remote_code)
            if problem is not None:
                raise OptionError("path", problem)

    @property
    def model_type(self) -> str | None:
        """The ``model_type`` the preset builds or the folder declares."""
        if self.preset is not None:
            return PRESETS[self.preset][0]
        data = folder_config(self.path) if self.path else None
        return data.get("model_type") if data else None

    @property
    def is_moe(self) -> bool:
        """A MoE preset (for a path, the traits read config.json)."""
        return self.preset in MOE_PRESETS

    @property
    def is_moe_folder(self) -> bool:
        """Whether ``path``'s config.json counts experts (any of the keys transformers' MoE configs use)."""
        data = folder_config(self.path) if self.path else None
        if not data:
            return False
        tables = [data] + [v for k, v in data.items() if k.endswith("_config") and isinstance(v, dict)]
        keys = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
        return any(isinstance(t.get(k), int) and t.get(k) > 1 for t in tables for k in keys)


def check(spec: Any) -> list[tuple[str, str]]:
    """The job check: a folder transformers' AutoModelForCausalLM loads (asks transformers:
    only for a job with a path), and ``r3`` only where routers were found to replay."""
    config = spec.plugins["model"].config
    problems: list[tuple[str, str]] = []
    if config.path is not None:
        from skyrl_models._model_types import folder_problem

        problem = folder_problem(config.path, trust_remote_code=config.trust_remote_code)
        if problem is not None:
            problems.append(("model.path", problem))
        elif _uses_r3(spec) and config.is_moe_folder:
            from skyrl_models._generic_impl import folder_router_problems

            refused = folder_router_problems(config.path, trust_remote_code=config.trust_remote_code)
            if refused:
                where, why = next(iter(refused.items()))
                problems.append(("replay.strategies", f"replay strategy 'r3' cannot replay the routers of "
                                 f"{config.path!r} ({where}: {why}); remove 'r3'"))
    return problems


def _uses_r3(spec: Any) -> bool:
    chosen = spec.plugins.get("replay") or ()
    return any(getattr(c, "name", None) == "r3" for c in (chosen if isinstance(chosen, tuple) else (chosen,)))


def make_family(config: HfConfig) -> Any:
    """The factory: a :class:`skyrl_host.interfaces.ModelFamily` (imports torch and transformers)."""
    from skyrl_models._generic_impl import GenericFamily

    return GenericFamily(config)


@hookimpl
def skyrl_register_models(register: Any) -> None:
    register(
        "hf",
        make_family,
        config=HfConfig,
        description="any transformers causal LM (Qwen2.5, Llama, Mistral, Gemma, Phi, OLMo, SmolLM, Mixtral, ...): "
        "a local Hugging Face folder or a tiny preset; LoRA targets and MoE routers found by probing",
        check=check,
        claims=claims,
        traits=lambda c: model_traits(c, model_type=c.model_type, is_moe=c.is_moe, has_indexer=False),
    )
