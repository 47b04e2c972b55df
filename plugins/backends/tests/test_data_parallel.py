"""Two gloo processes on CPU (DDP and FSDP2) give the single-process step on the same
global batch, with uneven token counts per rank and a rank without any sequence."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from skyrl_host.testing import run_gloo_ranks

HERE = pathlib.Path(__file__).resolve().parent


def single_process(tiny, dp_worker) -> dict:
    """The same two steps on the whole global batches in one process (no DP)."""
    be, metrics = dp_worker.trained()
    return {"weights": tiny.params(be), "metrics": metrics}


@pytest.mark.slow
def test_two_processes_equal_one_process(tiny, dp_worker) -> None:
    got = run_gloo_ranks(HERE / "dp_worker.py", "train", 2, timeout=150)[0]
    want = single_process(tiny, dp_worker)
    # Sanity: the shards really are uneven.
    (b1, _), _ = dp_worker.global_batches()
    assert b1.seq_lens[0] * 3 < b1.seq_lens[1:].sum()

    for mode in ("ddp", "fsdp2"):
        run = got[mode]
        assert run["weights"].keys() == want["weights"].keys(), mode
        for name, w in want["weights"].items():
            torch.testing.assert_close(run["weights"][name], w, atol=1e-10, rtol=0, msg=f"{mode} {name}")
        for step, (m, ref) in enumerate(zip(run["metrics"], want["metrics"])):
            for key in ("loss", "grad_norm", "lr", "kl", "entropy", "ratio_mean", "logprob_diff_mean",
                        "logprob_diff_max", "tokens", "loss_tokens", "sequences"):
                assert m[key] == pytest.approx(ref[key], rel=1e-9, abs=1e-12), (mode, step, key)
        # Checkpoints: rank 0's full state is the weights; a fresh backend loads it (broadcast from rank 0).
        for name, w in run["weights"].items():
            assert torch.equal(run["state_model"][name], w), (mode, name)
            assert torch.equal(run["reloaded"][name], w), (mode, name)
        assert run["fresh_steps"] == 2
    assert not np.isclose(want["metrics"][1]["kl"], 0.0)
