"""examples/math_chat.toml runs end to end on a real-shaped checkpoint (a BPE tokenizer,
a chat template, chat-formatted word problems scored by math-verify): it renders, samples,
scores and trains without error, and its numbers are sane (a short version: one step)."""

from __future__ import annotations

import math
import pathlib

import pytest

from skyrl_host.testing import step_rows

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_math_chat_example_runs_scores_and_trains(skyrl_cli, skyrl_real_checkpoint, tmp_path,
                                                      monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # the example's data path is relative to the project
    out = tmp_path / "out"
    result = skyrl_cli(
        "run", "examples/math_chat.toml", "--set", f"model.path={str(skyrl_real_checkpoint('qwen3'))!r}",
        "--set", "job.steps=1", "--set", "job.batch_size=2", "--set", "job.n_samples=2",
        "--set", "job.max_new_tokens=16", "--set", f"job.output_dir={str(out)!r}",
    )
    assert result.exit_code == 0, result.stderr
    [row] = step_rows(out)
    assert 0.0 <= row["reward_mean"] <= 1.0
    assert row["math_scored"] == 4 and row["math_unparsed"] == 0  # every answer of the data parses
    assert 0 < row["response_length_mean"] <= 16
    for key in ("loss", "entropy", "grad_norm"):
        assert math.isfinite(row[key]), (key, row[key])
    assert row["entropy"] > 1.0  # random weights: a wide distribution over the ~8k tokens
    assert (out / "final" / "config.json").exists()
