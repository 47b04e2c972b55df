"""In-flight weight updates in the embedded engine: ``update_weights`` from another
thread lands between two forwards of a generation in progress, never inside one; every
token records the version of the forward that produced it (side channel
``token_versions``) and the sequence's version is its oldest token's. With
``abort_on_update`` the live requests are resubmitted instead: prefilled again, prompt
and tokens so far, with the new weights."""

from __future__ import annotations

import threading

import numpy as np
import pytest
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


def teacher_forced_logprobs(model, seq, prompt_len):
    """The logprobs ``model`` gives the response tokens of ``seq`` in one forward over the
    whole sequence (the trainer's view of a sample)."""
    with torch.no_grad():
        ids = torch.as_tensor(np.asarray(seq, dtype=np.int64))[None]
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return logp[prompt_len - 1 : -1].gather(-1, ids[0, prompt_len:, None])[:, 0].numpy()


def generate_with_update_at(skyrl_host, loaded, new, at, abort, prompts, max_new=12):
    engine = make(skyrl_host, "engines", "embedded", share_weights=False, return_token_versions=True,
                  stop_token_ids=[])
    engine.start(loaded)
    engine.abort_on_update(abort)
    engine.stop_token_ids, engine._stops = [], torch.zeros(0, dtype=torch.long)  # every response runs to its cap
    sampler = PausingSampler(make(skyrl_host, "samplers", "temperature", temperature=1.0), at=at)
    out = {}
    worker = threading.Thread(target=lambda: out.update(batch=engine.generate(
        prompts, n=2, sampler=sampler, max_new_tokens=max_new, seed=3)))
    worker.start()
    assert sampler.reached.wait(30)
    engine.update_weights(new.items(), version=7)
    sampler.release.set()
    worker.join(30)
    return engine, out["batch"]


