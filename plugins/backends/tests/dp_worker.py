"""One rank of the data-parallel tests (run by test_data_parallel.py, one process per rank).

    python dp_worker.py RANK WORLD PORT OUT

Joins a gloo group on 127.0.0.1, then for each of "ddp" and "fsdp2": trains the
tiny float64 model two steps on this rank's shard of two global batches (uneven
token counts; rank 0 has no sequence at all in the second step), checks the
checkpoint round trip, and rank 0 writes the weights and metrics to OUT.
"""

from __future__ import annotations

import datetime
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

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


def run(mode: str, rank: int, world: int) -> dict:
    be = tiny.make_backend(data_parallel=mode, **OPTIONS)
    be.start(tiny.loaded(0, dtype=torch.float64), seed=0, total_steps=4, reference=True)
    algo = tiny.TokenMean(needs_reference=True, metrics=True)
    metrics = []
    for (batch, adv), shards in zip(global_batches(), SHARDS):
        local, local_adv = shard(batch, adv, shards[rank] if world == 2 else sum(shards, []))
        metrics.append(be.train_step(local, local_adv, algo, temperature=0.9, max_new_tokens=8))
    weights = {k: v.detach().cpu().clone() for k, v in be.named_weights()}
    state = be.state_dict()
    # Load into a fresh backend (other initial weights); only rank 0 passes the state.
    fresh = tiny.make_backend(data_parallel=mode, **OPTIONS)
    fresh.start(tiny.loaded(99, dtype=torch.float64), seed=0, total_steps=4, reference=True)
    fresh.load_state_dict(state if rank == 0 else {})
    reloaded = {k: v.detach().cpu().clone() for k, v in fresh.named_weights()}
    return {"weights": weights, "metrics": metrics, "state_model": state["model"], "reloaded": reloaded,
            "fresh_steps": fresh.steps}


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    results = {mode: run(mode, rank, world) for mode in ("ddp", "fsdp2")}
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # avoids the rare abort at interpreter exit after destroy_process_group (FACTS)


if __name__ == "__main__":
    main()
