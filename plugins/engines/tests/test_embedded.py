"""The embedded engine: registration, batched generation against an unbatched
reference, logprobs against teacher forcing, stops, seeds, shared weights,
ordering, bf16.

Every test builds its own tiny Qwen3 and its own samplers (no other plugin is
needed)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import skyrl_engines._embedded as impl
import skyrl_engines.embedded
from skyrl_engines.embedded import Embedded, EmbeddedConfig
from skyrl_host.interfaces import Engine, LoadedModel, SampleOutput
from skyrl_host.rollout import RolloutBatch
from skyrl_samplers import processing

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: tiny models gain nothing from more, and a busy machine
    (other processes on the cores) makes several threads many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Prompts of different lengths (1..7 tokens), so left padding differs per row.
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3], [20, 21], [4, 25, 26, 27, 9]]


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    # initializer_range 0.2 (instead of 0.02) so greedy outputs vary from step to step
    # instead of repeating the last token: a stronger check of masks and positions.
    torch.manual_seed(seed)
    config = Qwen3Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        vocab_size=32,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    return Qwen3ForCausalLM(config).to(dtype)


class GreedySampler:
    temperature = 1.0

    def sample(self, logits: torch.Tensor, generator: torch.Generator) -> SampleOutput:
        ids = logits.argmax(-1)
        logprobs = torch.log_softmax(logits / self.temperature, -1).gather(1, ids[:, None])[:, 0]
        return SampleOutput(ids, logprobs)


class TemperatureSampler:
    def __init__(self, temperature: float = 1.0):
        self.temperature = temperature

    def sample(self, logits: torch.Tensor, generator: torch.Generator) -> SampleOutput:
        logprobs = torch.log_softmax(logits / self.temperature, -1)
        ids = torch.multinomial(logprobs.exp(), 1, generator=generator)[:, 0]
        return SampleOutput(ids, logprobs.gather(1, ids[:, None])[:, 0])


class ForcedStopSampler:
    """Samples among tokens other than the ``banned`` ones (the stop ids), except
    that each row emits ``stop`` with probability ``p`` (or always from call
    ``always_from`` on)."""

    def __init__(self, stop: int, p: float, always_from: int | None = None, banned: tuple[int, ...] = (2, 31)):
        self.temperature = 1.0
        self.stop, self.p, self.always_from, self.calls, self.banned = stop, p, always_from, 0, list(banned)

    def sample(self, logits: torch.Tensor, generator: torch.Generator) -> SampleOutput:
        self.calls += 1
        logprobs = torch.log_softmax(logits, -1)
        probs = logprobs.exp()
        probs[:, self.banned] = 0
        ids = torch.multinomial(probs, 1, generator=generator)[:, 0]
        force = torch.rand(ids.shape, generator=generator) < self.p
        if self.always_from is not None and self.calls >= self.always_from:
            force[:] = True
        ids = torch.where(force, torch.full_like(ids, self.stop), ids)
        return SampleOutput(ids, logprobs.gather(1, ids[:, None])[:, 0])


def engine_for(model: torch.nn.Module, *, stop: list[int] = (), **config) -> impl.EmbeddedEngine:
    engine = Embedded(EmbeddedConfig(**config))
    engine.start(LoadedModel(model=model, tokenizer=None, stop_token_ids=list(stop)))
    return engine


def reference_greedy(model: torch.nn.Module, prompt: list[int], max_new: int, stop: set[int]) -> list[int]:
    """Full recompute per step, one prompt at a time, no padding, no cache."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            if token in stop:
                break
    return ids[len(prompt) :]


def teacher_forced_logprobs(model: torch.nn.Module, batch: RolloutBatch, temperature: float) -> np.ndarray:
    """log_softmax(logits / T) at each response token, from one full forward of each packed sequence."""
    out = np.zeros(batch.n_tokens, dtype=np.float32)
    with torch.no_grad():
        for i in range(batch.n_sequences):
            seq = torch.as_tensor(batch.sequence(i), dtype=torch.long)
            logits = model(seq[None]).logits[0].float()
            lp = torch.log_softmax(logits / temperature, -1)
            p = int(batch.prompt_lens[i])
            start = int(batch.cu_seqlens[i])
            targets = seq[p:]
            out[start + p : start + len(seq)] = lp[p - 1 : len(seq) - 1].gather(1, targets[:, None])[:, 0].numpy()
    return out


