"""LoRA adapters in the embedded engine: serving an adapter equals serving the merged
weights; the swap is atomic (a generate call in flight keeps the adapter it started
with, also when updates arrive from another thread); a bad adapter changes nothing."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from skyrl_engines._adapters import AdapterError
from skyrl_engines.embedded import Embedded, EmbeddedConfig
from skyrl_host.interfaces import LoadedModel, SampleOutput

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [3], [20, 21]]
CONFIG = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         intermediate_size=128, vocab_size=32, tie_word_embeddings=True, initializer_range=0.2)
    return Qwen3ForCausalLM(config)


class Sampler:
    """Temperature sampling; ``on_call[k]`` runs before the k-th call (1-based)."""

    def __init__(self, temperature: float = 1.0, on_call=None):
        self.temperature = temperature
        self.calls = 0
        self.on_call = dict(on_call or {})

    def sample(self, logits: torch.Tensor, generator: torch.Generator) -> SampleOutput:
        self.calls += 1
        if self.calls in self.on_call:
            self.on_call[self.calls]()
        logprobs = torch.log_softmax(logits / self.temperature, -1)
        ids = torch.multinomial(logprobs.exp(), 1, generator=generator)[:, 0]
        return SampleOutput(ids, logprobs.gather(1, ids[:, None])[:, 0])


def engine_for(model: torch.nn.Module, **config) -> object:
    engine = Embedded(EmbeddedConfig(**config))
    engine.start(LoadedModel(model=model, tokenizer=None, stop_token_ids=[1]))
    return engine


def random_adapter(model: torch.nn.Module, seed: int, config=CONFIG) -> dict[str, torch.Tensor]:
    """Adapter tensors for every target Linear, large enough to change what is sampled."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] in config["targets"] and isinstance(m, torch.nn.Linear):
            out[f"{name}.lora_A"] = torch.randn(config["rank"], m.in_features, generator=g) * 0.3
            out[f"{name}.lora_B"] = torch.randn(m.out_features, config["rank"], generator=g) * 0.3
    return out


def merged_model(model: torch.nn.Module, adapter: dict[str, torch.Tensor], config=CONFIG) -> torch.nn.Module:
    merged = copy.deepcopy(model)
    scale = config["alpha"] / config["rank"]
    with torch.no_grad():
        for name, m in merged.named_modules():
            if f"{name}.lora_A" in adapter:
                m.weight += scale * adapter[f"{name}.lora_B"] @ adapter[f"{name}.lora_A"]
    return merged


def generate(engine, seed: int = 1, sampler=None):
    return engine.generate(PROMPTS, n=3, sampler=sampler or Sampler(), max_new_tokens=10, seed=seed)


def same_rollouts(a, b) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("tokens", "cu_seqlens", "logprobs"))


def test_adapter_generation_equals_merged_weights() -> None:
    model = tiny_model()
    engine = engine_for(model)
    base = generate(engine)
    adapter = random_adapter(model, 1)
    assert engine.adapter_slots(CONFIG) == {k: tuple(v.shape) for k, v in adapter.items()}
    engine.update_adapter(adapter.items(), CONFIG, 5)
    assert engine.weight_version == 5
    got = generate(engine)
    want = generate(engine_for(merged_model(model, adapter)))
    assert (got.versions == 5).all()
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=2e-5)
    assert not np.array_equal(got.tokens, base.tokens)  # the adapter matters
    # The engine's base weights are untouched (it serves the caller's tensors: dtype auto).
    assert engine.shares_weights
    assert engine.last_update["bytes"] == sum(v.numel() * 4 for v in adapter.values())


def test_numpy_adapters_and_a_bf16_engine() -> None:
    model = tiny_model()
    adapter = random_adapter(model, 2)
    engine = engine_for(model, dtype="bfloat16")
    engine.update_adapter([(k, v.numpy()) for k, v in adapter.items()], CONFIG, 1)
    got = generate(engine)
    want = generate(engine_for(merged_model(model, adapter), dtype="bfloat16"))
    # bf16 rounds the merged weights and the adapter path differently: close, not equal. A
    # token drawn differently changes the rest of its sequence, so the logprobs are compared
    # on each sequence's common prefix (the same context on both sides).
    same = []
    for i in range(got.n_sequences):
        a, b = (x.tokens[x.cu_seqlens[i] : x.cu_seqlens[i + 1]] for x in (got, want))
        split = next((t for t in range(min(len(a), len(b))) if a[t] != b[t]), min(len(a), len(b)))
        same.extend(t for t in range(int(got.cu_seqlens[i]), int(got.cu_seqlens[i]) + split) if got.loss_mask[t])
    assert len(same) >= int(got.loss_mask.sum()) // 2
    assert np.abs(got.logprobs[same] - want.logprobs[same]).mean() < 0.03  # seen: 0.016


