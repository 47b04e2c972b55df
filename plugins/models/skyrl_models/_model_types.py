"""What a local folder's config.json says about the model in it, and whether the generic
family (``hf``) can load it: a transformers causal language model, or a folder that ships
its own code and is trusted.

:func:`light_problem` reads only the JSON (for the option's validator, which runs where
``skyrl validate`` must stay light); :func:`folder_problem` asks transformers too (the
family's job check and its ``load``: imports transformers).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

# Class-name endings of causal language models (what AutoModelForCausalLM gives); an
# ``architectures`` list with none of them is some other head (masked LM, classifier,
# an encoder or vision model).
CAUSAL_ENDINGS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def read_config(path: str) -> dict[str, Any] | None:
    try:
        data = json.loads((pathlib.Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def remote_code(data: dict[str, Any]) -> str | None:
    """The class a folder's own code provides for AutoModelForCausalLM (``auto_map``), if any."""
    auto_map = data.get("auto_map")
    if isinstance(auto_map, dict):
        ref = auto_map.get("AutoModelForCausalLM")
        if isinstance(ref, (list, tuple)):
            ref = ref[0] if ref else None
        return ref if isinstance(ref, str) else None
    return None


def light_problem(path: str, *, trust_remote_code: bool) -> str | None:
    """What is wrong with the folder, from its config.json alone (None: nothing seen)."""
    data = read_config(path)
    if data is None:
        return None  # the path's own validator names an unreadable config.json
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        return f"{path!r}: config.json has no model_type, so no model class can be chosen for it"
    architectures = data.get("architectures")
    if isinstance(architectures, list) and architectures and all(isinstance(a, str) for a in architectures):
        if not any(a.endswith(CAUSAL_ENDINGS) for a in architectures):
            return (f"{path!r} holds {', '.join(architectures)} (model type {model_type!r}): not a causal language "
                    "model (an encoder-only, classification or vision model): RL and SFT here generate and score text "
                    "with a causal LM")
    return None


def folder_problem(path: str, *, trust_remote_code: bool) -> str | None:
    """What is wrong with the folder for ``AutoModelForCausalLM`` (None: it loads):
    :func:`light_problem`, then transformers' own tables (imports transformers)."""
    problem = light_problem(path, trust_remote_code=trust_remote_code)
    if problem is not None:
        return problem
    data = read_config(path)
    if data is None:
        return None
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = data["model_type"]
    code = remote_code(data)
    if code is not None and (model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or trust_remote_code):
        if not trust_remote_code:
            return (f"{path!r} ships its own model code ({code}, config.json auto_map): it would run that Python "
                    "code; refused unless the job sets [model] trust_remote_code = true (for folders you trust)")
        return None
    if model_type not in CONFIG_MAPPING_NAMES:
        return (f"{path!r} has model type {model_type!r}, which transformers {transformers.__version__} does not know "
                "(a newer transformers, or a folder with its own code and trust_remote_code = true)")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (f"{path!r} has model type {model_type!r}: not a causal language model in transformers "
                f"{transformers.__version__} (an encoder-only, encoder-decoder or vision model); "
                "AutoModelForCausalLM cannot load it")
    return None
