"""The `broadcast` transport's bucketed sends vs one broadcast per tensor, two processes over gloo.

    python benchmarks/broadcast.py [--size-mib 512] [--tensors 96] [--bucket-mib 64] [--repeats 3] [--quick]

Rank 0 (the trainer) holds a bf16 model state of ``--size-mib`` MiB in ``--tensors``
tensors of uneven sizes; rank 1 (an engine process) receives it into preallocated
tensors (a stand-in engine whose ``update_weights`` copies into them, as the embedded
engine does). Per round, interleaved:

- ``bucketed``: ``BroadcastSender.publish`` / ``BroadcastReceiver.sync``
  (``skyrl_weightsync.broadcast``): a header, then the bytes end to end in one reused
  flat bucket of ``--bucket-mib``;
- ``per_tensor``: the baseline, one ``dist.broadcast`` per tensor straight into the
  receiver's tensor (the simplest correct code).

Reported: seconds from the sender's start to the receiver's last byte applied (rank 1's
clock, both ranks started with a barrier), GB/s of model bytes, and the ratio
per_tensor / bucketed. Every round's received tensors are checked equal to the sent ones.
JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def shapes(total_bytes: int, n: int) -> list[int]:
    import numpy as np

    rng = np.random.default_rng(0)
    weights = rng.lognormal(0.0, 1.0, n)
    sizes = (weights / weights.sum() * (total_bytes // 2)).astype(int)
    sizes[sizes < 1] = 1
    return sizes.tolist()


def worker(rank: int, store: str, args: argparse.Namespace) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from skyrl_weightsync.broadcast import BroadcastReceiver, BroadcastSender

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    sizes = shapes(args.size_mib << 20, args.tensors)
    g = torch.Generator().manual_seed(1)
    sent = [torch.randn(n, generator=g).to(torch.bfloat16) for n in sizes]
    names = [f"t{i}" for i in range(len(sizes))]

    class Engine:
        def __init__(self):
            self.params = {name: torch.empty(n, dtype=torch.bfloat16) for name, n in zip(names, sizes)}
            self.weight_version = 0

        def update_weights(self, named, version):
            for name, t in named:
                self.params[name].copy_(t)
            self.weight_version = version

    engine = Engine()
    bucket = args.bucket_mib << 20
    sender = BroadcastSender(bucket_bytes=bucket) if rank == 0 else None
    receiver = BroadcastReceiver(bucket_bytes=bucket) if rank == 1 else None
    times: dict[str, list[float]] = {"bucketed": [], "per_tensor": []}
    ok = True
    version = 0
    for r in range(args.repeats + 1):  # round 0 warms up
        order = ["bucketed", "per_tensor"] if r % 2 == 0 else ["per_tensor", "bucketed"]
        for method in order:
            version += 1
            dist.barrier()
            t0 = time.perf_counter()
            if method == "bucketed":
                if rank == 0:
                    sender.publish(version, zip(names, sent))
                else:
                    receiver.sync(engine)
            else:
                for i, t in enumerate(sent if rank == 0 else [engine.params[n] for n in names]):
                    dist.broadcast(t, src=0)
                if rank == 1:
                    engine.weight_version = version
            elapsed = time.perf_counter() - t0
            if rank == 1:
                if r > 0:
                    times[method].append(elapsed)
                if r == 0 or r == args.repeats:
                    ok &= all(torch.equal(engine.params[n], s) for n, s in zip(names, sent))
                    for p in engine.params.values():
                        p.zero_()
    if rank == 1:
        total = sum(sizes) * 2
        med = {m: statistics.median(v) for m, v in times.items()}
        print(json.dumps({
            "bytes": total, "tensors": len(sizes), "bucket_bytes": bucket, "repeats": args.repeats,
            "seconds_median": med, "seconds_all": times,
            "gb_per_s": {m: total / s / 1e9 for m, s in med.items()},
            "ratio_per_tensor_over_bucketed": statistics.median(
                [p / b for p, b in zip(times["per_tensor"], times["bucketed"])]),
            "collectives": {"bucketed": -(-total // bucket), "per_tensor": len(sizes)},
            "received_equal": ok,
        }))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--tensors", type=int, default=96)
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="8 MiB, 1 round")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--store", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.size_mib, args.repeats, args.bucket_mib = 8, 1, 1
    if args.rank is not None:
        worker(args.rank, args.store, args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        base = [sys.executable, __file__, "--size-mib", str(args.size_mib), "--tensors", str(args.tensors),
                "--bucket-mib", str(args.bucket_mib), "--repeats", str(args.repeats), "--store", store]
        procs = [subprocess.Popen(base + ["--rank", str(r)], stdout=subprocess.PIPE, text=True) for r in (0, 1)]
        outs = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"a rank failed: {[p.returncode for p in procs]}")
        print(outs[1].strip())


if __name__ == "__main__":
    main()