def test_swap_during_a_generate_call_is_not_seen_by_that_call() -> None:
    model = tiny_model()
    a1, a2, a3 = (random_adapter(model, s) for s in (11, 12, 13))
    pure = {}
    for v, a in ((1, a1), (3, a3)):
        e = engine_for(model)
        e.update_adapter(a.items(), CONFIG, v)
        pure[v] = generate(e)

    engine = engine_for(model)
    engine.update_adapter(a1.items(), CONFIG, 1)
    # Versions 2 and 3 arrive while the call is decoding (before its 3rd and 5th token):
    # version 3 cannot reuse version 1's buffers, which the running call still reads.
    sampler = Sampler(on_call={3: lambda: engine.update_adapter(a2.items(), CONFIG, 2),
                               5: lambda: engine.update_adapter(a3.items(), CONFIG, 3)})
    in_flight = generate(engine, sampler=sampler)
    assert sampler.calls >= 5
    assert (in_flight.versions == 1).all()
    assert same_rollouts(in_flight, pure[1])
    after = generate(engine)
    assert (after.versions == 3).all() and engine.weight_version == 3
    assert same_rollouts(after, pure[3])
    assert not same_rollouts(pure[1], pure[3])


def test_updates_from_another_thread_never_mix_versions() -> None:
    model = tiny_model()
    adapters = {v: random_adapter(model, 20 + v) for v in range(1, 6)}
    pure = {}
    for v, a in adapters.items():
        e = engine_for(model)
        e.update_adapter(a.items(), CONFIG, v)
        pure[v] = generate(e, seed=7)

    engine = engine_for(model)
    engine.update_adapter(adapters[1].items(), CONFIG, 1)
    batches = []
    stop = threading.Event()

    def generating() -> None:
        while not stop.is_set() or len(batches) < 3:
            batches.append(generate(engine, seed=7))

    worker = threading.Thread(target=generating)
    worker.start()
    for v in range(2, 6):
        while len(batches) < v - 1:  # at least one call per version, and updates mid-call
            stop.wait(0.001)
        engine.update_adapter(adapters[v].items(), CONFIG, v)
    stop.set()
    worker.join(timeout=120)
    assert not worker.is_alive()
    seen = set()
    for b in batches:
        versions = set(b.versions.tolist())
        assert len(versions) == 1
        (v,) = versions
        seen.add(v)
        assert same_rollouts(b, pure[v]), f"a batch recorded as version {v} is not version {v}'s output"
    assert len(seen) >= 3, seen


@pytest.mark.parametrize(
    "break_it, message",
    [
        (lambda a: a.pop("model.layers.1.mlp.down_proj.lora_B"),
         "adapter version 2: tensor 'model.layers.1.mlp.down_proj.lora_B' is missing"),
        (lambda a: a.__setitem__("model.layers.0.self_attn.v_proj.lora_A", torch.zeros(4, 65)),
         r"adapter version 2: tensor 'model.layers.0.self_attn.v_proj.lora_A' has shape \(4, 65\), expected \(4, 64\)"),
        (lambda a: a.__setitem__("model.layers.0.mlp.up_proj.lora_A", torch.zeros(4, 64)),
         "adapter version 2: tensor 'model.layers.0.mlp.up_proj.lora_A' has no slot in the engine's model"),
    ],
)
def test_a_bad_adapter_changes_nothing(break_it, message) -> None:
    model = tiny_model()
    engine = engine_for(model)
    engine.update_adapter(random_adapter(model, 1).items(), CONFIG, 1)
    before = generate(engine)
    bad = random_adapter(model, 2)
    break_it(bad)
    with pytest.raises(AdapterError, match=message):
        engine.update_adapter(bad.items(), CONFIG, 2)
    assert engine.weight_version == 1
    assert same_rollouts(generate(engine), before)


def test_bad_configs_are_refused() -> None:
    model = tiny_model()
    engine = engine_for(model)
    with pytest.raises(AdapterError, match=r"adapter targets \['qkv'\] match no nn.Linear module"):
        engine.adapter_slots({"rank": 4, "alpha": 8.0, "targets": ["qkv"]})
    with pytest.raises(AdapterError, match="rank > 0"):
        engine.update_adapter([], {"rank": 0, "alpha": 8.0, "targets": ["q_proj"]}, 1)
    assert engine.weight_version == 0


def test_new_base_weights_keep_the_adapter() -> None:
    model, other = tiny_model(0), tiny_model(1)
    adapter = random_adapter(model, 3)
    engine = engine_for(copy.deepcopy(model), dtype="float32")
    engine.update_adapter(adapter.items(), CONFIG, 1)
    engine.update_weights(other.state_dict().items(), 2)
    got = generate(engine)
    assert (got.versions == 2).all()
    want = generate(engine_for(merged_model(other, adapter)))
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=2e-5)
