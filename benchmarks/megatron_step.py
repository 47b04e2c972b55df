"""The megatron backend's train step vs the torch backend's, on the same model and batch.

    python benchmarks/megatron_step.py [--models tiny,tiny-moe,qwen3-2l] [--repeats 5] [--threads 2]
                                       [--pack-length 256]

The alternative a user has is our torch backend (the default): same job, same packing
(micro_batch_tokens 4096, pack_length 256 unless --pack-length), same AdamW (lr 1e-6) and clipping, float32,
the same thread count. Each model trains two copies of one initial model, one per
backend, alternating torch / megatron step by step after one untimed warm-up step each;
the warm-up's loss (1e-5) and grad norm (1e-4: float32 norms of differently
fused tensors) must agree, so both compute the same thing. Prints one JSON object:
per model the median step seconds of each backend and the median of the per-round
ratios megatron / torch (> 1: megatron is slower).

Models:
- ``tiny``: the quickstart's preset (hidden 64, 2 layers) on a quickstart-shaped batch:
  512 sequences of 5-13 tokens;
- ``tiny-moe``: the qwen family's MoE preset (8 experts, top-2) on the same batch;
- ``qwen3-2l``: Qwen3-0.6B's widths (hidden 1024, 16 heads x 128, 8 KV heads, FFN 3072,
  vocabulary 8,192) with 2 layers and random weights, on 8 RL-shaped sequences
  (prompts 64-256 tokens, responses 16-512).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from skyrl_host.interfaces import LoadedModel, LossInputs
from skyrl_host.rollout import RolloutBatch


class PolicyGradient:
    """``-sum(A * ratio) / loss_tokens``: the policy gradient at ratio 1."""

    needs_reference = False

    def loss(self, inputs: LossInputs):
        ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
        return -(inputs.advantages * ratio).sum() / inputs.global_tokens, {}


def batch_of(n: int, vocab: int, prompt: tuple[int, int], response: tuple[int, int], seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, vocab, rng.integers(*prompt)).tolist() for _ in range(n)]
    responses = [rng.integers(1, vocab, rng.integers(*response)).tolist() for _ in range(n)]
    batch = RolloutBatch.from_sequences(prompts, responses, [[-2.0] * len(r) for r in responses],
                                        group_ids=[i // 16 for i in range(n)])
    adv = (np.repeat(rng.standard_normal(n).astype(np.float32), batch.seq_lens) * batch.loss_mask).astype(np.float32)
    return batch, adv


def model_of(name: str):
    if name in ("tiny", "tiny-moe"):
        import skyrl_models.qwen as qwen

        family = qwen.make_family(qwen.QwenConfig(preset=name))
        make = lambda: family.load(alphabet="0123456789:", seed=0)  # noqa: E731
        vocab = make().model.config.vocab_size
        return make, batch_of(512, vocab, (4, 8), (1, 7))
    if name == "qwen3-2l":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(hidden_size=1024, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8,
                          head_dim=128, intermediate_size=3072, vocab_size=8192, tie_word_embeddings=True,
                          max_position_embeddings=2048)
        torch.manual_seed(0)
        state = Qwen3ForCausalLM(cfg).state_dict()

        def make():
            model = Qwen3ForCausalLM(cfg)
            model.load_state_dict(state)
            return LoadedModel(model=model, tokenizer=None, stop_token_ids=[], family="qwen")

        return make, batch_of(8, 8192, (64, 257), (16, 513))
    raise SystemExit(f"unknown model {name!r} (tiny, tiny-moe, qwen3-2l)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,tiny-moe,qwen3-2l")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pack-length", type=int, default=256, help="both backends' pack_length (default: theirs)")
    parser.add_argument("--device", default="auto", help="both backends' [backend] device: auto, cpu, cuda")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from skyrl_backends.megatron import MegatronBackendConfig
    from skyrl_backends.megatron import create as megatron
    from skyrl_backends.torch import TorchBackendConfig
    from skyrl_backends.torch import create as plain

    out: dict = {"threads": args.threads, "repeats": args.repeats, "pack_length": args.pack_length,
                 "device": torch.cuda.get_device_name(0) if args.device != "cpu" and torch.cuda.is_available() else "cpu",
                 "models": {}}
    options = dict(lr=1e-6, micro_batch_tokens=4096, pack_length=args.pack_length, device=args.device)
    for name in args.models.split(","):
        make, (batch, adv) = model_of(name)
        backends = {"torch": plain(TorchBackendConfig(**options)), "megatron": megatron(MegatronBackendConfig(**options))}
        for be in backends.values():
            be.start(make(), seed=0, total_steps=args.repeats + 1, reference=False)
        algo = PolicyGradient()

        def step(be):
            t = time.perf_counter()
            metrics = be.train_step(batch, adv, algo, temperature=1.0, max_new_tokens=512)
            return time.perf_counter() - t, metrics

        warm = {k: step(be)[1] for k, be in backends.items()}
        # grad_norm to 1e-4 only: clip_grad_norm_ sums squares in float32 per tensor, and the
        # two backends group the same numbers into different tensors (fused QKV, fused gate/up).
        # On qwen3-2l both float32 norms are ~2e-4 off the float64 norm of the same gradients,
        # which agree to 1e-9.
        for key, tol in (("loss", 1e-5), ("grad_norm", 1e-4)):
            a, b = warm["torch"][key], warm["megatron"][key]
            assert abs(a - b) <= tol * max(1.0, abs(a)), (name, key, a, b)
        times: dict[str, list[float]] = {"torch": [], "megatron": []}
        for _ in range(args.repeats):
            for k in ("torch", "megatron"):
                times[k].append(step(backends[k])[0])
        ratios = [m / t for m, t in zip(times["megatron"], times["torch"])]
        out["models"][name] = {
            "tokens": int(batch.n_tokens),
            "torch_step_s": statistics.median(times["torch"]),
            "megatron_step_s": statistics.median(times["megatron"]),
            "megatron_over_torch": statistics.median(ratios),
            "warmup_loss": warm["torch"]["loss"],
            "warmup_grad_norm": warm["torch"]["grad_norm"],
            "warmup_loss_diff": abs(warm["torch"]["loss"] - warm["megatron"]["loss"]),
            "warmup_grad_norm_diff": abs(warm["torch"]["grad_norm"] - warm["megatron"]["grad_norm"]),
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
