"""Checkpoint folders of a run: ``<output_dir>/checkpoints/step_000010/``.

A checkpoint is written into a temporary folder and renamed into place only when
complete (a rename is atomic), so a run killed mid-write leaves either the old
set of checkpoints or the new one, never a torn checkpoint that resume would
trust. Old checkpoints beyond ``keep`` are removed after a new one lands.
"""

from __future__ import annotations

import pathlib
import re
import shutil
from typing import Iterator

CHECKPOINTS = "checkpoints"
_STEP = re.compile(r"^step_(\d+)$")


def checkpoint_root(output_dir: pathlib.Path) -> pathlib.Path:
    return output_dir / CHECKPOINTS


def list_checkpoints(output_dir: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = _STEP.match(path.name)
        if m and path.is_dir():
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(output_dir: pathlib.Path) -> tuple[int, pathlib.Path] | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


class CheckpointWriter:
    """``with CheckpointWriter(output_dir, step) as folder: ...write files...``;
    the folder becomes visible as ``step_<n>`` only if the block succeeds."""

    def __init__(self, output_dir: pathlib.Path, step: int, keep: int = 2):
        self.root = checkpoint_root(output_dir)
        self.final = self.root / f"step_{step:06d}"
        self.tmp = self.root / f".step_{step:06d}.tmp"
        self.keep = keep

    def __enter__(self) -> pathlib.Path:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if self.final.exists():
            shutil.rmtree(self.final)
        self.tmp.rename(self.final)
        for _, old in list_checkpoints(self.root.parent)[: -self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)


def stale_temporaries(output_dir: pathlib.Path) -> Iterator[pathlib.Path]:
    root = checkpoint_root(output_dir)
    if root.is_dir():
        yield from (p for p in root.iterdir() if p.name.endswith(".tmp"))
