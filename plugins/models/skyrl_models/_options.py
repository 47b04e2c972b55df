"""Option validators shared by the model families' config classes (no heavy imports)."""

from __future__ import annotations

import pathlib
from typing import Any


def check_hf_folder(_inst: Any, _attr: Any, value: str | None) -> None:
    """``[model] path``: a local Hugging Face folder (with config.json), or None."""
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
        return
    raise ValueError(f"expected a folder with config.json, found {found}")
