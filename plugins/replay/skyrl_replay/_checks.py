"""Job-level checks of the replay strategies (light: no torch; run by ``skyrl validate``)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")


def check_plugin_flag(spec: Any, table: str, flag: str, strategy: str, what: str) -> list[tuple[str, str]]:
    """The plugin of ``[table]`` must have the boolean option ``flag`` set."""
    choice = spec.plugins.get(table)
    if choice is None or isinstance(choice, tuple):
        return [("replay.strategies", f"replay strategy {strategy!r} needs {what} from [{table}], which this job has not")]
    config = choice.config
    if config is None or not hasattr(config, flag):
        from skyrl_host.config import SLOTS

        return [(
            f"{table}.{SLOTS[table].selector}",
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


def model_is_moe(choice: Any) -> bool | None:
    """Whether the selected model has MoE layers: from its local folder's config.json,
    or the family config's ``is_moe`` for presets; None when unknown."""
    config = choice.config
    path = getattr(config, "path", None)
    if isinstance(path, str):
        try:
            data = json.loads((pathlib.Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # the family's own validator reports a bad folder
        tables = [data] + [v for k, v in data.items() if k.endswith("_config") and isinstance(v, dict)]
        return any(isinstance(t.get(k), int) and t.get(k) > 0 for t in tables for k in _EXPERT_KEYS)
    value = getattr(config, "is_moe", None)
    return value if isinstance(value, bool) else None


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
