"""Tokens/s of the embedded engine vs transformers' ``model.generate``, on a tiny Qwen3.

    python benchmarks/engine_generate.py [--prompts 128] [--n 8] [--max-new 32] [--repeats 5] [--threads 2]

Runs, interleaved A B C A B C ... (``--repeats`` rounds, after one warm-up round):

- ``engine``: ``EmbeddedEngine.generate(prompts, n=N, ...)`` with its default
  ``max_batch_size`` (256), and ``engine_one_batch`` with ``max_batch_size`` = all
  sequences;
- ``hf_generate``: the baseline, one ``model.generate`` call over the same prompts
  (left-padded, with an attention mask), ``do_sample=True``,
  ``num_return_sequences=N``, the same ``max_new_tokens`` and stop token;

and, once per round, ``naive``: ``model.generate`` for a single sequence at a time,
for a few prompts (what an engine without batching does).

Tokens counted: generated tokens up to and including the stop token. Prints one
JSON object: medians of tokens/s per run kind, and the medians of the per-round
ratios engine / hf_generate and engine / naive.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from skyrl_engines.embedded import Embedded, EmbeddedConfig
from skyrl_host.interfaces import LoadedModel, SampleOutput

STOP = 2
PAD = 0


class TemperatureSampler:
    def __init__(self, temperature: float = 1.0):
        self.temperature = temperature

    def sample(self, logits: torch.Tensor, generator: torch.Generator) -> SampleOutput:
        logprobs = torch.log_softmax(logits / self.temperature, -1)
        ids = torch.multinomial(logprobs.exp(), 1, generator=generator)[:, 0]
        return SampleOutput(ids, logprobs.gather(1, ids[:, None])[:, 0])


def tiny_model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        vocab_size=32,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        eos_token_id=STOP,
    )
    return Qwen3ForCausalLM(config).eval()


def make_prompts(count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(4, 13, (count,), generator=g).tolist()
    return [torch.randint(3, 32, (n,), generator=g).tolist() for n in lens]


def generated_tokens(rows: torch.Tensor) -> int:
    """Tokens up to and including the first stop token of each row (all of them without one)."""
    is_stop = rows == STOP
    first = torch.where(is_stop.any(1), is_stop.int().argmax(1) + 1, torch.full((rows.shape[0],), rows.shape[1]))
    return int(first.sum())


def run_engine(engine, prompts, n, max_new, seed) -> tuple[int, float]:
    t0 = time.perf_counter()
    batch = engine.generate(prompts, n=n, sampler=TemperatureSampler(), max_new_tokens=max_new, seed=seed)
    return int(batch.response_lens.sum()), time.perf_counter() - t0


def run_hf(model, prompts, n, max_new, seed) -> tuple[int, float]:
    t0 = time.perf_counter()
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=None,
            top_p=None,
            num_return_sequences=n,
            max_new_tokens=max_new,
            eos_token_id=STOP,
            pad_token_id=PAD,
        )
    return generated_tokens(out[:, width:]), time.perf_counter() - t0


def run_naive(model, prompts, max_new, seed) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = 0
    torch.manual_seed(seed)
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(
                input_ids=torch.tensor([p]),
                do_sample=True,
                temperature=1.0,
                top_k=None,
                top_p=None,
                max_new_tokens=max_new,
                eos_token_id=STOP,
                pad_token_id=PAD,
            )
            tokens += generated_tokens(out[:, len(p) :])
    return tokens, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--naive-prompts", type=int, default=8)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    model = tiny_model()
    prompts = make_prompts(args.prompts, seed=0)
    loaded = LoadedModel(model=model, tokenizer=None, stop_token_ids=[STOP])
    engine = Embedded(EmbeddedConfig(threads=args.threads))
    engine.start(loaded)
    engine_one = Embedded(EmbeddedConfig(threads=args.threads, max_batch_size=args.prompts * args.n))
    engine_one.start(loaded)

    runs = {
        "engine": lambda s: run_engine(engine, prompts, args.n, args.max_new, s),
        "engine_one_batch": lambda s: run_engine(engine_one, prompts, args.n, args.max_new, s),
        "hf_generate": lambda s: run_hf(model, prompts, args.n, args.max_new, s),
        "naive": lambda s: run_naive(model, prompts[: args.naive_prompts], args.max_new, s),
    }
    for fn in runs.values():  # warm-up
        fn(12345)
    rates: dict[str, list[float]] = {k: [] for k in runs}
    tokens: dict[str, list[int]] = {k: [] for k in runs}
    for r in range(args.repeats):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            tok, sec = runs[name](r)
            rates[name].append(tok / sec)
            tokens[name].append(tok)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(rates[a], rates[b]))

    print(
        json.dumps(
            {
                "benchmark": "engine_generate",
                "model": "tiny qwen3 (hidden 64, 2 layers, 4 heads x 32, vocab 32), float32",
                "prompts": args.prompts,
                "n": args.n,
                "max_new_tokens": args.max_new,
                "threads": args.threads,
                "repeats": args.repeats,
                "naive_prompts": args.naive_prompts,
                "tokens_per_s_median": {k: round(statistics.median(v), 1) for k, v in rates.items()},
                "tokens_per_run_median": {k: statistics.median(v) for k, v in tokens.items()},
                "ratio_engine_vs_hf_generate": round(ratio("engine", "hf_generate"), 3),
                "ratio_engine_one_batch_vs_hf_generate": round(ratio("engine_one_batch", "hf_generate"), 3),
                "ratio_engine_vs_naive": round(ratio("engine", "naive"), 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
