"""Claim: an evaluation ([eval], skyrl eval) costs what generating its samples costs: its
decoding, scoring and metrics add no per-sample overhead worth measuring (target: within
10% of the engine's plain generation of the same prompts).

SmolLM2-135M-Instruct (the real pretrained model ``skyrl models smollm2`` makes) in the
embedded engine, ``--prompts`` held-out questions of examples/real_model.toml's
evaluation (``chat_arithmetic`` additions, its seed), ``--n`` samples each, ``--max-new``
tokens. Alternates, after a warm-up of each, A: ``engine.generate`` of the encoded prompts
in the evaluation's calls (``batch_prompts`` per call, the same seeds), and B: the whole
``Evaluation`` (the same generation, then decoding, the reward, answer extraction,
pass@k / maj@k / mean@k); prints JSON with the medians and the median of the per-round
ratios B / A.

    .venv/bin/python benchmarks/eval_throughput.py --prompts 64 --n 8 --max-new 48 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from skyrl_datasets.chat_arithmetic import ChatArithmetic, ChatArithmeticConfig
    from skyrl_engines.embedded import Embedded, EmbeddedConfig
    from skyrl_host.jobs.evaluation import EVAL_SEED_OFFSET, Evaluation
    from skyrl_host.jobs.rl_sources import Prompts
    from skyrl_host.sections import EvalSection
    from skyrl_models.gguf import smollm2_folder
    from skyrl_models.hf import HfConfig, make_family
    from skyrl_samplers.temperature import TemperatureConfig, build_sampler

    loaded = make_family(HfConfig(path=str(smollm2_folder()))).load(alphabet=None, seed=0)
    engine = Embedded(EmbeddedConfig(threads=args.threads, dtype=args.dtype))
    sampler = build_sampler(TemperatureConfig(temperature=1.0))
    engine.start(loaded, precision=None, sampler=sampler)
    options = EvalSection(n_samples=args.n, k=sorted({1, args.n}), prompts=args.prompts)
    dataset = ChatArithmetic(ChatArithmeticConfig(tasks=["add"], max_value=9), seed=1 + EVAL_SEED_OFFSET)
    evaluation = Evaluation(options, dataset, engine=engine, sampler=sampler, prompts=Prompts(loaded.tokenizer),
                            stop_token_ids=loaded.stop_token_ids, max_new_tokens=args.max_new, seed=1,
                            show_progress=False)

    def generate_only() -> float:
        t0 = time.perf_counter()
        for c, start in enumerate(range(0, len(evaluation.tasks), options.batch_prompts)):
            engine.generate(evaluation.encoded[start : start + options.batch_prompts], n=args.n, sampler=sampler,
                            max_new_tokens=args.max_new, seed=evaluation._seed(c))
        return time.perf_counter() - t0

    def evaluate() -> float:
        t0 = time.perf_counter()
        evaluation("bench")
        return time.perf_counter() - t0

    generate_only(), evaluate()  # warm-up
    plain, full = [], []
    for _ in range(args.rounds):
        plain.append(generate_only())
        full.append(evaluate())
    ratios = [b / a for a, b in zip(plain, full)]
    print(json.dumps({
        "claim": "an evaluation costs its generation: ratio of evaluation time to plain generation time",
        "model": "SmolLM2-135M-Instruct (embedded engine, " + args.dtype + ")",
        "prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new, "threads": args.threads,
        "generate_s_median": round(statistics.median(plain), 3), "evaluate_s_median": round(statistics.median(full), 3),
        "ratio_median": round(statistics.median(ratios), 4), "ratios": [round(r, 4) for r in ratios],
        "pass_at_1": evaluation.last["overall"]["pass_at_1"],
    }, indent=2))


if __name__ == "__main__":
    main()
