"""The replay ablation (examples/replay_ablation.py) at a few steps: with the engine in
bfloat16, the trainer in float32 and top-p sampling, r3 + support cut the mean
engine/trainer logprob gap at least 5x against no replay, and with the engine in the
trainer's precision the gap is float round-off."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "replay_ablation.py"


@pytest.mark.slow
def test_replay_ablation(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("replay_ablation", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(["--steps", "5", "--out", str(tmp_path)])
    assert results["both_vs_none_mean_ratio"] >= 5.0
    assert results["support"]["gap_mean"] < results["none"]["gap_mean"] / 5
    assert results["both"]["gap_max"] <= results["support"]["gap_max"]  # r3 removes the routing flips on top
    assert results["both, same precision"]["gap_max"] < 1e-5
    saved = json.loads((tmp_path / "ablation.json").read_text())
    assert saved["both_vs_none_mean_ratio"] == pytest.approx(results["both_vs_none_mean_ratio"])
    table = (tmp_path / "ablation.md").read_text().splitlines()
    assert table[0].startswith("| strategies |") and len(table) == 2 + 5
    assert (tmp_path / "ablation.png").stat().st_size > 10_000
