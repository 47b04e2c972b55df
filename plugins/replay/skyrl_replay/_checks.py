"""Job-level checks of the replay strategies (light: no torch; run by ``skyrl validate``)."""

from __future__ import annotations

from typing import Any

from skyrl_host.kinds import SLOT_KINDS
from skyrl_toolkit.routing import INDEXER_CHANNEL


def check_trait(spec: Any, table: str, trait: str, strategy: str, what: str) -> list[tuple[str, str]]:
    """The plugin of ``[table]`` must declare ``trait`` on (its traits: an engine's
    ``routed_experts``, a sampler's ``support``): None means it cannot produce it, False
    that the job has not asked it to (its ``switches`` name the option that does)."""
    choice = spec.plugins.get(table)
    if choice is None or isinstance(choice, tuple):
        return [("replay.strategies", f"replay strategy {strategy!r} needs {what} from [{table}], which this job has not")]
    traits = choice.traits
    option = traits.switches.get(trait)
    value = getattr(traits, trait)  # a field of the kind's traits class: a typo fails here, in every test
    if value is None or option is None and not value:
        return [(
            f"{table}.{SLOT_KINDS[table].selector}",
            f"replay strategy {strategy!r} needs {what}, but {table} {choice.name!r} cannot produce them "
            f"(it declares no way to record them)",
        )]
    if not value:
        return [(
            f"{table}.{option}" if _present(spec, table, option) else table,
            f"replay strategy {strategy!r} needs {what}: set {table}.{option} = true",
        )]
    return []


def _present(spec: Any, table: str, key: str) -> bool:
    section = spec.raw.get(table)
    return isinstance(section, dict) and key in section


def check_model_is_moe(spec: Any) -> list[tuple[str, str]]:
    choice = spec.plugins.get("model")
    if choice is None or isinstance(choice, tuple):
        return []
    traits = choice.traits
    if traits.is_moe is False:
        return [(
            traits.key,
            f"replay strategy 'r3' replays MoE routing, but model {traits.name!r} ({choice.name}) has no MoE layers; "
            "remove 'r3' from replay.strategies or choose a mixture-of-experts model",
        )]
    return []


def check_indexer_capture(spec: Any) -> list[tuple[str, str]]:
    """r3 on a model with a sparse-attention indexer (GLM-5, DeepSeek-V3.2) replays the
    indexer's key picks too: the engine must be one that records them (its traits say
    ``indexer_topk``)."""
    model, engine = spec.plugins.get("model"), spec.plugins.get("engine")
    if model is None or isinstance(model, tuple) or engine is None or isinstance(engine, tuple):
        return []
    if not model.traits.has_indexer or engine.traits.indexer_topk:
        return []
    return [(
        f"engine.{SLOT_KINDS['engine'].selector}",
        f"replay strategy 'r3' on model {model.traits.name!r} ({model.name}) must also replay the keys its "
        f"sparse-attention indexer picked (side channel {INDEXER_CHANNEL!r}), which engine {engine.name!r} cannot "
        "record; use engine 'embedded' or remove 'r3' from replay.strategies",
    )]
