"""Claim (on paper, where this machine cannot go): the bytes each weight transport moves per
sync for a full-size model on a multi-node layout, and the time that takes at stated link
speeds, each term tied to a number measured here.

The model's parameters come from its full-size config (``skyrl models show NAME``: the
config built on the meta device, no weights), split into the linear weights a quantizing
precision ships in fp8 (1 byte, plus one float32 scale per 128 x 128 block) and the rest
(bf16). The layout is SkyRL's Kimi K2 run by default: 32 trainer and 16 engine nodes of 8
GPUs, an engine replica of 16 GPUs (fp8 Kimi K2, ~1.03 TB, fits 16 H100s), a 400 Gb/s NIC
per GPU. Prints JSON; nothing runs on a GPU.

    .venv/bin/python benchmarks/sync_on_paper.py [--model kimi-k2] [--nic-gbps 400]
"""

from __future__ import annotations

import argparse
import json

# Measured on this project's machines (docs/benchmarks.md, docs/weightsync.md):
DELTA_CHANGED = {"median": 0.0102, "low": 0.0089, "high": 0.0187}  # of the bf16 bytes, real RL run, benchmarks/weight_sync.py
DELTA_ENCODE_GBPS = 1.35  # one process's XOR + zstd encode rate on this CPU (benchmarks/weight_sync.py)
NIXL_OF_RAW = (0.94, 1.08)  # our sharded NIXL read against a raw NIXL READ of the same bytes
SKYRL_SECONDS = 7.53  # SkyRL's Kimi K2 sharded transfer on 32 + 16 nodes, as issue 39 quotes it


def parameters(name: str) -> dict[str, int]:
    """Parameter counts of the full-size model: ``linear`` (2-D weights of the decoder's
    linear layers, what fp8 quantizes), ``other`` (embeddings, head, norms, router
    gates), ``experts`` (the routed experts among ``linear``) and ``attention`` (the
    attention projections among ``linear``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from skyrl_models.commands import all_presets, hf_config

    preset = {p["name"]: p for p in all_presets()}[name]
    config = hf_config(preset["family"], name, preset["weights"], "0123456789")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out = {"linear": 0, "other": 0, "experts": 0, "attention": 0, "attention_shapes": []}
    for pname, p in model.named_parameters():
        # 2-D projection weights, and fused experts ([E, out, in]); not norms or router gates.
        linear = (".layers." in pname and p.dim() >= 2 and ".gate.weight" not in pname
                  and (pname.endswith(".weight") or ".experts." in pname))
        out["linear" if linear else "other"] += p.numel()
        if linear and ".experts." in pname:
            out["experts"] += p.numel()
        if linear and ".self_attn." in pname:
            out["attention"] += p.numel()
            out["attention_shapes"].append(tuple(p.shape))
    out["total"] = out["linear"] + out["other"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="kimi-k2")
    ap.add_argument("--trainer-nodes", type=int, default=32)
    ap.add_argument("--engine-nodes", type=int, default=16)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--replica-gpus", type=int, default=16, help="GPUs of one engine replica")
    ap.add_argument("--nic-gbps", type=float, default=400.0, help="each GPU's NIC, gigabits per second")
    ap.add_argument("--lora-rank", type=int, default=32)
    args = ap.parse_args()
    n = parameters(args.model)
    gb = 1e9
    nic = args.nic_gbps / 8 * gb  # bytes per second per GPU
    trainer_gpus, engine_gpus = args.trainer_nodes * args.gpus_per_node, args.engine_nodes * args.gpus_per_node
    replicas = engine_gpus // args.replica_gpus
    bf16 = 2 * n["total"]
    fp8 = n["linear"] * (1 + 4 / (128 * 128)) + 2 * n["other"]
    rows = {}
    # broadcast: trainer rank 0 sends every bucket through one NCCL broadcast to all engine
    # workers; a pipelined broadcast carries the model once over each link, so rank 0's NIC
    # bounds it (sync_collectives: one collective per 64 MiB bucket).
    for wire, size in (("bf16", bf16), ("fp8", fp8)):
        rows[f"broadcast_{wire}"] = {"bytes_per_sync": size, "bytes_on_busiest_link": size,
                                     "seconds": size / nic, "bound": "trainer rank 0's NIC"}
    # nixl: every engine GPU reads its shard of its replica's copy from the trainer ranks that
    # hold it, all at once; our reads reach 94-108% of a raw NIXL READ of the same bytes.
    per_gpu = fp8 / args.replica_gpus
    rows["nixl_fp8"] = {"bytes_per_sync": fp8 * replicas, "bytes_on_busiest_link": per_gpu,
                        "seconds": per_gpu / nic, "seconds_range_measured_efficiency":
                        [per_gpu / (nic * NIXL_OF_RAW[1]), per_gpu / (nic * NIXL_OF_RAW[0])],
                        "bound": "each engine GPU's NIC (the trainer side has 2x the NICs)"}
    # delta: each trainer rank encodes its shard (XOR against the last version, zstd) and writes
    # it once; every replica reads the whole delta, each GPU its shard. The encode dominates
    # at this CPU's rate; on the trainer's GPUs it was not measured.
    for level, share in DELTA_CHANGED.items():
        size = bf16 * share
        encode = bf16 / trainer_gpus / (DELTA_ENCODE_GBPS * gb)
        read = size / args.replica_gpus / nic
        rows[f"delta_{level}"] = {"bytes_per_sync": size * (1 + replicas), "bytes_written": size,
                                  "bytes_on_busiest_link": size / args.replica_gpus, "encode_seconds": encode,
                                  "read_seconds": read, "seconds": encode + read,
                                  "bound": "the encode of each trainer rank's bf16 shard (CPU rate measured here)"}
    # lora: rank-r adapters on the attention projections only, bf16, to every replica.
    lora = sum(2 * args.lora_rank * (a + b) for a, b in n["attention_shapes"])
    rows[f"lora_r{args.lora_rank}_attention"] = {"bytes_per_sync": lora * replicas, "bytes_on_busiest_link": lora,
                                                 "seconds": lora / nic, "bound": "rank 0's NIC (one copy each)"}
    print(json.dumps({
        "claim": "bytes per weight sync and the time at the stated link speed, per transport, on paper",
        "model": args.model, "parameters": {k: v for k, v in n.items() if k != "attention_shapes"},
        "layout": {"trainer_gpus": trainer_gpus, "engine_gpus": engine_gpus, "replicas": replicas,
                   "replica_gpus": args.replica_gpus, "nic_gbps_per_gpu": args.nic_gbps},
        "bytes": {"bf16": bf16, "fp8": fp8}, "transports": rows,
        "skyrl_reported_seconds": SKYRL_SECONDS,
    }, indent=2, default=float))


if __name__ == "__main__":
    main()
