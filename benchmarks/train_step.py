"""Train-step tokens/s of the torch backend's packing, on a tiny Qwen3 and an RL-like batch.

    python benchmarks/train_step.py [--sequences 512] [--repeats 7] [--threads 2]
                                    [--micro-batch-tokens 4096] [--pack-lengths 256]

The batch is like the RL quickstart's: ``--sequences`` sequences of 12-22 tokens, the
loss on the last 6-8 tokens of each (the response), one advantage per sequence. The
model is the quickstart's tiny Qwen3 (hidden 64, 2 layers, 4 heads x head_dim 32,
2 KV heads, FFN 256, vocab 20, tied embeddings, sdpa attention), float32.

Runs, interleaved (after one warm-up round), ``--repeats`` rounds of one step each:

- ``packed_<P>``: ``TorchBackend.train_step`` with ``pack_length = P`` (default 256:
  the backend's default), i.e. each micro-batch laid out in rows of at most P tokens;
- ``one_row``: ``pack_length = micro_batch_tokens``: each micro-batch in one row
  (the backend's behaviour before rows: attention dense over the whole row);
- ``padded``: the baseline, a padded ``[B, L]`` batch with an attention mask through
  the plain Hugging Face forward (all logits), then the same loss (token-mean policy
  gradient), backward, clipping and AdamW step.

Each run kind trains its own copy of the same initial model. Tokens counted: real
tokens (no padding). Prints one JSON object: the medians of tokens/s per run kind
and the medians of the per-round ratios against ``one_row`` and ``padded``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from skyrl_backends.torch import TorchBackendConfig, create
from skyrl_host.interfaces import LoadedModel, LossInputs
from skyrl_host.rollout import RolloutBatch

VOCAB = 20
LR = 5e-4


def tiny_model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=256, vocab_size=VOCAB, tie_word_embeddings=True, attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(config)


def rl_batch(n: int, seed: int = 0) -> tuple[RolloutBatch, np.ndarray]:
    rng = np.random.default_rng(seed)
    prompts, responses, lps = [], [], []
    for _ in range(n):
        total = int(rng.integers(12, 23))
        resp = int(rng.integers(6, 9))
        prompts.append(rng.integers(1, VOCAB, total - resp).tolist())
        responses.append(rng.integers(1, VOCAB, resp).tolist())
        lps.append((-3.0 + 0.1 * rng.standard_normal(resp)).tolist())
    batch = RolloutBatch.from_sequences(prompts, responses, lps, group_ids=[i // 16 for i in range(n)])
    per_seq = rng.standard_normal(n).astype(np.float32)
    adv = (np.repeat(per_seq, batch.seq_lens) * batch.loss_mask).astype(np.float32)
    return batch, adv


class TokenMean:
    """loss = -sum(A * exp(logp - logp_old)) / global_tokens."""

    needs_reference = False

    def loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict]:
        ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
        return -(inputs.advantages * ratio * inputs.mask).sum() / inputs.global_tokens, {}


class Padded:
    """The baseline: one padded [B, L] batch through the plain HF forward."""

    def __init__(self, model: Qwen3ForCausalLM, batch: RolloutBatch, adv: np.ndarray):
        self.model = model
        self.model.train()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        lens = batch.seq_lens
        S, L = batch.n_sequences, int(lens.max())
        self.ids = torch.zeros(S, L, dtype=torch.long)
        self.att = torch.zeros(S, L, dtype=torch.long)
        trains = np.zeros((S, L), dtype=bool)
        adv_pad = np.zeros((S, L), dtype=np.float32)
        for i in range(S):
            a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
            self.ids[i, : b - a] = torch.as_tensor(batch.tokens[a:b].astype(np.int64))
            self.att[i, : b - a] = 1
            trains[i, 1 : b - a] = batch.loss_mask[a + 1 : b] != 0
            adv_pad[i, : b - a] = adv[a:b]
        self.pos = torch.arange(L)[None].expand(S, L)
        rows, cols = np.nonzero(trains)
        self.rows, self.cols = torch.as_tensor(rows), torch.as_tensor(cols)
        self.targets = self.ids[self.rows, self.cols]
        self.adv = torch.as_tensor(adv_pad[rows, cols])
        self.n_tokens = batch.n_tokens

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(input_ids=self.ids, attention_mask=self.att, position_ids=self.pos, use_cache=False).logits
        logits = logits[self.rows, self.cols - 1].float()  # the logits that predict the loss tokens
        lp = logits.gather(-1, self.targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        loss = -(self.adv * torch.exp(lp - lp.detach())).sum() / len(lp)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sequences", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--pack-lengths", type=int, nargs="+", default=[256])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    batch, adv = rl_batch(args.sequences)
    base = tiny_model()
    algo = TokenMean()
    runs = {}
    for name, pack_length in [(f"packed_{p}", p) for p in args.pack_lengths] + [("one_row", args.micro_batch_tokens)]:
        be = create(TorchBackendConfig(lr=LR, micro_batch_tokens=args.micro_batch_tokens, pack_length=pack_length))
        be.start(LoadedModel(model=copy.deepcopy(base), tokenizer=None, stop_token_ids=[1]), seed=0, total_steps=100,
                 reference=False)
        runs[name] = lambda be=be: be.train_step(batch, adv, algo, temperature=1.0, max_new_tokens=8)
    runs["padded"] = Padded(copy.deepcopy(base), batch, adv).step

    rates: dict[str, list[float]] = {k: [] for k in runs}
    for round_ in range(args.repeats + 1):
        for name, step in runs.items():
            t0 = time.perf_counter()
            step()
            dt = time.perf_counter() - t0
            if round_ > 0:  # round 0 warms up
                rates[name].append(batch.n_tokens / dt)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(rates[a], rates[b]))

    out = {
        "config": {"sequences": args.sequences, "tokens": batch.n_tokens,
                   "loss_tokens": int(((batch.loss_mask != 0) & (batch.positions() > 0)).sum()),
                   "seq_len_range": [int(batch.seq_lens.min()), int(batch.seq_lens.max())],
                   "micro_batch_tokens": args.micro_batch_tokens, "threads": args.threads, "repeats": args.repeats},
        "tokens_per_s": {k: round(statistics.median(v)) for k, v in rates.items()},
        "ratios": {},
    }
    for p in args.pack_lengths:
        out["ratios"][f"packed_{p}/one_row"] = round(ratio(f"packed_{p}", "one_row"), 2)
        out["ratios"][f"packed_{p}/padded"] = round(ratio(f"packed_{p}", "padded"), 2)
    out["ratios"]["one_row/padded"] = round(ratio("one_row", "padded"), 2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
