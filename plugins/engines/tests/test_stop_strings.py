"""The embedded engine's ``stop_strings``: a response is cut after the token that completes
the first stop string; its tokens, logprobs and sample support are cut alike (the real-shaped
checkpoint's byte-level BPE tokenizer, a tiny model over its vocabulary)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from skyrl_engines.embedded import Embedded, EmbeddedConfig
from skyrl_host.interfaces import LoadedModel
from skyrl_samplers import processing


@pytest.fixture(scope="module")
def tokenizer(skyrl_real_checkpoint):
    return AutoTokenizer.from_pretrained(skyrl_real_checkpoint("qwen3"))


def engine(tokenizer, **config):
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                         vocab_size=len(tokenizer), initializer_range=0.2)).eval()
    e = Embedded(EmbeddedConfig(**config))
    e.start(LoadedModel(model=model, tokenizer=tokenizer, stop_token_ids=[tokenizer.eos_token_id]))
    return e


def responses(batch):
    return [batch.response(i).tolist() for i in range(batch.n_sequences)]


def test_responses_are_cut_after_the_token_completing_a_stop_string(tokenizer) -> None:
    prompts = [tokenizer.encode("What is 3 plus 4?"), tokenizer.encode("Alice has apples")]
    sampler = processing.TruncatedSampler(temperature=1.0, top_k=50, return_support=True)
    free = engine(tokenizer).generate(prompts, n=2, sampler=sampler, max_new_tokens=8, seed=5)
    full = responses(free)
    assert all(len(r) == 8 for r in full) and free.truncated.all()
    # the stop string: the text of sequence 0's tokens 2 and 3, straddling a token boundary
    text = tokenizer.decode(full[0][:4])
    stop = text[len(tokenizer.decode(full[0][:2])) - 1:]
    assert len(tokenizer.decode(full[0][:3])) < len(text)
    cut = engine(tokenizer, stop_strings=[stop, "never in any response \x00"]).generate(
        prompts, n=2, sampler=sampler, max_new_tokens=8, seed=5)
    cut.validate()
    got = responses(cut)
    for i, (before, after) in enumerate(zip(full, got)):
        k = next((k for k in range(1, 9) if stop in tokenizer.decode(before[:k])), 8)
        assert after == before[:k], i  # the same tokens up to the one completing the stop string
        assert bool(cut.truncated[i]) == (k == 8 and stop not in tokenizer.decode(before))
    assert len(got[0]) <= 4 and not cut.truncated[0]
    lp_free = [free.logprobs[free.cu_seqlens[i] + free.prompt_lens[i]:free.cu_seqlens[i + 1]] for i in range(4)]
    lp_cut = [cut.logprobs[cut.cu_seqlens[i] + cut.prompt_lens[i]:cut.cu_seqlens[i + 1]] for i in range(4)]
    for a, b in zip(lp_free, lp_cut):
        np.testing.assert_array_equal(b, a[: len(b)])
    s_free, s_cut = free.side_channels["sample_support"], cut.side_channels["sample_support"]
    assert s_cut.n_rows == int(cut.loss_mask.sum())
    starts = np.concatenate([[0], np.cumsum([len(r) for r in full])])
    kept = [starts[i] + t for i, r in enumerate(got) for t in range(len(r))]
    assert all(np.array_equal(s_cut.row(j), s_free.row(r)) for j, r in enumerate(kept))


def test_stop_strings_must_be_non_empty_strings() -> None:
    with pytest.raises(ValueError, match="non-empty strings, found ''"):
        EmbeddedConfig(stop_strings=("ok", ""))
