"""The torch backend's train step vs a padded Hugging Face forward + backward, on a real-shaped checkpoint.

    python benchmarks/train_step.py [--sequences 12] [--repeats 3] [--threads 2]
                                    [--micro-batch-tokens 4096] [--checkpoint DIR] [--flat-rows MODE]
    python benchmarks/train_step.py --kind tiny --sequences 64 --threads 1 --repeats 15

The model: ``skyrl_models.checkpoints.build_checkpoint(DIR, "qwen3")``: Qwen3-0.6B's
widths (hidden 1024, 16 heads x 128, 8 KV heads, FFN 3072, tied embeddings, a byte-level
BPE vocabulary of 8,192) with 2 layers, loaded in float32 with sdpa attention (built into
a temporary folder unless ``--checkpoint`` names one already built).

The batch is RL-shaped: ``--sequences`` sequences, prompts of 128-512 tokens (uniform),
responses of 16-1024 tokens (log-normal around 300, capped at 1024 as a length limit
would: a long tail, some at the cap), the loss on the response tokens, one advantage per
sequence. ``--kind tiny``: the quickstart's 165k-parameter Qwen3 (``[model] preset = "tiny"``)
on sequences like the quickstart's (prompts of 5-7 tokens, responses of 2-16), where the
step costs tens of milliseconds and layout overheads show.

Two run kinds, alternating A B A B (one warm-up round first, not timed), each training its
own copy of the same initial model with AdamW (lr 1e-6), clipping at 1.0, float32, the same
thread count and the same micro-batch token budget:

- ``ours``: ``TorchBackend.train_step`` with its defaults (the code the rl job runs:
  ``skyrl_backends._packing`` / ``_packed_lm`` / ``_train_step``), micro-batches of whole
  sequences up to ``--micro-batch-tokens`` real tokens;
- ``padded``: what a user writes with Hugging Face: micro-batches of sequences in the same
  order, right-padded to the longest (``count x longest <= --micro-batch-tokens``, the same
  activation budget), ``model(input_ids, attention_mask).logits``, log-softmax gathered at
  the response tokens, the same loss, backward; then clipping and the AdamW step.

The loss is ``-sum(A * logprob) / loss_tokens`` (the policy gradient at ratio 1), so both
sides must report the same loss and gradient norm on the warm-up round (same weights):
the script asserts it. Tokens counted: real tokens (no padding). Peak memory: the growth
of the process's peak resident set during one step (Linux: ``/proc/self/clear_refs``).
Prints one JSON object: medians of tokens/s and of the per-round ratios ``ours / padded``.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from skyrl_backends.torch import TorchBackendConfig, create
from skyrl_host.interfaces import LoadedModel, LossInputs
from skyrl_host.rollout import RolloutBatch

LR = 1e-6


def rl_batch(n: int, vocab: int, seed: int = 0, short: bool = False) -> tuple[RolloutBatch, np.ndarray]:
    rng = np.random.default_rng(seed)
    prompts, responses, lps = [], [], []
    for _ in range(n):
        if short:  # the quickstart's: a 3-5 digit prompt with its ":" and BOS, up to 16 new tokens
            p, r = int(rng.integers(5, 8)), int(rng.integers(2, 17))
        else:
            p = int(rng.integers(128, 513))
            r = int(min(1024, max(16, rng.lognormal(np.log(300.0), 0.8))))
        prompts.append(rng.integers(3, vocab, p).tolist())
        responses.append(rng.integers(3, vocab, r).tolist())
        lps.append((-3.0 + 0.1 * rng.standard_normal(r)).tolist())
    batch = RolloutBatch.from_sequences(prompts, responses, lps, group_ids=[i // 4 for i in range(n)])
    per_seq = rng.standard_normal(n).astype(np.float32)
    adv = (np.repeat(per_seq, batch.seq_lens) * batch.loss_mask).astype(np.float32)
    return batch, adv


class PolicyGradient:
    """loss = -sum(A * logprob) / global_tokens: the same loss the padded side computes."""

    needs_reference = False

    def loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict]:
        return -(inputs.advantages * inputs.logprobs * inputs.mask).sum() / inputs.global_tokens, {}


class Padded:
    """The baseline: right-padded micro-batches through the plain Hugging Face forward."""

    def __init__(self, model, batch: RolloutBatch, adv: np.ndarray, budget: int):
        self.model = model
        self.model.train()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        lens, cu = batch.seq_lens, batch.cu_seqlens
        trains = (batch.loss_mask != 0) & (batch.positions() > 0)
        self.n_loss = int(trains.sum())
        groups, cur, longest = [], [], 0
        for s in range(batch.n_sequences):  # in order, while count x longest fits the budget
            L = max(longest, int(lens[s]))
            if cur and (len(cur) + 1) * L > budget:
                groups.append(cur)
                cur, L = [], int(lens[s])
            cur.append(s)
            longest = L
        groups.append(cur)
        self.micros = []
        for g in groups:
            L = int(lens[g].max())
            ids = torch.zeros(len(g), L, dtype=torch.long)
            att = torch.zeros(len(g), L, dtype=torch.long)
            rows, cols, advs = [], [], []
            for i, s in enumerate(g):
                a, b = int(cu[s]), int(cu[s + 1])
                ids[i, : b - a] = torch.as_tensor(batch.tokens[a:b].astype(np.int64))
                att[i, : b - a] = 1
                t = np.flatnonzero(trains[a:b])
                rows += [i] * len(t)
                cols += t.tolist()
                advs.append(adv[a:b][t])
            rows_t, cols_t = torch.tensor(rows), torch.tensor(cols)
            self.micros.append((ids, att, rows_t, cols_t, ids[rows_t, cols_t], torch.as_tensor(np.concatenate(advs))))

    def step(self) -> dict:
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for ids, att, rows, cols, targets, adv in self.micros:
            logits = self.model(input_ids=ids, attention_mask=att).logits
            lp = torch.log_softmax(logits[rows, cols - 1].float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)
            loss = -(adv * lp).sum() / self.n_loss
            loss.backward()
            total += float(loss.detach())
            del logits, lp, loss
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": total, "grad_norm": float(norm)}


def _peak_rss_reset() -> int | None:
    """Reset the peak resident set to the current one (after returning freed memory to the
    OS); the current resident set in bytes, or None where Linux's interface is missing."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmRSS") * 1024
    except OSError:
        return None


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise OSError(key)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sequences", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--kind", default="qwen3", choices=("qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3", "tiny"),
                    help="the real-shaped checkpoint's kind (build_checkpoint): dense Qwen3 or a MoE one; or 'tiny': "
                    "the quickstart's 165k-parameter Qwen3 preset on quickstart-shaped sequences (7-23 tokens; "
                    "use --sequences 64 --threads 1, the async benchmark's batch and threads)")
    ap.add_argument("--flat-rows", default="auto", choices=("auto", "long", "always", "never"),
                    help="ours: the torch backend's [backend] flat_rows")
    ap.add_argument("--checkpoint", default=None, help="a folder build_checkpoint(..., KIND) wrote (default: build one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    tmp = None
    path = args.checkpoint
    if args.kind == "tiny":
        from skyrl_models.qwen import QwenConfig, make_family

        base = make_family(QwenConfig(preset="tiny")).load(alphabet="0123456789", seed=0).model
    elif path is None or not os.path.isdir(path):
        from skyrl_models.checkpoints import build_checkpoint

        if path is None:
            tmp = tempfile.TemporaryDirectory(prefix="skyrl-train-step-")
            path = tmp.name
        build_checkpoint(path, args.kind)
    if args.kind != "tiny":
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    vocab = base.config.vocab_size
    batch, adv = rl_batch(args.sequences, vocab, short=args.kind == "tiny")

    be = create(TorchBackendConfig(lr=LR, micro_batch_tokens=args.micro_batch_tokens, device="cpu",
                                   flat_rows=args.flat_rows))
    be.start(LoadedModel(model=copy.deepcopy(base), tokenizer=None, stop_token_ids=[base.config.eos_token_id]),
             seed=0, total_steps=100, reference=False)
    algo = PolicyGradient()
    padded = Padded(copy.deepcopy(base), batch, adv, args.micro_batch_tokens)
    del base
    runs = {
        "ours": lambda: be.train_step(batch, adv, algo, temperature=1.0, max_new_tokens=1024),
        "padded": padded.step,
    }

    rates: dict[str, list[float]] = {k: [] for k in runs}
    peaks: dict[str, list[float]] = {k: [] for k in runs}
    first: dict[str, dict] = {}
    for round_ in range(args.repeats + 1):
        for name, step in runs.items():
            rss0 = _peak_rss_reset()
            t0 = time.perf_counter()
            metrics = step()
            dt = time.perf_counter() - t0
            if rss0 is not None:
                peaks[name].append((_status_kib("VmHWM") * 1024 - rss0) / 2**20)
            if round_ == 0:  # the warm-up round: same weights on both sides
                first[name] = {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"])}
            else:
                rates[name].append(batch.n_tokens / dt)

    a, b = first["ours"], first["padded"]
    same_loss = abs(a["loss"] - b["loss"]) <= 1e-4 * max(1.0, abs(b["loss"]))
    same_grad = abs(a["grad_norm"] - b["grad_norm"]) <= 1e-3 * b["grad_norm"]
    padded_tokens = sum(int(ids.numel()) for ids, *_ in padded.micros)
    out = {
        "config": {
            "model": (f"the quickstart's tiny Qwen3 (vocab {vocab}), float32, sdpa" if args.kind == "tiny"
                      else f"{args.kind} real-shaped (2 layers, vocab {vocab}), float32, sdpa"),
            "flat_rows": args.flat_rows, "flat_row_mode": str(be._segment_attention),
            "flat_micro_batches": sum("skyrl_segments" in mb.model_kwargs for mini in be._plan(batch, adv) for mb in mini),
            "sequences": args.sequences, "tokens": batch.n_tokens, "loss_tokens": padded.n_loss,
            "seq_len_range": [int(batch.seq_lens.min()), int(batch.seq_lens.max())],
            "padded_tokens": padded_tokens, "padded_micro_batches": len(padded.micros),
            "micro_batch_tokens": args.micro_batch_tokens, "threads": args.threads, "repeats": args.repeats,
        },
        "tokens_per_s": {k: round(statistics.median(v)) for k, v in rates.items()},
        "ratio_ours_vs_padded": round(statistics.median(x / y for x, y in zip(rates["ours"], rates["padded"])), 3),
        "ratio_range": [round(min(x / y for x, y in zip(rates["ours"], rates["padded"])), 3),
                        round(max(x / y for x, y in zip(rates["ours"], rates["padded"])), 3)],
        "peak_memory_mib": {k: round(statistics.median(v)) for k, v in peaks.items() if v},
        "warmup_round": first,
        "same_loss_and_grad_norm": same_loss and same_grad,
    }
    print(json.dumps(out, indent=2))
    if tmp is not None:
        tmp.cleanup()
    if not (same_loss and same_grad):
        print("error: the two sides disagree on the warm-up round's loss or gradient norm", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
