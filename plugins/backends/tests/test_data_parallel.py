"""Two gloo processes on CPU (DDP and FSDP2) give the single-process step on the same
global batch, with uneven token counts per rank and a rank without any sequence."""

from __future__ import annotations

import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

HERE = pathlib.Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process(tiny) -> dict:
    """The same two steps on the whole global batches in one process (no DP)."""
    worker = tiny_worker()
    be = tiny.make_backend(**worker.OPTIONS)
    be.start(tiny.loaded(0, dtype=torch.float64), seed=0, total_steps=4, reference=True)
    algo = tiny.TokenMean(needs_reference=True, metrics=True)
    metrics = [be.train_step(b, a, algo, temperature=0.9, max_new_tokens=8) for b, a in worker.global_batches()]
    return {"weights": tiny.params(be), "metrics": metrics}


def tiny_worker():
    import importlib.util

    name = "skyrl_backends_tests_dp_worker"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "dp_worker.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.slow
def test_two_processes_equal_one_process(tiny, tmp_path) -> None:
    out = tmp_path / "rank0.pt"
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "dp_worker.py"), str(rank), "2", str(port), str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=150)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-4000:]

    got = torch.load(out, weights_only=False)
    want = single_process(tiny)
    # Sanity: the shards really are uneven.
    worker = tiny_worker()
    (b1, _), _ = worker.global_batches()
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
