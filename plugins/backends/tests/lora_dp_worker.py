"""One rank of the LoRA data-parallel test: test_lora.py runs :func:`train` in 2 gloo
processes (``skyrl_host.testing.run_gloo_ranks``).

For each of "ddp" and "fsdp2", :func:`train` trains the tiny float64 model's LoRA
adapters two steps on this rank's shard of the data-parallel test's global batches
(dp_worker.py), round-trips a checkpoint into a fresh backend, and returns the adapters,
merged weights and metrics, and saves the adapters (PEFT's format) on the way.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _tiny as tiny  # noqa: E402
import dp_worker  # noqa: E402

LORA = dict(lora_rank=4, lora_targets=["q_proj", "v_proj", "down_proj"], lora_alpha=8.0)


def adapters(backend) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in backend.named_adapters()}


def run(mode: str, rank: int, out: str) -> dict:
    be, metrics = dp_worker.trained(rank, data_parallel=mode, **LORA)
    be.save_adapters(os.path.join(out, mode))  # a collective under FSDP2; rank 0 writes
    state = be.state_dict()
    fresh = tiny.make_backend(**dict(dp_worker.OPTIONS, data_parallel=mode, **LORA))
    fresh.start(tiny.loaded(0, dtype=torch.float64), seed=5, total_steps=4, reference=True)
    fresh.load_state_dict(state if rank == 0 else {})
    return {"adapters": adapters(be), "weights": tiny.params(be), "metrics": metrics, "reloaded": adapters(fresh)}


def train(rank: int, world: int, out: str) -> dict:
    """Also writes each mode's adapters (``save_adapters``) into ``out/<mode>``."""
    assert world == len(dp_worker.SHARDS[0]), world
    return {mode: run(mode, rank, out) for mode in ("ddp", "fsdp2")}
