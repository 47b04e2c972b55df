"""One rank of the LoRA data-parallel test (run by test_lora.py, one process per rank).

    python lora_dp_worker.py RANK WORLD PORT OUT

Joins a gloo group on 127.0.0.1, then for each of "ddp" and "fsdp2": trains the tiny
float64 model's LoRA adapters two steps on this rank's shard of the data-parallel test's
global batches, round-trips a checkpoint into a fresh backend, and rank 0 writes the
adapters, merged weights and metrics to OUT.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _tiny as tiny  # noqa: E402
import dp_worker  # noqa: E402

LORA = dict(lora_rank=4, lora_targets=["q_proj", "v_proj", "down_proj"], lora_alpha=8.0)


def run(mode: str, rank: int, world: int) -> dict:
    opts = dict(dp_worker.OPTIONS, **LORA)
    if mode != "none":
        opts["data_parallel"] = mode
    be = tiny.make_backend(**opts)
    be.start(tiny.loaded(0, dtype=torch.float64), seed=0, total_steps=4, reference=True)
    algo = tiny.TokenMean(needs_reference=True, metrics=True)
    metrics = []
    for (batch, adv), shards in zip(dp_worker.global_batches(), dp_worker.SHARDS):
        local, local_adv = dp_worker.shard(batch, adv, shards[rank] if world == 2 else sum(shards, []))
        metrics.append(be.train_step(local, local_adv, algo, temperature=0.9, max_new_tokens=8))
    adapters = {k: v.detach().cpu().clone() for k, v in be.named_adapters()}
    weights = {k: v.detach().cpu().clone() for k, v in be.named_weights()}
    state = be.state_dict()
    fresh = tiny.make_backend(**opts)
    fresh.start(tiny.loaded(0, dtype=torch.float64), seed=5, total_steps=4, reference=True)
    fresh.load_state_dict(state if rank == 0 else {})
    reloaded = {k: v.detach().cpu().clone() for k, v in fresh.named_adapters()}
    return {"adapters": adapters, "weights": weights, "metrics": metrics, "reloaded": reloaded}


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
