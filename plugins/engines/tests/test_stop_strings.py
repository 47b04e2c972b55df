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
    prompts = [tokenizer.encode("What is 3 plus 4?")]
    sampler = processing.TruncatedSampler(temperature=1.0, top_k=50, return_support=True)
    free = engine(tokenizer).generate(prompts, n=1, sampler=sampler, max_new_tokens=8, seed=5)
    full = responses(free)[0]
    assert len(full) == 8 and free.truncated.all()
    # the stop string: the text of tokens 2 and 3, straddling a token boundary
    text = tokenizer.decode(full[:4])
    stop = text[len(tokenizer.decode(full[:2])) - 1:]
    assert len(tokenizer.decode(full[:3])) < len(text)
    k = next(k for k in range(1, 9) if stop in tokenizer.decode(full[:k]))
    assert k <= 4
    eng = engine(tokenizer, stop_strings=[stop, "never in any response \x00"])
    calls = count_forwards(eng)
    cut = eng.generate(prompts, n=1, sampler=sampler, max_new_tokens=8, seed=5)
    cut.validate()
    assert responses(cut)[0] == full[:k] and not cut.truncated[0]  # the same tokens up to the completing one
    # decoding stopped there: the prompt's forward and one per token fed back, not 8 decode steps
    assert calls == [1 + (k - 1)], calls
    lp_free = free.logprobs[free.prompt_lens[0]:free.cu_seqlens[1]]
    lp_cut = cut.logprobs[cut.prompt_lens[0]:cut.cu_seqlens[1]]
    np.testing.assert_array_equal(lp_cut, lp_free[:k])
    s_free, s_cut = free.side_channels["sample_support"], cut.side_channels["sample_support"]
    assert s_cut.n_rows == int(cut.loss_mask.sum()) == k
    assert all(np.array_equal(s_cut.row(j), s_free.row(j)) for j in range(k))


def count_forwards(eng) -> list[int]:
    """A list whose one entry counts the forward passes of ``eng``'s model from now on."""
    calls = [0]

    def hook(*_):
        calls[0] += 1

    eng.model.register_forward_hook(hook)
    return calls


def test_every_response_of_a_batch_ends_at_its_first_stop_string(tokenizer) -> None:
    """Rows stop as they meet a stop string (the others decode on): each response either
    ends with the token completing its first stop string, or runs to max_new_tokens
    without one; a batch whose rows all stop early stops decoding early."""
    prompts = [tokenizer.encode("What is 3 plus 4?"), tokenizer.encode("Alice has apples")]
    sampler = processing.TruncatedSampler(temperature=1.0, top_k=50)
    free = responses(engine(tokenizer).generate(prompts, n=4, sampler=sampler, max_new_tokens=12, seed=3))
    texts = [tokenizer.decode(r) for r in free]
    # stop strings every response holds early: each response's own 2nd-3rd character, common ones first
    stops = sorted({t[1:3] for t in texts if len(t) >= 3}, key=lambda s: -sum(s in t for t in texts))
    eng = engine(tokenizer, stop_strings=stops)
    calls = count_forwards(eng)
    cut = eng.generate(prompts, n=4, sampler=sampler, max_new_tokens=12, seed=3)
    cut.validate()
    got = responses(cut)
    assert any(len(r) < 12 for r in got)
    for i, r in enumerate(got):
        ends = any(s in tokenizer.decode(r) for s in stops)
        if ends:
            assert not any(s in tokenizer.decode(r[:-1]) for s in stops), i  # the first occurrence
            assert not cut.truncated[i]
        else:
            assert len(r) == 12 and cut.truncated[i], i
    assert calls[0] == 1 + max(len(r) for r in got) - 1


def test_stop_strings_must_be_non_empty_strings() -> None:
    with pytest.raises(ValueError, match="non-empty strings, found ''"):
        EmbeddedConfig(stop_strings=("ok", ""))


def test_the_jobs_stop_token_ids_end_responses_like_the_models_own(tokenizer) -> None:
    prompts = [tokenizer.encode("What is 3 plus 4?")]
    sampler = processing.TruncatedSampler(temperature=1.0, top_k=50)
    full = responses(engine(tokenizer).generate(prompts, n=1, sampler=sampler, max_new_tokens=8, seed=5))[0]
    stop = full[2]
    k = full.index(stop) + 1  # its first occurrence ends the response, the stop token kept
    eng = engine(tokenizer, stop_token_ids=[stop])
    assert eng.stop_token_ids == [tokenizer.eos_token_id, stop]
    cut = eng.generate(prompts, n=1, sampler=sampler, max_new_tokens=8, seed=5)
    assert responses(cut)[0] == full[:k] and not cut.truncated[0]


def test_stop_token_ids_outside_the_vocabulary_are_a_user_error(tokenizer) -> None:
    from skyrl_host.errors import UserError

    with pytest.raises(UserError, match=r"\[engine\] stop_token_ids: 99999 is not a token of this model"):
        engine(tokenizer, stop_token_ids=[99999])
    with pytest.raises(ValueError, match="integers >= 0"):
        EmbeddedConfig(stop_token_ids=(-1,))
