"""Shared helpers for the torch backend tests (also imported by the DP worker script):
a tiny Qwen3, a small RolloutBatch, a token-mean test algorithm."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from skyrl_host.interfaces import LoadedModel, LossInputs
from skyrl_host.rollout import RolloutBatch


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, attn: str = "sdpa") -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=256, vocab_size=32, tie_word_embeddings=True, attn_implementation=attn,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).to(dtype)


def loaded(seed: int = 0, **kw: Any) -> LoadedModel:
    return LoadedModel(model=tiny_model(seed, **kw), tokenizer=None, stop_token_ids=[1], family="test")


def tiny_batch(seed: int = 0, n: int = 6, prompt: tuple[int, int] = (2, 6), response: tuple[int, int] = (1, 8),
               vocab: int = 32) -> RolloutBatch:
    """``n`` sequences of uneven lengths (ids 2 .. vocab - 1), random engine logprobs near the model's."""
    rng = np.random.default_rng(seed)
    prompts, responses, lps = [], [], []
    for _ in range(n):
        p = rng.integers(2, vocab, rng.integers(prompt[0], prompt[1] + 1)).tolist()
        r = rng.integers(2, vocab, rng.integers(response[0], response[1] + 1)).tolist()
        prompts.append(p)
        responses.append(r)
        lps.append((-3.4 + 0.05 * rng.standard_normal(len(r))).tolist())
    return RolloutBatch.from_sequences(prompts, responses, lps, group_ids=[i // 2 for i in range(n)])


def tiny_advantages(batch: RolloutBatch, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    per_seq = rng.standard_normal(batch.n_sequences).astype(np.float32)
    return (np.repeat(per_seq, batch.seq_lens) * batch.loss_mask).astype(np.float32)


class TokenMean:
    """loss = -sum(A * ratio) / global_tokens: the token-mean policy gradient."""

    needs_reference = False

    def __init__(self, needs_reference: bool = False, metrics: bool = False):
        self.needs_reference = needs_reference
        self.metrics = metrics
        self.calls: list[LossInputs] = []

    def shape_rewards(self, batch: Any, max_new_tokens: int) -> Any:
        return batch.rewards

    def keep(self, batch: Any, rewards: Any) -> Any:
        return np.ones(batch.n_sequences, dtype=bool)

    def advantages(self, batch: Any, rewards: Any) -> Any:
        centred = np.asarray(rewards, dtype=np.float32) - float(np.mean(rewards))
        return (np.repeat(centred, batch.seq_lens) * batch.loss_mask).astype(np.float32)

    def loss(self, inputs: LossInputs) -> tuple[Any, dict]:
        self.calls.append(inputs)
        ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
        loss = -(inputs.advantages * ratio * inputs.mask).sum() / inputs.global_tokens
        metrics = {"ratio_mean": (ratio * inputs.mask).sum() / inputs.mask.sum()} if self.metrics else {}
        return loss, metrics


def make_backend(**options: Any) -> Any:
    from skyrl_backends.torch import TorchBackendConfig, create

    return create(TorchBackendConfig(**options))


def params(backend: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in backend.named_weights()}
