"""Job-level checks of the replay strategies (light: no torch; run by ``skyrl validate``)."""

from __future__ import annotations

from typing import Any

from skyrl_host.kinds import SLOT_KINDS
from skyrl_host.routing import INDEXER_CHANNEL, model_has_indexer, model_is_moe


def check_plugin_flag(spec: Any, table: str, flag: str, strategy: str, what: str) -> list[tuple[str, str]]:
    """The plugin of ``[table]`` must have the boolean option ``flag`` set."""
    choice = spec.plugins.get(table)
    if choice is None or isinstance(choice, tuple):
        return [("replay.strategies", f"replay strategy {strategy!r} needs {what} from [{table}], which this job has not")]
    config = choice.config
    if config is None or not hasattr(config, flag):
        return [(
            f"{table}.{SLOT_KINDS[table].selector}",
            f"replay strategy {strategy!r} needs {what}, but {table} {choice.name!r} cannot produce them "
            f"(it has no {flag!r} option)",
        )]
    if not getattr(config, flag):
        return [(
            f"{table}.{flag}" if _present(spec, table, flag) else table,
            f"replay strategy {strategy!r} needs {what}: set {table}.{flag} = true",
        )]
    return []


def _present(spec: Any, table: str, key: str) -> bool:
    section = spec.raw.get(table)
    return isinstance(section, dict) and key in section


def check_model_is_moe(spec: Any) -> list[tuple[str, str]]:
    choice = spec.plugins.get("model")
    if choice is None or isinstance(choice, tuple):
        return []
    if model_is_moe(choice) is False:
        where = "model.path" if getattr(choice.config, "path", None) else "model.preset"
        what = getattr(choice.config, "path", None) or getattr(choice.config, "preset", None)
        return [(
            where,
            f"replay strategy 'r3' replays MoE routing, but model {what!r} ({choice.name}) has no MoE layers; "
            "remove 'r3' from replay.strategies or choose a mixture-of-experts model",
        )]
    return []


def check_indexer_capture(spec: Any) -> list[tuple[str, str]]:
    """r3 on a model with a sparse-attention indexer (GLM-5, DeepSeek-V3.2) replays the
    indexer's key picks too: the engine must be one that records them (its config class
    says so with ``records_indexer_topk = True``)."""
    model, engine = spec.plugins.get("model"), spec.plugins.get("engine")
    if model is None or isinstance(model, tuple) or engine is None or isinstance(engine, tuple):
        return []
    if not model_has_indexer(model):
        return []
    if getattr(engine.config, "records_indexer_topk", False):
        return []
    what = getattr(model.config, "path", None) or getattr(model.config, "preset", None)
    return [(
        f"engine.{SLOT_KINDS['engine'].selector}",
        f"replay strategy 'r3' on model {what!r} ({model.name}) must also replay the keys its sparse-attention "
        f"indexer picked (side channel {INDEXER_CHANNEL!r}), which engine {engine.name!r} cannot record; "
        "use engine 'embedded' or remove 'r3' from replay.strategies",
    )]
