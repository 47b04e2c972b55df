"""Continuous batcher vs the embedded engine's offline generate: generated tokens/s on the
same prompts in the same run (tiny Qwen3 preset, CPU), alternating A B A B; JSON out.

The baseline is what a caller would do with every prompt in hand at once: one static
``generate`` call (chunks of max_batch_size rows, each waiting for its longest row). The
batcher takes the same prompts one ``submit`` at a time, as the Tinker server does.

    flock /tmp/cpu.lock .venv/bin/python benchmarks/continuous_batching.py [--requests 1024] [--max-tokens 16]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from skyrl_engines.continuous import ContinuousBatcher
from skyrl_host.plugins import build_host


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--preset", default="tiny")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    host = build_host()
    reg = host.get("models", "qwen")
    loaded = reg.create(reg.config(preset=args.preset)).load(alphabet="0123456789:abcdef", seed=0)
    ereg = host.get("engines", "embedded")
    engine = ereg.create(ereg.config())
    engine.start(loaded)
    rng = np.random.default_rng(0)
    vocab = engine.model.get_input_embeddings().num_embeddings
    prompts = [rng.integers(3, vocab, size=int(rng.integers(4, 13))).tolist() for _ in range(args.requests)]
    batcher = ContinuousBatcher(engine)
    sreg = host.get("samplers", "temperature")
    sampler = sreg.create(sreg.config(temperature=1.0))

    def offline() -> tuple[int, float]:
        t0 = time.perf_counter()
        batch = engine.generate(prompts, n=1, sampler=sampler, max_new_tokens=args.max_tokens, seed=1)
        return int(batch.response_lens.sum()), time.perf_counter() - t0

    def batched() -> tuple[int, float]:
        t0 = time.perf_counter()
        futures = [batcher.submit(p, temperature=1.0, seed=i, max_tokens=args.max_tokens) for i, p in enumerate(prompts)]
        n = sum(len(s["tokens"]) for f in futures for s in f.result()["sequences"])
        return n, time.perf_counter() - t0

    offline(), batched()  # warm up
    runs = []
    for _ in range(args.repeats):
        (ta, sa), (tb, sb) = offline(), batched()
        runs.append({"offline_tok_s": ta / sa, "batcher_tok_s": tb / sb, "ratio": (tb / sb) / (ta / sa)})
    batcher.close()
    ratios = [r["ratio"] for r in runs]
    print(json.dumps({"requests": args.requests, "max_tokens": args.max_tokens, "preset": args.preset,
                      "threads": args.threads, "max_batch_size": engine.config.max_batch_size,
                      "median_ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
                      "median_offline_tok_s": statistics.median(r["offline_tok_s"] for r in runs),
                      "median_batcher_tok_s": statistics.median(r["batcher_tok_s"] for r in runs),
                      "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
