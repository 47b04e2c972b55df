"""In-flight weight updates in the embedded engine: ``update_weights`` from another
thread lands between two forwards of a generation in progress, never inside one; every
token records the version of the forward that produced it (side channel
``token_versions``) and the sequence's version is its oldest token's."""

from __future__ import annotations

import threading

import numpy as np
import torch


class PausingSampler:
    """The temperature sampler, pausing once at decode step ``at`` until released (the
    engine is between forwards there: the sampler runs outside them)."""

    def __init__(self, inner, at):
        self.inner, self.at, self.calls = inner, at, 0
        self.temperature = inner.temperature
        self.reached, self.release = threading.Event(), threading.Event()

    def sample(self, logits, generator):
        if self.calls == self.at:
            self.reached.set()
            assert self.release.wait(30)
        self.calls += 1
        return self.inner.sample(logits, generator)


def make(skyrl_host, kind, name, **options):
    reg = skyrl_host.registry.get(kind, name)
    return reg.create(reg.config(**options))


def test_an_update_lands_at_the_next_decode_step_and_tokens_record_their_version(skyrl_host) -> None:
    torch.manual_seed(0)
    loaded = make(skyrl_host, "models", "qwen", preset="tiny").load(alphabet="0123456789:", seed=0)
    engine = make(skyrl_host, "engines", "embedded", share_weights=False, return_token_versions=True,
                  stop_token_ids=[])
    engine.start(loaded)
    assert "token_versions" in engine.side_channels(make(skyrl_host, "samplers", "temperature"))
    engine.stop_token_ids, engine._stops = [], torch.zeros(0, dtype=torch.long)  # every response runs to its cap
    sampler = PausingSampler(make(skyrl_host, "samplers", "temperature", temperature=1.0), at=5)
    prompts = [[1, 2, 3], [4, 5]]
    out = {}
    worker = threading.Thread(target=lambda: out.update(batch=engine.generate(
        prompts, n=2, sampler=sampler, max_new_tokens=12, seed=3)))
    worker.start()
    assert sampler.reached.wait(30)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in loaded.model.state_dict().items()}
    engine.update_weights(new.items(), version=7)  # the generation is paused between two forwards
    sampler.release.set()
    worker.join(30)
    batch = out["batch"]
    tv = batch.side_channels["token_versions"]
    for i in range(batch.n_sequences):
        lo, p = int(batch.cu_seqlens[i]), int(batch.prompt_lens[i])
        resp = tv[lo + p : int(batch.cu_seqlens[i + 1])].tolist()
        # Tokens 0..5 were sampled from logits of the old weights (the sixth forward, the
        # one that fed token 4, ran before the pause at step 5); from token 6 on, the new.
        assert resp == [0] * 6 + [7] * 6, resp
        assert tv[lo : lo + p].tolist() == [0] * p
    assert batch.versions.tolist() == [0, 0, 0, 0]  # a sequence is as old as its oldest token
    assert engine.weight_version == 7
    # The tokens after the update were scored by the new weights: their logprobs differ
    # from the same seed's generation without the update.
    plain = make(skyrl_host, "engines", "embedded", share_weights=False, stop_token_ids=[])
    plain.start(loaded)
    plain.stop_token_ids, plain._stops = [], torch.zeros(0, dtype=torch.long)
    ref = plain.generate(prompts, n=2, sampler=make(skyrl_host, "samplers", "temperature", temperature=1.0),
                         max_new_tokens=12, seed=3)
    for i in range(batch.n_sequences):
        a, b = batch.response_logprobs(i), ref.response_logprobs(i)
        np.testing.assert_allclose(a[:6], b[:6], atol=1e-6)
        assert not np.allclose(a[6:], b[6:], atol=1e-3)


def test_without_an_update_the_versions_are_the_calls(skyrl_host) -> None:
    loaded = make(skyrl_host, "models", "qwen", preset="tiny").load(alphabet="0123456789:", seed=0)
    engine = make(skyrl_host, "engines", "embedded", return_token_versions=True)
    engine.start(loaded)
    engine.update_weights(loaded.model.named_parameters(), version=4)
    batch = engine.generate([[1, 2, 3]], n=3, sampler=make(skyrl_host, "samplers", "temperature"), max_new_tokens=5,
                            seed=1)
    assert set(batch.side_channels["token_versions"].tolist()) == {4} and batch.versions.tolist() == [4, 4, 4]
