"""One rank of the data-parallel tests: test_data_parallel.py runs :func:`train` in 2
gloo processes (``skyrl_host.testing.run_gloo_ranks``), and lora_dp_worker.py trains
LoRA adapters on the same shards.

For each of "ddp" and "fsdp2", :func:`train` trains the tiny float64 model two steps on
this rank's shard of two global batches (uneven token counts; rank 0 has no sequence at
all in the second step), checks the checkpoint round trip, and returns the weights and
metrics. :func:`trained` is the same training, also in one process on the whole batches.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _tiny as tiny  # noqa: E402

# Global batches and how they are split over 2 ranks (sequence indices).
BATCHES = [(20, 6), (21, 4)]  # (seed, sequences)
SHARDS = [[[0], [1, 2, 3, 4, 5]], [[], [0, 1, 2, 3]]]
OPTIONS = dict(micro_batch_tokens=16, pack_length=7, lr=1e-2, max_grad_norm=0.5, weight_decay=0.1, warmup_steps=1)


def shard(batch, adv, seqs):
    token_idx = np.concatenate([np.arange(batch.cu_seqlens[s], batch.cu_seqlens[s + 1]) for s in seqs]) if seqs else np.zeros(0, np.int64)
    return batch.select(seqs), adv[token_idx]


def global_batches():
    out = []
    for seed, n in BATCHES:
        b = tiny.tiny_batch(seed, n=n)
        out.append((b, tiny.tiny_advantages(b, seed=seed)))
    return out


def trained(rank: int | None = None, **options) -> tuple:
    """A backend (``OPTIONS`` updated by ``options``) started on the tiny float64 model and
    trained two steps, on rank ``rank``'s shard of each global batch (the whole batches
    when ``rank`` is None: one process, no data parallelism), and the steps' metrics."""
    be = tiny.make_backend(**dict(OPTIONS, **options))
    be.start(tiny.loaded(0, dtype=torch.float64), seed=0, total_steps=4, reference=True)
    algo = tiny.TokenMean(needs_reference=True, metrics=True)
    metrics = []
    for (batch, adv), shards in zip(global_batches(), SHARDS):
        if rank is not None:
            batch, adv = shard(batch, adv, shards[rank])
        metrics.append(be.train_step(batch, adv, algo, temperature=0.9, max_new_tokens=8))
    return be, metrics


def run(mode: str, rank: int) -> dict:
    be, metrics = trained(rank, data_parallel=mode)
    weights = tiny.params(be)
    state = be.state_dict()
    # Load into a fresh backend (other initial weights); only rank 0 passes the state.
    fresh = tiny.make_backend(**dict(OPTIONS, data_parallel=mode))
    fresh.start(tiny.loaded(99, dtype=torch.float64), seed=0, total_steps=4, reference=True)
    fresh.load_state_dict(state if rank == 0 else {})
    return {"weights": weights, "metrics": metrics, "state_model": state["model"], "reloaded": tiny.params(fresh),
            "fresh_steps": fresh.steps}


def train(rank: int, world: int) -> dict:
    assert world == len(SHARDS[0]), world
    return {mode: run(mode, rank) for mode in ("ddp", "fsdp2")}
