"""Models with recurrent layers (Mamba, linear attention) ignore position ids, so the
backend must never pack two sequences into one row for them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from skyrl_host.interfaces import LoadedModel


def tiny_hybrid(seed: int = 0):
    import transformers

    cfg = transformers.NemotronHConfig(
        vocab_size=32, hidden_size=64, num_hidden_layers=3, layers_block_type=["mamba", "attention", "moe"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=16, n_groups=1, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, moe_shared_expert_intermediate_size=32,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).float()


def test_detects_recurrent_layers(tiny) -> None:
    from skyrl_backends._packing import has_recurrent_layers

    assert has_recurrent_layers(tiny_hybrid().config)
    assert not has_recurrent_layers(tiny.tiny_model().config)


def test_hybrid_model_trains_on_one_sequence_per_row(tiny) -> None:
    batch = tiny.tiny_batch(3, n=5)
    adv = tiny.tiny_advantages(batch)
    model = tiny_hybrid()
    # Reference: each sequence alone, through the plain forward.
    expected = []
    with torch.no_grad():
        for i in range(batch.n_sequences):
            ids = torch.as_tensor(batch.sequence(i), dtype=torch.long)[None]
            logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), -1)
            start = int(batch.prompt_lens[i])
            resp = ids[0, start:]
            expected.append(logp[start - 1 : -1].gather(-1, resp[:, None]).squeeze(-1))
    expected = torch.cat(expected)

    be = tiny.make_backend(micro_batch_tokens=4096, pack_length=4096, max_grad_norm=0.0)
    be.start(LoadedModel(model=model, tokenizer=None, stop_token_ids=[1]), seed=0, total_steps=1, reference=False)
    algo = tiny.TokenMean()
    be.train_step(batch, adv, algo, temperature=1.0, max_new_tokens=8)
    got = algo.calls[0].logprobs.detach()
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
