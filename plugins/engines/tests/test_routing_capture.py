"""Routing capture (``return_routed_experts``) and conversations continued with
``continue_turn``: the recorded expert ids are the ones a teacher-forced forward of
the same model chooses, for every prompt and generated token, through batching,
compaction and chunking; a continued conversation keeps its earlier routes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from skyrl_engines.embedded import Embedded, EmbeddedConfig
from skyrl_host.interfaces import LoadedModel
from skyrl_host.rollout import RolloutBatch
from skyrl_toolkit.routing import RouterHooks
from skyrl_samplers.processing import TruncatedSampler

ALPHABET = "0123456789+=:"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def family_model(skyrl_host, family: str, preset: str, seed: int = 0) -> LoadedModel:
    reg = skyrl_host.registry.get("models", family)
    return reg.create(reg.config(preset=preset)).load(alphabet=ALPHABET, seed=seed)


def teacher_forced_routes(loaded: LoadedModel, batch: RolloutBatch) -> list[np.ndarray]:
    """Each sequence's routes from one full forward (no cache, no padding), sorted per row."""
    hooks = RouterHooks(loaded.model, loaded.routers)
    out = []
    try:
        with torch.no_grad(), hooks.recording():
            for i in range(batch.n_sequences):
                loaded.model(torch.as_tensor(batch.sequence(i), dtype=torch.long)[None])
                out.append(np.sort(hooks.take().numpy(), axis=-1))
    finally:
        hooks.remove()
    return out


PRESETS = [("qwen", "tiny-moe"), ("kimi", "tiny-kimi"), ("glm", "tiny-glm4-moe"), ("nemotron", "tiny-nemotron-h")]


@pytest.mark.parametrize("family, preset", PRESETS)
def test_captured_routes_are_the_models_own(skyrl_host, family: str, preset: str) -> None:
    loaded = family_model(skyrl_host, family, preset)
    engine = Embedded(EmbeddedConfig(return_routed_experts=True, max_batch_size=5))  # chunks of 5 sequences
    engine.start(loaded)
    sampler = TruncatedSampler(temperature=1.0, top_p=0.95)
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11], [12], [4, 4]]
    batch = engine.generate(prompts, n=3, sampler=sampler, max_new_tokens=6, seed=3)
    routes = batch.side_channels["routed_experts"]
    L, k = len(loaded.routers), loaded.routers[0].top_k
    assert routes.shape == (batch.n_tokens, L, k) and routes.dtype == np.uint8
    assert (batch.response_lens < 6).any(), "some sequences should stop early (compaction)"
    want = teacher_forced_routes(loaded, batch)
    for i in range(batch.n_sequences):
        got = np.sort(routes[batch.cu_seqlens[i] : batch.cu_seqlens[i + 1]], axis=-1)
        # Every token but the last (never fed back to the model).
        np.testing.assert_array_equal(got[:-1], want[i][:-1], err_msg=f"sequence {i}")
        for row in got[:-1].reshape(-1, k):
            assert len(set(row.tolist())) == k  # k distinct experts per layer


def test_capture_leaves_generation_unchanged(skyrl_host) -> None:
    loaded = family_model(skyrl_host, "kimi", "tiny-kimi")
    plain, capturing = Embedded(EmbeddedConfig()), Embedded(EmbeddedConfig(return_routed_experts=True))
    plain.start(loaded)
    capturing.start(loaded)
    sampler = TruncatedSampler(top_p=0.9)
    a = plain.generate([[3, 4], [5, 6, 7]], n=4, sampler=sampler, max_new_tokens=5, seed=1)
    b = capturing.generate([[3, 4], [5, 6, 7]], n=4, sampler=sampler, max_new_tokens=5, seed=1)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert "routed_experts" not in a.side_channels


def test_expert_dtype_is_the_smallest_that_holds_the_ids() -> None:
    from skyrl_toolkit.routing import expert_dtype

    assert expert_dtype(8) == np.uint8 and expert_dtype(256) == np.uint8
    assert expert_dtype(257) == np.uint16 and expert_dtype(384) == np.uint16
    assert expert_dtype(70000) == np.uint32


def test_dense_model_is_refused(skyrl_host) -> None:
    loaded = family_model(skyrl_host, "qwen", "tiny")
    engine = Embedded(EmbeddedConfig(return_routed_experts=True))
    with pytest.raises(ValueError, match="no MoE routers"):
        engine.start(loaded)


def test_continue_turn_keeps_the_earlier_routes(skyrl_host) -> None:
    """Between turns the router's correction bias changes (as DeepSeek-style load
    balancing does during training), so re-routing the history would choose other
    experts. The engine keeps the history's recorded routes instead, and only the new
    turn's rows come back."""
    loaded = family_model(skyrl_host, "kimi", "tiny-kimi")
    engine = Embedded(EmbeddedConfig(return_routed_experts=True, dtype="float32"))
    engine.start(loaded)
    sampler = TruncatedSampler(top_p=0.95, return_support=True)
    turn1 = engine.generate([[3, 4, 5], [6, 7]], n=2, sampler=sampler, max_new_tokens=5, seed=1)
    gen = torch.Generator().manual_seed(0)
    for info in loaded.routers:  # a new bias buffer in the engine's module only (the trainer's model keeps its own)
        gate = engine.model.get_submodule(info.path)
        gate.e_score_correction_bias = 0.1 * torch.randn(info.n_experts, generator=gen)
    observation = [[10, 11], [12], [10, 11], [12]]
    seg = engine.continue_turn(turn1, observation, sampler=sampler, max_new_tokens=4, seed=2)
    # The segment: the history's last token, the observation, the response; rows for these only.
    assert seg.n_sequences == 4
    np.testing.assert_array_equal(seg.prompt_lens, [3, 2, 3, 2])
    assert seg.side_channels["routed_experts"].shape[0] == seg.n_tokens
    assert seg.side_channels["sample_support"].n_rows == int(seg.loss_mask.sum())
    conv = turn1.append_turn(seg)
    assert conv.n_tokens == turn1.n_tokens + seg.n_tokens - 4
    routes = conv.side_channels["routed_experts"]
    for i in range(4):
        start = conv.cu_seqlens[i]
        old = turn1.side_channels["routed_experts"][turn1.cu_seqlens[i] : turn1.cu_seqlens[i + 1] - 1]
        np.testing.assert_array_equal(routes[start : start + len(old)], old)
    # Re-routing the history with the new bias would have chosen differently.
    hooks = RouterHooks(engine.model, loaded.routers)
    changed = 0
    with torch.no_grad(), hooks.recording():
        for i in range(4):
            engine.model(torch.as_tensor(turn1.sequence(i), dtype=torch.long)[None])
            rerouted = np.sort(hooks.take().numpy(), axis=-1)[:-1]
            old = np.sort(turn1.side_channels["routed_experts"][turn1.cu_seqlens[i] : turn1.cu_seqlens[i + 1] - 1], axis=-1)
            changed += int((rerouted != old).any(axis=(1, 2)).sum())
    hooks.remove()
    assert changed > 0
    # A segment for other conversations is refused.
    with pytest.raises(ValueError, match="does not continue conversation"):
        turn1.select([1, 0, 2, 3]).append_turn(seg)
