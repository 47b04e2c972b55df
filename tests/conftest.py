"""Shared fixtures for the host's tests."""

from __future__ import annotations

import itertools
import pathlib
import sys
import textwrap
from typing import Callable, Mapping

import pytest

pytest_plugins = ["pytester"]

_ids = itertools.count()


@pytest.fixture
def make_dist(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., str]:
    """Install a distribution the way pip leaves it on disk: modules plus a
    ``*.dist-info`` folder with METADATA and entry_points.txt, in a folder put on
    sys.path. Returns a suffix that makes module names unique to the test."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    suffix = f"_t{next(_ids)}"
    created: list[str] = []

    def make(name: str, entry_points: Mapping[str, str], modules: Mapping[str, str], version: str = "1.0") -> str:
        for mod, source in modules.items():
            (site / f"{mod}.py").write_text(textwrap.dedent(source))
            created.append(mod)
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        lines = ["[skyrl]"] + [f"{k} = {v}" for k, v in entry_points.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        return suffix

    make.suffix = suffix  # type: ignore[attr-defined]
    make.site = site  # type: ignore[attr-defined]
    yield make
    for mod in created:
        sys.modules.pop(mod, None)