def assert_same_batch(a: RolloutBatch, b: RolloutBatch) -> None:
    for name in ("tokens", "cu_seqlens", "prompt_lens", "logprobs", "loss_mask", "group_ids", "versions", "truncated"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


# -- registration -------------------------------------------------------------


def test_registered_through_the_installed_entry_point(skyrl_host) -> None:
    reg = skyrl_host.registry.get("engines", "embedded")
    assert reg.factory is Embedded
    assert reg.config is EmbeddedConfig
    assert reg.origin.distribution == "skyrl-engines"
    assert skyrl_host.records["embedded"].entry_point == "skyrl_engines.embedded"
    assert skyrl_host.pm.get_plugin("embedded") is skyrl_engines.embedded


def test_registered_module_imports_no_torch() -> None:
    code = "import sys, json, skyrl_engines.embedded; print(json.dumps([m for m in ('torch', 'transformers') if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_config_defaults_and_checks() -> None:
    c = EmbeddedConfig()
    assert (c.dtype, c.max_batch_size, c.threads) == ("auto", 256, None)
    with pytest.raises(ValueError):
        EmbeddedConfig(max_batch_size=0)
    with pytest.raises(ValueError):
        EmbeddedConfig(threads=0)


def test_engine_implements_the_protocol() -> None:
    engine = engine_for(tiny_model())
    assert isinstance(engine, Engine)
    assert engine.weight_version == 0


# -- (1) batched == unbatched reference, token for token -------------------------


@pytest.mark.parametrize("max_batch_size", [256, 3])
@pytest.mark.parametrize("compact_fraction", [0.25, 1e-9, 2.0], ids=["compact-quarter", "compact-always", "compact-never"])
def test_greedy_batched_equals_unbatched_reference(monkeypatch, max_batch_size, compact_fraction) -> None:
    monkeypatch.setattr(impl, "COMPACT_FRACTION", compact_fraction)
    model = tiny_model()
    max_new = 12
    free = [reference_greedy(model, p, max_new, set()) for p in PROMPTS]
    # A stop token that ends some sequences early and not others: the 3rd token of prompt 0's answer.
    stop = free[0][2]
    expected = [r[: r.index(stop) + 1] if stop in r else r for r in free]
    assert any(len(r) < max_new for r in expected) and any(len(r) == max_new for r in expected)

    engine = engine_for(model, stop=[stop], max_batch_size=max_batch_size)
    batch = engine.generate(PROMPTS, n=2, sampler=GreedySampler(), max_new_tokens=max_new, seed=0)
    for i in range(batch.n_sequences):
        assert batch.prompt(i).tolist() == PROMPTS[i // 2]
        assert batch.response(i).tolist() == expected[i // 2], f"sequence {i}"
        assert bool(batch.truncated[i]) == (stop not in expected[i // 2])
    # the no-stop answers agree with the reference too
    engine2 = engine_for(model, max_batch_size=max_batch_size)
    batch2 = engine2.generate(PROMPTS, n=1, sampler=GreedySampler(), max_new_tokens=max_new, seed=0)
    assert [batch2.response(i).tolist() for i in range(len(PROMPTS))] == free


OTHER_FAMILIES = {
    # MoE (Qwen3-MoE) and a hybrid of Mamba2 and attention layers (Nemotron-H): the
    # attention layers get the preallocated cache, the Mamba layer keeps transformers' own.
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32),
    "nemotron_h": dict(
        layers_block_type=["mamba", "attention"], mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1, head_dim=32
    ),
}


@pytest.mark.parametrize("model_type", sorted(OTHER_FAMILIES))
def test_greedy_matches_the_reference_for_other_families(model_type) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=32,
        initializer_range=0.2,
        **OTHER_FAMILIES[model_type],
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    engine = engine_for(model, max_batch_size=6)
    batch = engine.generate(PROMPTS, n=2, sampler=GreedySampler(), max_new_tokens=8, seed=0)
    expected = [reference_greedy(model, p, 8, set()) for p in PROMPTS]
    assert [batch.response(i).tolist() for i in range(0, batch.n_sequences, 2)] == expected
    assert [batch.response(i).tolist() for i in range(1, batch.n_sequences, 2)] == expected


# -- (2) logprobs == teacher forcing ----------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_teacher_forced_forward(temperature) -> None:
    model = tiny_model()
    engine = engine_for(model, stop=[2], max_batch_size=8)
    batch = engine.generate(PROMPTS, n=3, sampler=TemperatureSampler(temperature), max_new_tokens=10, seed=3)
    ref = teacher_forced_logprobs(model, batch, temperature)
    mask = batch.loss_mask.astype(bool)
    assert mask.sum() == batch.response_lens.sum() > 0
    np.testing.assert_allclose(batch.logprobs[mask], ref[mask], atol=1e-4, rtol=0)
    assert np.all(batch.logprobs[~mask] == 0)


# -- (3) stops and truncation -----------------------------------------------------


def test_stop_tokens_end_sequences_and_truncation_flags() -> None:
    stop = 2
    engine = engine_for(tiny_model(), stop=[31, stop], max_batch_size=7)
    batch = engine.generate(PROMPTS, n=4, sampler=ForcedStopSampler(stop, p=0.15), max_new_tokens=9, seed=5)
    lens = batch.response_lens
    n_stopped = 0
    for i in range(batch.n_sequences):
        r = batch.response(i).tolist()
        assert stop not in r[:-1]
        if r[-1] == stop:  # stopped: the stop token is the last response token and trains
            n_stopped += 1
            assert not batch.truncated[i]
            assert batch.loss_mask[batch.cu_seqlens[i + 1] - 1] == 1
        else:
            assert len(r) == 9 and batch.truncated[i]
    assert 0 < n_stopped < batch.n_sequences
    assert len(set(lens.tolist())) > 2  # sequences of many lengths in one batch

    # every sequence stops at once: responses are just the stop token
    batch = engine.generate(PROMPTS, n=2, sampler=ForcedStopSampler(stop, p=1.0), max_new_tokens=9, seed=5)
    assert all(batch.response(i).tolist() == [stop] for i in range(batch.n_sequences))
    assert not batch.truncated.any()

    # a stop on the very last allowed token is a stop, not a truncation (n=1: one chunk of 5 rows)
    batch = engine.generate(PROMPTS, n=1, sampler=ForcedStopSampler(stop, p=0.0, always_from=4), max_new_tokens=4, seed=5)
    assert all(len(batch.response(i)) == 4 and batch.response(i)[-1] == stop for i in range(batch.n_sequences))
    assert not batch.truncated.any()

    # the other stop id ends sequences too; never stopping truncates everything
    forced31 = ForcedStopSampler(31, p=1.0)
    batch = engine.generate(PROMPTS, n=1, sampler=forced31, max_new_tokens=5, seed=0)
    assert all(batch.response(i).tolist() == [31] for i in range(batch.n_sequences))
    no_stop = engine_for(tiny_model(), stop=[], max_batch_size=7)
    batch = no_stop.generate(PROMPTS, n=2, sampler=TemperatureSampler(), max_new_tokens=6, seed=0)
    assert batch.truncated.all() and (batch.response_lens == 6).all()


# -- (4) seeds ------------------------------------------------------------------------


def test_same_seed_same_batch_different_seed_different_batch() -> None:
    engine = engine_for(tiny_model(), stop=[2], max_batch_size=6)
    sampler = TemperatureSampler(1.0)
    a = engine.generate(PROMPTS, n=4, sampler=sampler, max_new_tokens=10, seed=11)
    b = engine.generate(PROMPTS, n=4, sampler=sampler, max_new_tokens=10, seed=11)
    c = engine.generate(PROMPTS, n=4, sampler=sampler, max_new_tokens=10, seed=12)
    assert_same_batch(a, b)
    assert a.n_tokens != c.n_tokens or not np.array_equal(a.tokens, c.tokens)
    # a fresh engine on an identical model gives the same batch too
    other = engine_for(tiny_model(), stop=[2], max_batch_size=6)
    assert_same_batch(a, other.generate(PROMPTS, n=4, sampler=sampler, max_new_tokens=10, seed=11))


# -- (5) shared weights and update_weights ------------------------------------------------


def test_matching_dtype_shares_the_models_tensors() -> None:
    model = tiny_model()
    model.train()
    engine = engine_for(model)
    assert engine.shares_weights
    src = dict(model.named_parameters())
    for name, p in engine.model.named_parameters():
        assert p is src[name]
    assert model.training and src["model.embed_tokens.weight"].requires_grad  # the caller's flags are untouched
    assert not engine.model.training


def test_in_place_changes_to_the_source_model_reach_the_engine() -> None:
    model = tiny_model()
    engine = engine_for(model, stop=[])
    before = engine.generate(PROMPTS, n=1, sampler=GreedySampler(), max_new_tokens=8, seed=0)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-3.0)  # e.g. an optimizer step
    after = engine.generate(PROMPTS, n=1, sampler=GreedySampler(), max_new_tokens=8, seed=0)
    assert not np.array_equal(before.tokens, after.tokens)
    ref = [reference_greedy(model, p, 8, set()) for p in PROMPTS]
    assert [after.response(i).tolist() for i in range(len(PROMPTS))] == ref
    assert engine.weight_version == 0


def test_update_weights_shared_copied_and_rejected() -> None:
    model = tiny_model()
    engine = engine_for(model, stop=[])
    # the trainer's own tensors: nothing to copy, the version moves on
    engine.update_weights(model.named_parameters(), version=1)
    assert engine.weight_version == 1
    assert engine.last_update["copied"] == 0 and engine.last_update["shared"] > 0

    before = engine.generate(PROMPTS, n=1, sampler=GreedySampler(), max_new_tokens=8, seed=0)
    new_model = tiny_model(seed=1)
    new = {k: v.detach().clone() for k, v in new_model.state_dict().items()}  # includes the tied alias lm_head.weight
    engine.update_weights(new.items(), version=2)
    assert engine.weight_version == 2 and engine.last_update["copied"] > 0
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, new[name]) and p.data_ptr() != new[name].data_ptr()
    after = engine.generate(PROMPTS, n=1, sampler=GreedySampler(), max_new_tokens=8, seed=0)
    assert (after.versions == 2).all() and (before.versions == 1).all()
    ref = [reference_greedy(new_model, p, 8, set()) for p in PROMPTS]
    assert [after.response(i).tolist() for i in range(len(PROMPTS))] == ref

    snapshot = {k: v.detach().clone() for k, v in engine.model.named_parameters()}
    other = {k: v.detach().clone() + 1.0 for k, v in model.named_parameters()}

    def rejected(pairs, match):
        with pytest.raises(ValueError, match=match):
            engine.update_weights(pairs, version=3)
        assert engine.weight_version == 2
        for k, v in engine.model.named_parameters():
            assert torch.equal(v, snapshot[k]), k

    names = list(other)
    # a good tensor first, then an unknown name: the good one must not have been applied
    rejected([(names[0], other[names[0]]), ("model.nope.weight", other[names[1]])] + list(other.items())[1:], "model.nope.weight")
    bad_shape = dict(other)
    bad_shape[names[1]] = other[names[1]][..., :-1]
    rejected(bad_shape.items(), names[1])
    missing = dict(other)
    del missing[names[-1]]
    rejected(missing.items(), names[-1])


# -- (6) n samples, ordering and group ids -----------------------------------------------------


@pytest.mark.parametrize("max_batch_size", [256, 2])  # 2 < n: one prompt's samples straddle chunks
def test_samples_are_grouped_prompt_by_prompt(max_batch_size) -> None:
    engine = engine_for(tiny_model(), stop=[2], max_batch_size=max_batch_size)
    engine.update_weights(engine.model.named_parameters(), version=7)
    n = 3
    batch = engine.generate(PROMPTS, n=n, sampler=TemperatureSampler(), max_new_tokens=6, seed=1, group_offset=40)
    batch.validate()
    assert batch.n_sequences == len(PROMPTS) * n
    assert batch.group_ids.tolist() == [40 + i for i in range(len(PROMPTS)) for _ in range(n)]
    assert (batch.versions == 7).all()
    assert batch.prompt_lens.tolist() == [len(p) for p in PROMPTS for _ in range(n)]
    for i in range(batch.n_sequences):
        assert batch.prompt(i).tolist() == PROMPTS[i // n]
        s, e = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
        p = int(batch.prompt_lens[i])
        assert batch.loss_mask[s : s + p].tolist() == [0] * p
        assert batch.loss_mask[s + p : e].tolist() == [1] * (e - s - p)
        assert (batch.logprobs[s + p : e] < 0).all()
    assert batch.tokens.dtype == np.int32 and batch.logprobs.dtype == np.float32
    # the samples of a group differ (they are drawn, not copied)
    assert len({batch.response(i).tobytes() for i in range(n)}) > 1


# -- (7) bf16 ------------------------------------------------------------------------------------


def test_bfloat16_engine_from_a_float32_model() -> None:
    model = tiny_model()
    engine = engine_for(model, stop=[2], dtype="bfloat16", max_batch_size=4)
    assert not engine.shares_weights
    assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the source is untouched
    batch = engine.generate(PROMPTS, n=2, sampler=TemperatureSampler(0.8), max_new_tokens=8, seed=0)
    mask = batch.loss_mask.astype(bool)
    assert np.isfinite(batch.logprobs).all() and (batch.logprobs[mask] < 0).all()
    ref = teacher_forced_logprobs(engine.model, batch, 0.8)  # the bf16 model, unbatched
    assert np.abs(batch.logprobs[mask] - ref[mask]).max() < 0.1
    # greedy bf16 follows the bf16 model's own unbatched greedy answers
    greedy = engine.generate(PROMPTS, n=1, sampler=GreedySampler(), max_new_tokens=6, seed=0)
    ref_tokens = [reference_greedy(engine.model, p, 6, {2}) for p in PROMPTS]
    agree = sum(greedy.response(i).tolist() == ref_tokens[i] for i in range(len(PROMPTS)))
    assert agree >= len(PROMPTS) - 1  # bf16 rounding may flip a near-tie in one of them

    # weights from the float32 trainer are converted on the way in
    new = {k: v.detach() * 0.5 for k, v in model.named_parameters()}
    engine.update_weights(new.items(), version=1)
    assert engine.last_update["copied"] == len(new)
    for name, p in engine.model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, new[name].to(torch.bfloat16))
    assert engine.generate(PROMPTS, n=1, sampler=GreedySampler(), max_new_tokens=4, seed=0).versions.tolist() == [1] * 5


def test_bfloat16_model_served_as_is_with_auto() -> None:
    model = tiny_model(dtype=torch.bfloat16)
    engine = engine_for(model, stop=[2])
    assert engine.shares_weights and engine.model.model.embed_tokens.weight is model.model.embed_tokens.weight
    batch = engine.generate(PROMPTS, n=2, sampler=TemperatureSampler(), max_new_tokens=5, seed=0)
    assert np.isfinite(batch.logprobs).all()


def test_rejects_bad_arguments() -> None:
    engine = engine_for(tiny_model())
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[1], []], n=1, sampler=GreedySampler(), max_new_tokens=3, seed=0)
    with pytest.raises(ValueError, match="n must"):
        engine.generate([[1]], n=0, sampler=GreedySampler(), max_new_tokens=3, seed=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([[1]], n=1, sampler=GreedySampler(), max_new_tokens=0, seed=0)
    with pytest.raises(RuntimeError, match="start"):
        Embedded(EmbeddedConfig()).generate([[1]], n=1, sampler=GreedySampler(), max_new_tokens=3, seed=0)


# -- sample support side channel ----------------------------------------------


def _truncated(**kwargs):
    return processing.TruncatedSampler(**kwargs)


def _greedy(**kwargs):
    return processing.GreedySampler(**kwargs)


def teacher_forced_support(model: torch.nn.Module, batch: RolloutBatch, sampler) -> list[np.ndarray]:
    """sampler.support at every generated token, from one full forward of each packed sequence."""
    rows = []
    with torch.no_grad():
        for i in range(batch.n_sequences):
            seq = torch.as_tensor(batch.sequence(i), dtype=torch.long)
            logits = model(seq[None]).logits[0].float()
            p = int(batch.prompt_lens[i])
            keep = sampler.support(logits[p - 1 : len(seq) - 1])
            rows.extend(np.flatnonzero(k.numpy()) for k in keep)
    return rows


@pytest.mark.parametrize("max_batch_size", [3, 256])
def test_sample_support_matches_teacher_forced_support(monkeypatch, max_batch_size) -> None:
    monkeypatch.setattr(impl, "COMPACT_FRACTION", 0.01)  # compact at the first finished row
    model = tiny_model()
    engine = engine_for(model, stop=[1, 2], max_batch_size=max_batch_size)
    sampler = _truncated(temperature=0.9, top_k=12, top_p=0.8, return_support=True)
    batch = engine.generate(PROMPTS, n=3, sampler=sampler, max_new_tokens=12, seed=7)
    batch.validate()
    assert not batch.truncated.all(), "some sequence should hit a stop token"
    csr = batch.side_channels["sample_support"]
    assert csr.offsets.dtype == np.int64 and csr.values.dtype == np.int32
    generated = batch.tokens[batch.loss_mask == 1]
    assert csr.n_rows == len(generated)
    expected = teacher_forced_support(model, batch, sampler)
    for r, (tok, row) in enumerate(zip(generated, expected)):
        got = csr.row(r)
        assert tok in got, r
        assert 1 <= len(got) <= 12
        np.testing.assert_array_equal(got, row, err_msg=f"row {r}")


def test_sample_support_on_and_off_give_the_same_tokens() -> None:
    model = tiny_model()
    engine = engine_for(model, stop=[1], max_batch_size=4)
    off = engine.generate(PROMPTS, n=2, sampler=_truncated(top_p=0.9), max_new_tokens=10, seed=3)
    on = engine.generate(PROMPTS, n=2, sampler=_truncated(top_p=0.9, return_support=True), max_new_tokens=10, seed=3)
    assert_same_batch(off, on)
    assert "sample_support" not in off.side_channels
    assert "sample_support" in on.side_channels


def test_sample_support_survives_select() -> None:
    model = tiny_model()
    engine = engine_for(model, stop=[1, 2])
    batch = engine.generate(
        PROMPTS, n=2, sampler=_truncated(top_k=5, return_support=True), max_new_tokens=8, seed=1
    )
    csr = batch.side_channels["sample_support"]
    rank = np.cumsum(batch.loss_mask) - 1
    order = [7, 0, 3]
    sub = batch.select(order)
    sub.validate()
    sub_csr = sub.side_channels["sample_support"]
    r = 0
    for i in order:
        s, e = int(batch.cu_seqlens[i]) + int(batch.prompt_lens[i]), int(batch.cu_seqlens[i + 1])
        for t in range(s, e):
            np.testing.assert_array_equal(sub_csr.row(r), csr.row(int(rank[t])))
            assert batch.tokens[t] in sub_csr.row(r)
            r += 1
    assert r == sub_csr.n_rows


def test_sample_support_without_truncation_is_the_full_vocab_and_greedy_is_the_token() -> None:
    model = tiny_model()
    engine = engine_for(model, stop=[1])
    vocab = model.config.vocab_size
    batch = engine.generate(PROMPTS, n=2, sampler=_truncated(return_support=True), max_new_tokens=6, seed=0)
    csr = batch.side_channels["sample_support"]
    np.testing.assert_array_equal(np.diff(csr.offsets), vocab)
    np.testing.assert_array_equal(csr.values, np.tile(np.arange(vocab), csr.n_rows))
    batch = engine.generate(PROMPTS, n=1, sampler=_greedy(return_support=True), max_new_tokens=6, seed=0)
    csr = batch.side_channels["sample_support"]
    np.testing.assert_array_equal(np.diff(csr.offsets), 1)
    np.testing.assert_array_equal(csr.values, batch.tokens[batch.loss_mask == 1])


def test_return_support_needs_sample_with_support() -> None:
    engine = engine_for(tiny_model())
    sampler = TemperatureSampler()
    sampler.return_support = True
    with pytest.raises(ValueError, match="sample_with_support"):
        engine.generate(PROMPTS, n=1, sampler=sampler, max_new_tokens=2, seed=0)
