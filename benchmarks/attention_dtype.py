"""Attention of a bf16 training forward on a CPU: bf16 kernels vs the same call in float32.

    python benchmarks/attention_dtype.py [--sequences 32] [--min-len 40] [--max-len 110]
                                         [--heads 9] [--kv-heads 3] [--head-dim 64] [--threads 2] [--rounds 7]

The torch backend's flat rows run attention per group of equal-length sequences
(``skyrl_backends._packing.segment_sdpa``). Under bf16 compute the query, key and value
arrive in bf16; this script times that function's forward + backward on one micro-batch
of RL-like sequences (lengths uniform in [min, max], SmolLM2-135M's heads by default) two
ways, alternating A B A B:

- ``bf16``: ``scaled_dot_product_attention`` on the bf16 tensors (what transformers' sdpa
  path does under bf16, and what ``segment_sdpa`` did before);
- ``float32``: ``segment_sdpa`` as it is now: on a CPU it computes in float32 and casts the
  output back to bf16.

Prints one JSON object: the medians of each side's time and of the per-round ratios, and
the largest difference of the outputs (the float32 side is the more exact).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "backends"))

from skyrl_backends.torch_backend import SEGMENTS_KEY, layout_flat, segment_sdpa  # noqa: E402


def bf16_kernels(query, key, value, segments):
    """segment_sdpa's grouping with the attention itself in the inputs' dtype."""
    gqa = query.shape[1] != key.shape[1]
    sizes = [count * length for _, count, length in segments.groups]
    q, k, v = (x[0].split(sizes, dim=1) for x in (query, key, value))
    outs = []
    for (_, count, length), *qkv in zip(segments.groups, q, k, v):
        qg, kg, vg = (x.unflatten(1, (count, length)).transpose(0, 1) for x in qkv)
        o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=length > 1, enable_gqa=gqa)
        outs.append(o.transpose(1, 2).reshape(count * length, o.shape[1], o.shape[-1]))
    return torch.cat(outs).unsqueeze(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=40)
    ap.add_argument("--max-len", type=int, default=110)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    lens = rng.integers(args.min_len, args.max_len + 1, size=args.sequences)
    _, _, segments = layout_flat(lens)
    n = int(lens.sum())
    gen = torch.Generator().manual_seed(0)

    def inputs():
        return [torch.randn(1, h, n, args.head_dim, generator=gen).to(torch.bfloat16).requires_grad_()
                for h in (args.heads, args.kv_heads, args.kv_heads)]

    sides = {
        "bf16": lambda q, k, v: bf16_kernels(q, k, v, segments),
        "float32": lambda q, k, v: segment_sdpa(None, q, k, v, None, **{SEGMENTS_KEY: segments})[0],
    }
    qkv = inputs()
    outs = {name: f(*qkv).detach().float() for name, f in sides.items()}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds + 1):  # the first round warms up
        for name, f in sides.items():
            q, k, v = inputs()
            t0 = time.perf_counter()
            o = f(q, k, v)
            o.float().square().sum().backward()
            times[name].append(time.perf_counter() - t0)
    ratios = [b / a for a, b in zip(times["float32"][1:], times["bf16"][1:])]
    print(json.dumps({
        "sequences": args.sequences, "tokens": n, "distinct_lengths": len(segments.groups),
        "heads": [args.heads, args.kv_heads, args.head_dim], "threads": args.threads,
        "median_s": {k: statistics.median(v[1:]) for k, v in times.items()},
        "float32_speedup_median": statistics.median(ratios),
        "float32_speedup_range": [min(ratios), max(ratios)],
        "max_abs_output_difference": float((outs["bf16"] - outs["float32"]).abs().max()),
        "torch": torch.__version__,
    }, indent=1))


if __name__ == "__main__":
    main()
