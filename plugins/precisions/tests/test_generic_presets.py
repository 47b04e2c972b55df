"""Every precision and every in-process weight transport on every architecture of the
generic family ``hf`` (llama, qwen2, mistral, gemma3_text, phi3, olmo2, mixtral,
qwen2_moe): the engine (float32, a model of its own, as in another process) serves
exactly what the trainer computes with, so their logprobs agree to float32 round-off.

``broadcast`` needs engine processes (a collective between two sides) and is covered by
its own tests and the Ray launcher's; it moves the same named tensors as ``nixl``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from skyrl_models.hf import MOE_PRESETS, PRESETS

ALPHABET = "0123456789:"
PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8]]


@pytest.fixture(scope="module")
def host():
    from skyrl_host.plugins import build_host

    return build_host()


def create(host, kind: str, name: str, **options):
    reg = host.registry.get(kind, name)
    return reg.create(reg.config(**options) if reg.config else None)


def family(host, preset: str):
    return create(host, "models", "hf", preset=preset)


def replay_for(host, preset: str) -> list:
    return [create(host, "replay_strategies", "r3")] if preset in MOE_PRESETS else []


def engine_for(host, preset: str):
    return create(host, "engines", "embedded", dtype="float32", return_routed_experts=preset in MOE_PRESETS)


def step(host, backend, engine, seed: int) -> dict:
    """Generate on the engine, train on it: the trainer's pre-update logprobs vs the engine's."""
    batch = engine.generate(PROMPTS, n=4, sampler=create(host, "samplers", "temperature"), max_new_tokens=6, seed=seed)
    adv = np.random.default_rng(seed).standard_normal(batch.n_tokens).astype(np.float32)
    return backend.train_step(batch, adv, create(host, "algorithms", "grpo"), temperature=1.0, max_new_tokens=6)


PRECISIONS = {"fp8": {}, "fp8-rowwise": {"scaling": "rowwise"}, "mxfp8": {}, "int4": {}}


@pytest.mark.parametrize("precision_case", list(PRECISIONS))
@pytest.mark.parametrize("preset", list(PRESETS))
def test_each_precision_serves_the_trainers_numbers_through_delta(host, tmp_path, preset: str,
                                                                  precision_case: str) -> None:
    name = precision_case.split("-")[0]
    precision = create(host, "precisions", name, **PRECISIONS[precision_case])
    backend = create(host, "backends", "torch", lr=1e-2)
    backend.start(family(host, preset).load(alphabet=ALPHABET, seed=5), seed=0, total_steps=3, reference=False,
                  precision=precision, replay=replay_for(host, preset))
    assert precision.quantized, preset  # the preset's linear layers were found and quantized
    engine = engine_for(host, preset)
    engine.start(family(host, preset).load(alphabet=ALPHABET, seed=5), precision=precision)
    transport = create(host, "weight_transports", "delta", uri=f"file://{tmp_path}/w", dtype="float32")
    gaps = []
    for version in (1, 2):
        transport.publish(backend, engine, version)  # the quantized weights, through files
        gaps.append(step(host, backend, engine, seed=version)["logprob_diff_max"])
    assert max(gaps) < 1e-5, (preset, precision_case, gaps)


@pytest.mark.parametrize("transport_name", ["inproc", "delta", "nixl", "lora"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_each_transport_moves_what_the_trainer_learned(host, tmp_path, preset: str, transport_name: str) -> None:
    lora = transport_name == "lora"
    backend = create(host, "backends", "torch", lr=1e-2, **({"lora_rank": 4} if lora else {}))
    backend.start(family(host, preset).load(alphabet=ALPHABET, seed=5), seed=0, total_steps=3, reference=False,
                  replay=replay_for(host, preset))
    engine = engine_for(host, preset)
    engine.start(family(host, preset).load(alphabet=ALPHABET, seed=5))
    options = {"delta": {"uri": f"file://{tmp_path}/w", "dtype": "float32"}, "nixl": {"dtype": "float32"}}
    options = options.get(transport_name, {})  # float32 on the wire: the float32 engine gets the trainer's numbers
    transport = create(host, "weight_transports", transport_name, **options)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    gaps = [step(host, backend, engine, seed=1)["logprob_diff_max"]]  # version 0: the same initial weights
    transport.publish(backend, engine, 1)
    assert engine.weight_version == 1
    after = engine.model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    if lora:  # the base stays; the adapters arrived (the engine serves base + adapter: the gap below)
        assert not moved and engine.adapters.serving.bank.tensors, (preset, sorted(moved)[:3])
    else:  # the update reached the engine's own tensors: every parameter the trainer's step changed
        trained = {k for k, v in backend.named_weights() if not torch.equal(v.to(before[k].dtype), before[k])}
        assert trained and trained <= moved, (preset, transport_name, sorted(trained - moved)[:3])
    gaps.append(step(host, backend, engine, seed=2)["logprob_diff_max"])  # the engine on the trainer's version 1
    assert max(gaps) < 1e-5, (preset, transport_name, gaps)
