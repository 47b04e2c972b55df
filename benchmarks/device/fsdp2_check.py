"""FSDP2 over one device: the torch backend with ``data_parallel = "fsdp2"`` in a one-rank
process group (NCCL on CUDA, gloo on the CPU) against the same backend without data
parallelism, on the same initial weights and the same RL-shaped batches.

    python benchmarks/device/fsdp2_check.py [--device cuda|cpu] [--kind qwen3|tiny] [--steps 5]

A machine with one GPU cannot run the multi-rank FSDP2 jobs (those go through the Ray
launcher, whose wheel does not travel to the lent machine), but one rank already takes
every FSDP2 path of the backend on that device: ``fully_shard`` per decoder layer and at
the root, the sharded optimizer state, the float32 step, the full state dict gathered for
the engine (``named_weights``) and the checkpoint round trip.

Both backends train ``--steps`` steps; every step's loss and gradient norm must agree
(1e-5 relative: the same arithmetic, grouped alike) and so must the weights after the last
step and the state dict the FSDP2 backend gathers (``named_weights``, on the CPU); the FSDP2 backend's ``state_dict`` loaded into a fresh
FSDP2 backend continues exactly as the original does (one more step each). Prints
one JSON object: the per-step differences, the median step times and their ratio
(FSDP2 / none). Exit 1 when the two disagree.

``--kind qwen3``: Qwen3-0.6B's widths with 2 layers (``build_checkpoint(DIR, "qwen3")``) on
12 RL-shaped sequences (prompts 128-512 tokens, responses 16-1024); ``tiny``: the
quickstart's preset on 64 quickstart-shaped sequences.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: the batches of train_step.py
from train_step import PolicyGradient, rl_batch  # noqa: E402

from skyrl_backends.torch import TorchBackendConfig, create  # noqa: E402
from skyrl_host.interfaces import LoadedModel  # noqa: E402

TOLERANCE = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_model(kind: str, folder: str) -> torch.nn.Module:
    if kind == "tiny":
        from skyrl_models.qwen import QwenConfig, make_family

        return make_family(QwenConfig(preset="tiny")).load(alphabet="0123456789", seed=0).model
    from transformers import AutoModelForCausalLM

    from skyrl_models.checkpoints import build_checkpoint

    build_checkpoint(folder, "qwen3")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--kind", default="qwen3", choices=("qwen3", "tiny"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "--device cuda: torch finds no CUDA device"}))
        return 2
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    group = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(group, rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory(prefix="skyrl-fsdp2-") as folder:
            base = base_model(args.kind, folder)
        batch, adv = rl_batch(64 if args.kind == "tiny" else 12, base.config.vocab_size, short=args.kind == "tiny")
        options = dict(lr=1e-4, micro_batch_tokens=4096, device=args.device)
        backends = {"none": create(TorchBackendConfig(**options)),
                    "fsdp2": create(TorchBackendConfig(**options, data_parallel="fsdp2"))}
        for be in backends.values():
            be.start(LoadedModel(model=copy.deepcopy(base), tokenizer=None, stop_token_ids=[]), seed=0,
                     total_steps=args.steps, reference=False)
        algo = PolicyGradient()
        times: dict[str, list[float]] = {k: [] for k in backends}
        diffs = []
        for step in range(args.steps):
            metrics = {}
            for name, be in backends.items():  # alternating: A B A B
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                metrics[name] = be.train_step(batch, adv, algo, temperature=1.0, max_new_tokens=1024)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
            diffs.append({k: abs(metrics["none"][k] - metrics["fsdp2"][k]) / max(1.0, abs(metrics["none"][k]))
                          for k in ("loss", "grad_norm")})
        plain = dict(backends["none"].named_weights())
        gathered = dict(backends["fsdp2"].named_weights())  # the full state an engine receives
        weight_diff = max(float((plain[k].float().cpu() - gathered[k].float().cpu()).abs().max()) for k in plain)
        same_names = sorted(plain) == sorted(gathered)
        # The checkpoint round trip: the FSDP2 state (weights, sharded optimizer state, schedule)
        # into a fresh FSDP2 backend, then one more step on each: the same loss and weights.
        state = backends["fsdp2"].state_dict()
        resumed = create(TorchBackendConfig(**options, data_parallel="fsdp2"))
        resumed.start(LoadedModel(model=copy.deepcopy(base), tokenizer=None, stop_token_ids=[]), seed=0,
                      total_steps=args.steps + 1, reference=False)
        resumed.load_state_dict(state)
        after = [be.train_step(batch, adv, algo, temperature=1.0, max_new_tokens=1024)
                 for be in (backends["fsdp2"], resumed)]
        resume_weights = dict(resumed.named_weights())
        continued = dict(backends["fsdp2"].named_weights())
        resume_diff = max(float((continued[k] - resume_weights[k]).abs().max()) for k in continued)
        timed = slice(1, None) if args.steps > 1 else slice(None)  # the first step warms up
        out = {
            "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
            "group": group, "kind": args.kind, "steps": args.steps, "tokens": int(batch.n_tokens),
            "parameters": sum(p.numel() for p in base.parameters()),
            "loss_diff_max": max(d["loss"] for d in diffs),
            "grad_norm_diff_max": max(d["grad_norm"] for d in diffs),
            "weight_diff_max": weight_diff, "same_names": same_names,
            "resume_loss_diff": abs(after[0]["loss"] - after[1]["loss"]), "resume_weight_diff_max": resume_diff,
            "step_s": {k: statistics.median(v[timed]) for k, v in times.items()},
            "fsdp2_over_none": statistics.median(f / n for f, n in zip(times["fsdp2"][timed], times["none"][timed])),
        }
        out["ok"] = (same_names and out["loss_diff_max"] <= TOLERANCE and out["grad_norm_diff_max"] <= TOLERANCE
                     and weight_diff <= 10 * TOLERANCE and out["resume_loss_diff"] <= TOLERANCE
                     and resume_diff <= 10 * TOLERANCE)
        print(json.dumps(out, indent=1))
        return 0 if out["ok"] else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
