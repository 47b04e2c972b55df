"""Option validators shared by the model families' config classes (no heavy imports)."""

from __future__ import annotations

import os
import pathlib
from typing import Any, Iterable

from skyrl_host.errors import did_you_mean
from skyrl_host.interfaces import ModelTraits
from skyrl_host.options import OptionError
from skyrl_models._checkpoint_files import safetensors_problem


def check_hf_folder(_inst: Any, _attr: Any, value: str | None) -> None:
    """``[model] path``: a local Hugging Face folder (with config.json), or None; its
    safetensors files (if any) must be whole: their headers are read, no tensor data."""
    if value is None:
        return
    p = pathlib.Path(value).expanduser()
    if not p.exists():
        found = f"nothing at {value!r}"
    elif not p.is_dir():
        found = f"a file {value!r}"
    elif not (p / "config.json").is_file():
        found = f"a folder without config.json {value!r}"
    else:
        problem = safetensors_problem(p)
        if problem:
            raise ValueError(problem)
        return
    raise ValueError(f"expected a folder with config.json, found {found}")


def preset_validator(presets: Iterable[str], full_size: Iterable[str] = (), full_config: str = "") -> Any:
    """The validator of ``[model] preset``: one of ``presets`` (or None). A full-size
    name (a configuration only, for ``skyrl models show``) is refused with a pointer to
    ``path`` (and to ``full_config``, the function that builds its configuration, if given)."""
    presets, full_size = tuple(presets), frozenset(full_size)
    names = ", ".join(repr(p) for p in presets)

    def check(_inst: Any, _attr: Any, value: str | None) -> None:
        if value is None or value in presets:
            return
        if value in full_size:
            raise ValueError(
                f"{value!r} is a full-size architecture without weights (a config only); "
                f"set path = a local folder of the checkpoint, or use a preset: {names}"
                + (f" (its configuration: {full_config}({value!r}))" if full_config else "")
            )
        raise ValueError(f"expected one of {names}, found {value!r}{did_you_mean(value, presets)}")

    check.__doc__ = f"one of {names}"
    return check


class PresetOrPath:
    """What every family's ``[model]`` config shares: exactly one of ``preset`` and
    ``path`` (checked by :meth:`check_preset_or_path` from ``__attrs_post_init__``)."""

    preset: str | None
    path: str | None

    def check_preset_or_path(self, presets: Iterable[str]) -> None:
        if self.preset is not None and self.path is not None:
            raise OptionError("path", f"give either preset or path, not both (preset is {self.preset!r})")
        if self.preset is None and self.path is None:
            names = " or ".join(repr(p) for p in presets)
            raise OptionError("preset", f"missing: give preset = {names}, or path = a local Hugging Face folder")

    @property
    def resolved_path(self) -> str | None:
        return None if self.path is None else os.path.abspath(os.path.expanduser(self.path))


def claims_model_types(model_types: Iterable[str], family: str) -> Any:
    """``claims`` of a family's registration: a ``[model]`` table without ``family``
    whose ``path`` holds a config.json of one of ``model_types`` is this family's, ahead
    of the generic ``hf`` (priority 2 against its 1)."""
    types_ = frozenset(model_types)

    def claims(section: Any) -> tuple[int, str] | None:
        import json

        path = section.get("path")
        if not isinstance(path, str):
            return None
        try:
            data = json.loads((pathlib.Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        model_type = data.get("model_type") if isinstance(data, dict) else None
        if model_type in types_:
            return 2, f"config.json's model_type {model_type!r} is one of family {family!r}'s"
        return None

    return claims


_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")


def folder_facts(path: str) -> tuple[str | None, bool | None, bool | None]:
    """``(model_type, is_moe, has_indexer)`` of a local folder from its config.json (and
    its nested ``*_config`` tables: a multimodal checkpoint's text model); all None when
    it cannot be read (the family's own validator reports a bad folder)."""
    import json

    from skyrl_toolkit.routing import KEY_INDEXER_MODEL_TYPES

    try:
        data = json.loads((pathlib.Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, None, None
    if not isinstance(data, dict):
        return None, None, None
    tables = [data] + [v for k, v in data.items() if k.endswith("_config") and isinstance(v, dict)]
    model_type = data.get("model_type") if isinstance(data.get("model_type"), str) else None
    is_moe = any(isinstance(t.get(k), int) and t.get(k) > 0 for t in tables for k in _EXPERT_KEYS)
    has_indexer = any(t.get("model_type") in KEY_INDEXER_MODEL_TYPES for t in tables)
    return model_type, is_moe, has_indexer


def model_traits(config: Any, *, model_type: str | None = None, is_moe: bool | None = None,
                 has_indexer: bool | None = None) -> ModelTraits:
    """A family's :class:`~skyrl_host.interfaces.ModelTraits`: for a ``path``, what its
    config.json says; for a preset, what the family knows of it (the arguments)."""
    path = config.resolved_path
    if path is not None:
        model_type, is_moe, has_indexer = folder_facts(path)
    return ModelTraits(
        name=config.path or config.preset, key="model.path" if config.path else "model.preset", path=path,
        model_type=model_type, dtype=config.dtype, is_moe=is_moe, has_indexer=has_indexer,
    )
