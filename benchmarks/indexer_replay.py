"""The engine/trainer logprob gap on the sparse-attention indexer models (GLM-5, DeepSeek-V3.2),
without replay, with routing replay alone (what ``r3`` did before it replayed the indexer)
and with ``r3`` (routes + the indexer's key picks).

    python benchmarks/indexer_replay.py [--seeds 10] [--weight-seeds 2] [--threads 1]
                                        [--presets glm:tiny-glm-moe-dsa kimi:tiny-deepseek-v3.2]

For every preset, weight seed and sampling seed: a fresh model (float32) and the embedded
engine (float32, sharing its weights, ``return_routed_experts = true``) generate 4 random
prompts of 4-15 tokens (alphabet of 13 symbols) x 4 samples x 12 new tokens at
temperature 1; the torch backend then runs one GRPO step on that batch and reports the
gap |trainer logprob - engine logprob| over the generated tokens before the update
(``logprob_diff_mean`` / ``_max``). The three modes run on the same batch, one after the
other for each seed (A B C A B C ...). ``routes_only`` binds r3 and then removes its
indexer hooks. Prints one JSON object: per preset and mode the median and worst of the
runs' mean and max gaps, and the median over runs of none / r3 (max gap).
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

ALPHABET = "0123456789+=:"
MODES = ("none", "routes_only", "r3")


def one_run(host, family: str, preset: str, mode: str, seed: int, weight_seed: int) -> tuple[float, float]:
    from skyrl_engines.embedded import Embedded, EmbeddedConfig
    from skyrl_samplers.processing import TruncatedSampler

    reg = host.registry.get("models", family)
    loaded = reg.create(reg.config(preset=preset)).load(alphabet=ALPHABET, seed=weight_seed)
    engine = Embedded(EmbeddedConfig(return_routed_experts=True))
    engine.start(loaded)
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, len(ALPHABET), int(rng.integers(4, 16)))] for _ in range(4)]
    batch = engine.generate(prompts, n=4, sampler=TruncatedSampler(temperature=1.0), max_new_tokens=12, seed=seed)
    breg = host.registry.get("backends", "torch")
    backend = breg.create(breg.config(lr=1e-3))
    rreg = host.registry.get("replay_strategies", "r3")  # the r3 strategy as a job gets it
    replay = [] if mode == "none" else [rreg.create(rreg.config() if rreg.config else None)]
    backend.start(loaded, seed=0, total_steps=2, reference=False, replay=replay)
    if mode == "routes_only":
        replay[0].indexers.remove()
        replay[0].indexers = None
    areg = host.registry.get("algorithms", "grpo")
    algo = areg.create(areg.config())
    batch.rewards = np.random.default_rng(0).random(batch.n_sequences).astype(np.float32)
    adv = np.asarray(algo.advantages(batch, batch.rewards), dtype=np.float32)
    metrics = backend.train_step(batch, adv, algo, temperature=1.0, max_new_tokens=12)
    return float(metrics["logprob_diff_mean"]), float(metrics["logprob_diff_max"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--weight-seeds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--presets", nargs="+", default=["glm:tiny-glm-moe-dsa", "kimi:tiny-deepseek-v3.2"])
    args = ap.parse_args()

    import torch

    from skyrl_host.testing import build_host

    torch.set_num_threads(args.threads)
    host = build_host()
    out: dict[str, dict] = {}
    for spec in args.presets:
        family, preset = spec.split(":", 1)
        runs: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        for w in range(args.weight_seeds):
            for s in range(args.seeds):
                for mode in MODES:
                    runs[mode].append(one_run(host, family, preset, mode, s, w))
        entry: dict[str, dict] = {}
        for mode in MODES:
            means, maxes = [r[0] for r in runs[mode]], [r[1] for r in runs[mode]]
            entry[mode] = {
                "runs": len(means),
                "mean_gap_median": statistics.median(means), "mean_gap_worst": max(means),
                "max_gap_median": statistics.median(maxes), "max_gap_worst": max(maxes),
            }
        ratios = [a[1] / max(b[1], 1e-12) for a, b in zip(runs["none"], runs["r3"])]
        entry["none_over_r3_max_gap_median"] = statistics.median(ratios)
        out[preset] = entry
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
