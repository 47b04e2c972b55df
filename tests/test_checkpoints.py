"""Checkpoint folders land whole or not at all; resume truncates metrics."""

from __future__ import annotations

import json

import pytest

from skyrl_host.checkpoints import CheckpointWriter, latest_checkpoint, list_checkpoints
from skyrl_host.observers import metrics_jsonl


def test_a_checkpoint_appears_only_when_complete(tmp_path) -> None:
    with pytest.raises(RuntimeError):
        with CheckpointWriter(tmp_path, 10) as folder:
            (folder / "model.pt").write_bytes(b"half")
            raise RuntimeError("killed while writing")
    assert latest_checkpoint(tmp_path) is None
    assert not any((tmp_path / "checkpoints").iterdir())
    with CheckpointWriter(tmp_path, 10) as folder:
        (folder / "model.pt").write_bytes(b"whole")
    step, path = latest_checkpoint(tmp_path)
    assert step == 10 and (path / "model.pt").read_bytes() == b"whole"


def test_a_leftover_temporary_folder_is_never_taken_for_a_checkpoint(tmp_path) -> None:
    (tmp_path / "checkpoints" / ".step_000020.tmp").mkdir(parents=True)  # a kill -9 mid-write
    with CheckpointWriter(tmp_path, 10) as folder:
        (folder / "x").write_text("1")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10]


def test_old_checkpoints_are_pruned(tmp_path) -> None:
    for step in (5, 10, 15, 20):
        with CheckpointWriter(tmp_path, step, keep=2) as folder:
            (folder / "x").write_text(str(step))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [15, 20]


def test_resume_truncates_metrics_after_the_checkpoint(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"event": "start"}] + [{"step": s, "loss": s / 10} for s in range(1, 8)]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 8, "lo'  # torn last line
    path.write_text(text)
    metrics_jsonl._truncate_after(path, 5)
    assert [r["step"] for r in metrics_jsonl.read_metrics(path)] == [1, 2, 3, 4, 5]
    assert path.read_text().endswith("\n")