def test_abort_resubmits_live_requests_with_what_they_generated(skyrl_host) -> None:
    """abort_on_update: at an update inside a generation the live requests are prefilled
    again (prompt + their tokens so far) with the new weights, so every token after it is
    what the new weights give the whole sequence, as the trainer scores it; the tokens
    before keep the old weights' logprobs and version. With in-flight updates (the old KV
    kept) the tokens after the update do not match the new weights' scores."""
    import copy

    torch.manual_seed(0)
    loaded = make(skyrl_host, "models", "qwen", preset="tiny").load(alphabet="0123456789:", seed=0)
    old_model = copy.deepcopy(loaded.model).eval()
    new_model = copy.deepcopy(loaded.model).eval()
    with torch.no_grad():  # each parameter once (the tiny preset ties its head to the embedding)
        for param in new_model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    new = {k: v.detach().clone() for k, v in new_model.named_parameters()}
    prompts = [[1, 2, 3], [4, 5]]
    engine, batch = generate_with_update_at(skyrl_host, loaded, new, 5, True, prompts)
    assert engine.resubmitted == 4  # the four live requests, once each
    tv = batch.side_channels["token_versions"]
    for i in range(batch.n_sequences):
        lo, p = int(batch.cu_seqlens[i]), int(batch.prompt_lens[i])
        seq = batch.sequence(i)
        assert p == len(prompts[i // 2]) and seq[:p].tolist() == prompts[i // 2]  # the prompt stays the prompt
        assert batch.loss_mask[lo : lo + p].sum() == 0 and batch.loss_mask[lo + p : lo + len(seq)].all()
        assert tv[lo + p : lo + len(seq)].tolist() == [0] * 6 + [7] * 6
        lp = batch.response_logprobs(i)
        assert len(lp) == 12
        np.testing.assert_allclose(lp[:6], teacher_forced_logprobs(old_model, seq, p)[:6], atol=1e-5)
        np.testing.assert_allclose(lp[6:], teacher_forced_logprobs(new_model, seq, p)[6:], atol=1e-5)
    assert batch.versions.tolist() == [0, 0, 0, 0] and engine.weight_version == 7

    engine, kept = generate_with_update_at(skyrl_host, loaded, new, 5, False, prompts)
    assert engine.resubmitted == 0
    gaps = [np.abs(kept.response_logprobs(i)[6:] - teacher_forced_logprobs(new_model, kept.sequence(i),
                                                                          int(kept.prompt_lens[i]))[6:]).max()
            for i in range(kept.n_sequences)]
    assert min(gaps) > 1e-3, gaps


def test_abort_after_some_responses_stopped_resubmits_only_the_live_ones(skyrl_host) -> None:
    """Rows that ended (a stop token) before the update are not resubmitted; the others
    keep their row order, tokens and stop rule."""
    torch.manual_seed(0)
    loaded = make(skyrl_host, "models", "qwen", preset="tiny").load(alphabet="0123456789:", seed=0)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in loaded.model.state_dict().items()}
    engine = make(skyrl_host, "engines", "embedded", share_weights=False, return_token_versions=True)
    engine.start(loaded)
    engine.abort_on_update(True)
    plain = make(skyrl_host, "engines", "embedded", share_weights=False, return_token_versions=True)
    plain.start(loaded)
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 1]]
    sampler = make(skyrl_host, "samplers", "temperature", temperature=1.0)
    ref = plain.generate(prompts, n=4, sampler=sampler, max_new_tokens=24, seed=5)
    # Pause at the first step after some sequences stopped and others still run.
    lens = ref.response_lens
    at = int(np.sort(lens)[len(lens) // 4])
    assert (lens <= at).any() and (lens > at + 1).any(), lens.tolist()
    pausing = PausingSampler(sampler, at=at)
    out = {}
    worker = threading.Thread(target=lambda: out.update(batch=engine.generate(
        prompts, n=4, sampler=pausing, max_new_tokens=24, seed=5)))
    worker.start()
    assert pausing.reached.wait(30)
    engine.update_weights(new.items(), version=3)
    pausing.release.set()
    worker.join(30)
    batch = out["batch"]
    # Token `at` was sampled from the old weights' logits: a row whose token `at` ended it
    # (length at + 1) or that ended before is done; the others are resubmitted.
    assert engine.resubmitted == int((lens > at + 1).sum()) > 0
    for i in range(batch.n_sequences):
        if lens[i] <= at + 1:  # ended before the update: the same as without it
            assert batch.sequence(i).tolist() == ref.sequence(i).tolist()
            np.testing.assert_allclose(batch.response_logprobs(i), ref.response_logprobs(i), atol=1e-6)
        r = batch.response(i)
        tv = batch.side_channels["token_versions"][int(batch.cu_seqlens[i]) + int(batch.prompt_lens[i]):
                                                   int(batch.cu_seqlens[i + 1])]
        assert len(tv) == len(r) and set(tv.tolist()) <= {0, 3}
        assert (np.diff(tv) >= 0).all()  # old tokens first, then the new version's
    assert (batch.versions == 0).all()


def test_abort_is_refused_where_routes_are_recorded(skyrl_host) -> None:
    from skyrl_host.errors import UserError

    engine = make(skyrl_host, "engines", "embedded", return_routed_experts=True)
    with pytest.raises(UserError, match='weight_updates = "abort" cannot be used with .*return_routed_experts'):
        engine.abort_on_update(True)
    engine.abort_on_update(False)  # continuing on the kept KV stays possible


def test_abort_in_a_continued_turn_resubmits_the_whole_conversation(skyrl_host) -> None:
    """continue_turn with the turn cache (the history's KV kept from the turn before): an
    update inside the new turn's decoding resubmits the whole conversation so far, so
    the turn's later tokens are what the new weights give the full conversation."""
    import copy

    torch.manual_seed(1)
    loaded = make(skyrl_host, "models", "qwen", preset="tiny").load(alphabet="0123456789:", seed=0)
    new_model = copy.deepcopy(loaded.model).eval()
    with torch.no_grad():
        for param in new_model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    engine = make(skyrl_host, "engines", "embedded", share_weights=False, return_token_versions=True)
    engine.start(loaded)
    engine.abort_on_update(True)
    engine.stop_token_ids, engine._stops = [], torch.zeros(0, dtype=torch.long)  # every response runs to its cap
    sampler = make(skyrl_host, "samplers", "temperature", temperature=1.0)
    first = engine.generate([[1, 2, 3], [4, 5]], n=1, sampler=sampler, max_new_tokens=5, seed=2)
    history = first.append_turn(engine.continue_turn(first, [[9], [9]], sampler=sampler, max_new_tokens=5, seed=3))
    pausing = PausingSampler(sampler, at=4)
    turns = [[6, 7], [8]]
    out = {}
    worker = threading.Thread(target=lambda: out.update(segment=engine.continue_turn(
        history, turns, sampler=pausing, max_new_tokens=10, seed=4)))
    worker.start()
    assert pausing.reached.wait(30)
    engine.update_weights({k: v.detach().clone() for k, v in new_model.named_parameters()}.items(), version=2)
    pausing.release.set()
    worker.join(30)
    segment = out["segment"]
    assert engine._turns.hits == 2  # the third turn's prefill started from the second's kept KV
    assert engine.resubmitted == 2
    for i in range(segment.n_sequences):
        p = int(segment.prompt_lens[i])
        response = segment.sequence(i)[p:].tolist()
        assert len(response) == 10
        full = history.sequence(i).tolist() + turns[i] + response
        want = teacher_forced_logprobs(new_model, full, len(full) - 10)
        np.testing.assert_allclose(segment.response_logprobs(i)[5:], want[5:], atol=1e-5)
        tv = segment.side_channels["token_versions"][int(segment.cu_seqlens[i]) + p : int(segment.cu_seqlens[i + 1])]
        assert tv.tolist() == [0] * 5 + [2] * 5
