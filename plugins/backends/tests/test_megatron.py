"""The megatron backend (issue 18) against the torch backend, on the qwen family's presets:
the same job, the same initial weights, float32: equal losses, logprobs, gradient norms and
weights step after step; r3 through megatron-core's routing replay and support scoring
give the engine's logprobs; the weights leave with the transformers model's names; a
checkpoint resumes exactly; what the backend cannot build is refused with a message."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from skyrl_engines.embedded import Embedded, EmbeddedConfig
from skyrl_host.rollout import CSR, RolloutBatch
from skyrl_samplers.processing import TruncatedSampler

ALPHABET = "0123456789:"
PROMPTS = [[3, 4, 5], [6, 7, 8, 9], [12], [4, 4, 10, 11, 3]]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="module")
def released_parallel_state():
    """The megatron backend starts a one-process torch.distributed group for megatron-core;
    later tests in this process must not find it (they would read it as a launcher's)."""
    yield
    from skyrl_backends.megatron_backend import release_parallel_state

    release_parallel_state()


def load(skyrl_host, preset: str, seed: int = 0):
    """A qwen preset, or ``glm:PRESET``: a glm one, its routers given a correction bias
    of their own (so it changes which experts they choose)."""
    family, _, preset = preset.rpartition(":")
    reg = skyrl_host.registry.get("models", family or "qwen")
    loaded = reg.create(reg.config(preset=preset)).load(alphabet=ALPHABET, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in loaded.model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))
    return loaded


def backend(skyrl_host, name: str, loaded, replay=(), reference: bool = False, steps: int = 10, **options):
    reg = skyrl_host.registry.get("backends", name)
    be = reg.create(reg.config(lr=1e-3, **options))
    be.start(loaded, seed=0, total_steps=steps, reference=reference, replay=list(replay))
    return be


def strategy(skyrl_host, name: str, **options):
    """The replay strategy ``name`` as a job gets it (the registry: r3, support)."""
    reg = skyrl_host.registry.get("replay_strategies", name)
    return reg.create(reg.config(**options) if reg.config else None)


def algorithm(skyrl_host, **options):
    reg = skyrl_host.registry.get("algorithms", "grpo")
    return reg.create(reg.config(**options))


def random_batch(vocab: int, seed: int, n: int = 12) -> RolloutBatch:
    """``n`` sequences of uneven lengths over the whole vocabulary (the padding id too),
    engine logprobs near a random model's, rewards."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, rng.integers(2, 7)).tolist() for _ in range(n)]
    responses = [rng.integers(0, vocab, rng.integers(1, 9)).tolist() for _ in range(n)]
    lps = [(-2.6 + 0.05 * rng.standard_normal(len(r))).tolist() for r in responses]
    batch = RolloutBatch.from_sequences(prompts, responses, lps, group_ids=[i // 4 for i in range(n)])
    batch.rewards = rng.random(n).astype(np.float32)
    return batch


def train(skyrl_host, be, batch, algo, temperature: float = 1.0) -> dict:
    adv = np.asarray(algo.advantages(batch, batch.rewards), dtype=np.float32)
    return be.train_step(batch, adv, algo, temperature=temperature, max_new_tokens=8)


def logprobs(be, batch, temperature: float = 1.0) -> np.ndarray:
    """The policy's logprobs of the batch's loss tokens (no update), as the train step computes them."""
    out = np.zeros(batch.n_tokens, dtype=np.float32)
    with torch.no_grad():
        for micros in be._plan(batch, np.zeros(batch.n_tokens, dtype=np.float32)):
            for mb in micros:
                if mb.n_loss:
                    with be._replaying(mb):
                        out[mb.batch_idx] = be._logprobs(be._lm, mb, temperature)[0].cpu().numpy()
    return out


def generate(loaded, *, routes: bool = True, sampler=None, seed: int = 1):
    eng = Embedded(EmbeddedConfig(return_routed_experts=routes, share_weights=False))
    eng.start(loaded)
    sampler = sampler or TruncatedSampler(temperature=1.0)
    return eng.generate(PROMPTS, n=3, sampler=sampler, max_new_tokens=6, seed=seed)


# -- parity with the torch backend ------------------------------------------------------------


@pytest.mark.parametrize("preset, options", [
    ("tiny", {}),
    ("tiny", {"mini_batches": 2, "micro_batch_tokens": 24, "pack_length": 16, "max_grad_norm": 0.5}),
    ("tiny-moe", {}),
    ("tiny-moe", {"gradient_checkpointing": True, "micro_batch_tokens": 24, "pack_length": 16}),
    # GLM-4.5's architecture: partial RoPE, a dense first layer, a shared expert, a sigmoid
    # router with a correction bias, group-limited top-k (2 groups, 1 chosen), scaling 2.5
    ("glm:tiny-glm4-moe", {}),
    # Kimi K2's architecture: multi-latent attention (one sequence a row), 4 expert groups of
    # which each token uses 2, each scored by its best 2 experts (megatron-core's own rule
    # would take top_k / 2 = 1: the backend's router replay object scores them as the model does)
    ("kimi:tiny-kimi", {}),
    # The generic family's dense GQA decoders: Llama (no q/k norms), Qwen2 (biases on q, k and v), Mistral
    ("hf:tiny-llama", {}),
    ("hf:tiny-qwen2", {}),
    ("hf:tiny-mistral", {}),
])
def test_ten_steps_equal_the_torch_backend(skyrl_host, preset: str, options: dict) -> None:
    """Per step: loss, entropy, grad norm and logprobs within 1e-5, and the weights (by
    their Hugging Face names) after each update."""
    loaded = {name: load(skyrl_host, preset) for name in ("torch", "megatron")}
    vocab = loaded["torch"].model.config.vocab_size
    algo = algorithm(skyrl_host)
    bes = {name: backend(skyrl_host, name, loaded[name], **options) for name in loaded}
    for step in range(10):
        batch = random_batch(vocab, seed=step)
        before = {name: logprobs(be, batch) for name, be in bes.items()}
        np.testing.assert_allclose(before["megatron"], before["torch"], atol=1e-5, rtol=0, err_msg=f"step {step}")
        metrics = {name: train(skyrl_host, be, batch, algo) for name, be in bes.items()}
        for key in ("loss", "entropy", "grad_norm", "logprob_diff_mean", "updates", "loss_tokens"):
            assert metrics["megatron"][key] == pytest.approx(metrics["torch"][key], rel=1e-5, abs=1e-6), (step, key)
        assert metrics["torch"]["grad_norm"] > 0.01
    weights = {name: dict(be.named_weights()) for name, be in bes.items()}
    assert sorted(weights["megatron"]) == sorted(weights["torch"])
    # (lr 1e-3: Adam's m / sqrt(v) turns round-off in a near-zero gradient into a visible
    # step, so the weights are held to 3% of lr: the torch backend's flat row and megatron's
    # padded rows round differently; 2.1e-5 seen on "tiny")
    gaps = {k: float((weights["megatron"][k] - v).abs().max()) for k, v in weights["torch"].items()}
    assert max(gaps.values()) <= 3e-5, sorted(gaps.items(), key=lambda kv: -kv[1])[:3]
    initial = loaded["megatron"].model.state_dict()  # (the megatron backend trains its own copy)
    assert max(float((v - initial[k]).abs().max()) for k, v in weights["megatron"].items()) > 5e-3


def test_bf16_autocast_stays_near_the_torch_backend(skyrl_host) -> None:
    """compute_dtype = "bfloat16" autocasts both backends' forwards: not bitwise equal
    (different kernels round differently), near each other and far closer than to fp32's."""
    batch = random_batch(13, seed=0)
    lp = {}
    for name, dtype in (("torch", "bfloat16"), ("megatron", "bfloat16"), ("fp32", "float32")):
        be = backend(skyrl_host, "torch" if name == "fp32" else name, load(skyrl_host, "tiny"), compute_dtype=dtype)
        lp[name] = logprobs(be, batch)[batch.loss_mask != 0]
    gap = np.abs(lp["megatron"] - lp["torch"]).mean()
    assert gap < 0.02 and np.abs(lp["torch"] - lp["fp32"]).mean() > 1e-4


def deepseek_v3(seed: int = 0, interleave: bool = True, q_lora: int | None = 32):
    """A tiny DeepSeek-V3 / Kimi K2 (multi-latent attention, sigmoid router with a random
    correction bias, a dense first layer, a shared expert), one expert group as Kimi K2 has."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from skyrl_host.interfaces import LoadedModel

    cfg = DeepseekV3Config(
        hidden_size=64, num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=2.827,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, vocab_size=32, max_position_embeddings=128,
        rope_interleave=interleave,
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))
    return LoadedModel(model=model, tokenizer=None, stop_token_ids=[1], family="test")


@pytest.mark.parametrize("interleave, q_lora", [(True, 32), (False, None)])
def test_multi_latent_attention_equals_the_torch_backend(skyrl_host, interleave: bool, q_lora) -> None:
    """DeepSeek-V3 / Kimi K2's multi-latent attention on megatron-core's MLASelfAttention
    (query and key/value latents, the decoupled rotary part; checkpoints with interleaved
    rotary pairs, and with halves and no query latent), one sequence a row: 5 steps equal
    the torch backend's (loss, entropy, grad norm, logprobs 1e-5)."""
    algo = algorithm(skyrl_host)
    bes = {name: backend(skyrl_host, name, deepseek_v3(interleave=interleave, q_lora=q_lora), steps=5)
           for name in ("torch", "megatron")}
    assert bes["megatron"]._pack_length == 1
    for step in range(5):
        batch = random_batch(32, seed=step)
        before = {name: logprobs(be, batch) for name, be in bes.items()}
        np.testing.assert_allclose(before["megatron"], before["torch"], atol=1e-5, rtol=0, err_msg=f"step {step}")
        metrics = {name: train(skyrl_host, be, batch, algo) for name, be in bes.items()}
        for key in ("loss", "entropy", "grad_norm", "logprob_diff_mean"):
            assert metrics["megatron"][key] == pytest.approx(metrics["torch"][key], rel=1e-5, abs=1e-6), (step, key)
    weights = {name: dict(be.named_weights()) for name, be in bes.items()}
    assert sorted(weights["megatron"]) == sorted(weights["torch"])
    # Held to 3% of lr as in the parity test above (Adam turns a near-zero gradient's
    # round-off into a step): 2.14e-5 seen on an AVX-512 EPYC after 5 steps.
    for k, v in weights["torch"].items():
        assert float((weights["megatron"][k] - v).abs().max()) <= 3e-5, k


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}


def scaled_rope_model(kind: str, rope: dict, seed: int = 0):
    """A tiny transformers model of ``kind`` (qwen3; glm4_moe: partial RoPE, MoE; deepseek_v3:
    multi-latent attention) whose RoPE is scaled as ``rope`` says."""
    import transformers

    from skyrl_host.interfaces import LoadedModel

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=32, max_position_embeddings=128,
                  rope_parameters=dict(rope))
    if kind == "qwen3":
        cfg = transformers.Qwen3Config(num_key_value_heads=2, head_dim=16, intermediate_size=128, **common)
        model = transformers.Qwen3ForCausalLM
    elif kind == "glm4_moe":
        cfg = transformers.Glm4MoeConfig(
            num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, use_qk_norm=True, **common,
        )
        cfg.rope_parameters["partial_rotary_factor"] = 0.5
        model = transformers.Glm4MoeForCausalLM
    else:
        cfg = transformers.DeepseekV3Config(
            num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, **common,
        )
        model = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    return LoadedModel(model=model(cfg), tokenizer=None, stop_token_ids=[1], family="test")


@pytest.mark.parametrize("kind, rope", [
    ("qwen3", YARN),
    ("qwen3", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    ("glm4_moe", YARN),  # (yarn over the rotated half of each head)
    # DeepSeek-V3's and Kimi K2's published kind: mscale = mscale_all_dim (the softmax sharpened too)
    ("deepseek_v3", dict(YARN, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)),
    ("deepseek_v3", dict(YARN, mscale=0.707, mscale_all_dim=1.0)),
])
def test_scaled_rope_equals_the_torch_backend(skyrl_host, kind: str, rope: dict) -> None:
    """Long-context RoPE (yarn: the blended frequencies, the attention factor on cos and sin,
    DeepSeek-V3's softmax scale; linear): logprobs and 3 steps equal the torch backend's, and
    the scaling matters (the same weights under plain RoPE score the batch differently)."""
    algo = algorithm(skyrl_host)
    bes = {name: backend(skyrl_host, name, scaled_rope_model(kind, rope), steps=3) for name in ("torch", "megatron")}
    plain = backend(skyrl_host, "megatron", scaled_rope_model(kind, {"rope_type": "default", "rope_theta": 10000.0}), steps=3)
    batch = random_batch(32, seed=0)
    assert np.abs(logprobs(plain, batch) - logprobs(bes["torch"], batch)).max() > 1e-3
    for step in range(3):
        batch = random_batch(32, seed=step)
        before = {name: logprobs(be, batch) for name, be in bes.items()}
        np.testing.assert_allclose(before["megatron"], before["torch"], atol=1e-5, rtol=0, err_msg=f"step {step}")
        metrics = {name: train(skyrl_host, be, batch, algo) for name, be in bes.items()}
        for key in ("loss", "grad_norm"):
            assert metrics["megatron"][key] == pytest.approx(metrics["torch"][key], rel=1e-5, abs=1e-6), (step, key)


def precision(skyrl_host, name: str, **options):
    reg = skyrl_host.registry.get("precisions", name)
    return reg.create(reg.config(**options))


def quantized_pair(skyrl_host, preset: str, name: str, options: dict):
    """The torch and the megatron backend on the same initial weights with precision
    ``name``, reference policies included; and the megatron backend without it."""
    bes = {}
    for be_name in ("torch", "megatron"):
        reg = skyrl_host.registry.get("backends", be_name)
        bes[be_name] = reg.create(reg.config(lr=1e-3))
        bes[be_name].start(load(skyrl_host, preset), seed=0, total_steps=3, reference=True, replay=[],
                           precision=precision(skyrl_host, name, **options))
    return bes, backend(skyrl_host, "megatron", load(skyrl_host, preset), steps=3)


@pytest.mark.parametrize("preset, name, options", [
    ("tiny", "fp8", {"activations": False}),  # weights in 128x128 blocks
    ("tiny-moe", "fp8", {"activations": False}),
    ("tiny-moe", "fp8", {"activations": False, "keep": ["o_proj"]}),
    ("tiny-moe", "mxfp8", {"activations": False}),
    ("tiny", "int4", {}),
    ("glm:tiny-glm4-moe", "mxfp8", {"activations": False}),  # (a shared expert; the q/k/v biases stay)
    ("kimi:tiny-kimi", "fp8", {"activations": False}),  # (multi-latent attention's projections)
])
def test_quantized_weights_equal_the_torch_backend(skyrl_host, preset: str, name: str, options: dict) -> None:
    """A weight-quantizing precision on megatron-core's fused layers computes the numbers
    the torch backend computes on the transformers model's separate ones (quantized in
    their layout), from the same weights: logprobs of 3 batches and the reference policy's
    within 1e-5, a step's loss and grad norm; and the precision changes them (against the
    same weights in float32). (Not step after step: one float32 ulp between the two
    backends' updated masters can move a weight across a quantization boundary; after a
    step the engine test below holds the trainer to the engine's numbers.)"""
    bes, plain = quantized_pair(skyrl_host, preset, name, options)
    vocab = int(bes["megatron"].arch.vocab)
    batch = random_batch(vocab, seed=0)
    assert np.abs(logprobs(plain, batch) - logprobs(bes["megatron"], batch)).max() > 1e-3
    for seed in range(3):
        batch = random_batch(vocab, seed=seed)
        before = {n: logprobs(be, batch) for n, be in bes.items()}
        np.testing.assert_allclose(before["megatron"], before["torch"], atol=1e-5, rtol=0, err_msg=f"batch {seed}")
        ref = {n: be.reference_logprobs(batch, temperature=1.0) for n, be in bes.items()}
        np.testing.assert_allclose(ref["megatron"], ref["torch"], atol=1e-5, rtol=0, err_msg=f"batch {seed}")
    metrics = {n: train(skyrl_host, be, batch, algorithm(skyrl_host)) for n, be in bes.items()}
    for key in ("loss", "grad_norm"):
        assert metrics["megatron"][key] == pytest.approx(metrics["torch"][key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("preset, name", [("tiny-moe", "fp8"), ("tiny-moe", "mxfp8"), ("kimi:tiny-kimi", "fp8")])
def test_quantized_activations_match_the_torch_backend_but_for_rounding_flips(skyrl_host, preset: str, name: str) -> None:
    """With activations quantized too, the two backends' inputs to a layer differ by float32
    round-off (fused vs separate matmuls, other attention kernels), and now and then that
    moves an element across an e4m3 rounding boundary: most tokens' logprobs are equal
    (<= 1e-5), the mean gap stays under 2% of what the quantization itself changes."""
    bes, plain = quantized_pair(skyrl_host, preset, name, {})
    vocab = int(bes["megatron"].arch.vocab)
    gaps, effects = [], []
    for seed in range(3):
        batch = random_batch(vocab, seed=seed)
        lp = {n: logprobs(be, batch)[batch.loss_mask != 0] for n, be in bes.items()}
        gaps.append(np.abs(lp["megatron"] - lp["torch"]))
        effects.append(np.abs(logprobs(plain, batch)[batch.loss_mask != 0] - lp["megatron"]))
    gap, effect = np.concatenate(gaps), np.concatenate(effects)
    assert np.mean(gap <= 1e-5) >= 0.9, np.sort(gap)[-10:]
    assert gap.mean() < 0.02 * effect.mean(), (gap.mean(), effect.mean())


@pytest.mark.parametrize("name, options", [("fp8", {"activations": False}), ("int4", {})])
def test_a_float32_engine_computes_the_quantized_megatron_trainers_numbers(skyrl_host, name: str, options: dict) -> None:
    """serving_weights gives an engine (a float32 model of its own) the quantized weights
    the megatron trainer computed with: the gap is round-off, while the same engine handed
    the float32 masters is off by orders of magnitude."""
    prec = precision(skyrl_host, name, **options)
    reg = skyrl_host.registry.get("backends", "megatron")
    be = reg.create(reg.config(lr=1e-3))
    be.start(load(skyrl_host, "tiny-moe", seed=5), seed=0, total_steps=3, reference=False, precision=prec)
    algo = algorithm(skyrl_host)
    train(skyrl_host, be, random_batch(13, seed=1), algo)  # (weights the engine has not seen)
    gaps = {}
    for served in ("quantized", "masters"):
        eng = Embedded(EmbeddedConfig(dtype="float32", share_weights=False))
        eng.start(load(skyrl_host, "tiny-moe", seed=5), precision=prec if served == "quantized" else None)
        eng.update_weights(be.serving_weights() if served == "quantized" else be.named_weights(), 1)
        batch = eng.generate(PROMPTS, n=3, sampler=TruncatedSampler(temperature=1.0), max_new_tokens=6, seed=0)
        batch.rewards = np.zeros(batch.n_sequences, np.float32)
        gaps[served] = train(skyrl_host, be, batch, algo)["logprob_diff_max"]
    assert gaps["quantized"] < 1e-5, gaps
    assert gaps["masters"] > 100 * max(gaps["quantized"], 1e-6), gaps


def test_the_padding_row_learns_only_through_the_head(skyrl_host) -> None:
    """transformers' embedding has padding_idx (that row gets no gradient from its lookups;
    its zero initial row would otherwise meet RMSNorm's 1/sqrt(eps) gradient). The
    megatron backend keeps the rule: the same gradient norm on a batch full of padding ids."""
    loaded = {name: load(skyrl_host, "tiny") for name in ("torch", "megatron")}
    pad = loaded["torch"].model.get_input_embeddings().padding_idx
    assert pad is not None
    rng = np.random.default_rng(0)
    prompts = [[pad, 3, pad, 4], [5, pad, pad], [pad, 6]]
    responses = [[pad, 7], [8, pad, 9], [pad]]
    batch = RolloutBatch.from_sequences(prompts, responses, [[-2.5] * len(r) for r in responses], group_ids=[0, 0, 0])
    batch.rewards = rng.random(3).astype(np.float32)
    algo = algorithm(skyrl_host)
    norms = {name: train(skyrl_host, backend(skyrl_host, name, loaded[name]), batch, algo)["grad_norm"] for name in loaded}
    assert norms["megatron"] == pytest.approx(norms["torch"], rel=1e-5)


# -- replay ----------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["glm:tiny-glm4-moe", "kimi:tiny-kimi"])
def test_r3_on_sigmoid_routers_gives_the_engines_logprobs(skyrl_host, preset: str) -> None:
    """GLM-4.5's and Kimi K2's sigmoid, bias-corrected, group-limited routers: with r3 the
    megatron trainer's logprobs are the engine's (<= 1e-5)."""
    batch = generate(load(skyrl_host, preset))
    assert batch.side_channels["routed_experts"].shape[1:] == (2, 2)  # the two MoE layers (layer 0 is dense)
    be = backend(skyrl_host, "megatron", load(skyrl_host, preset), replay=[strategy(skyrl_host, "r3")])
    batch.rewards = np.random.default_rng(0).random(batch.n_sequences).astype(np.float32)
    metrics = train(skyrl_host, be, batch, algorithm(skyrl_host))
    assert metrics["logprob_diff_max"] <= 1e-5, metrics["logprob_diff_max"]


def test_r3_gives_the_engines_logprobs_through_megatron_core_routing_replay(skyrl_host) -> None:
    """tiny-moe, fp32: with r3 the megatron trainer's logprobs are the engine's (<= 1e-5).
    With routes that are not the router's own (random experts in the side channel) both
    backends score the same tokens through the same experts: equal logprobs, far from
    the unforced ones."""
    loaded = load(skyrl_host, "tiny-moe")
    batch = generate(loaded)
    routes = batch.side_channels["routed_experts"]
    assert routes.shape[1:] == (len(loaded.routers), loaded.routers[0].top_k)
    be = backend(skyrl_host, "megatron", load(skyrl_host, "tiny-moe"), replay=[strategy(skyrl_host, "r3")])
    batch.rewards = np.random.default_rng(0).random(batch.n_sequences).astype(np.float32)
    metrics = train(skyrl_host, be, batch, algorithm(skyrl_host))
    assert metrics["logprob_diff_max"] <= 1e-5, metrics["logprob_diff_max"]

    rng = np.random.default_rng(3)
    E, k = loaded.routers[0].n_experts, routes.shape[2]
    forced = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(routes.shape[1])])
                       for _ in range(batch.n_tokens)]).astype(routes.dtype)
    batch.side_channels["routed_experts"] = forced
    got = {}
    for name in ("torch", "megatron"):
        be = backend(skyrl_host, name, load(skyrl_host, "tiny-moe"), replay=[strategy(skyrl_host, "r3")],
                     micro_batch_tokens=24, pack_length=16)
        got[name] = logprobs(be, batch)
        # and a train step through the forced routes, recomputed in the backward pass
        got[name + "-step"] = train(skyrl_host, backend(skyrl_host, name, load(skyrl_host, "tiny-moe"), replay=[strategy(skyrl_host, "r3")],
                                                        gradient_checkpointing=True), batch, algorithm(skyrl_host))
    free = logprobs(backend(skyrl_host, "megatron", load(skyrl_host, "tiny-moe")), batch)
    mask = batch.loss_mask != 0
    np.testing.assert_allclose(got["megatron"][mask], got["torch"][mask], atol=1e-5, rtol=0)
    for key in ("loss", "grad_norm", "logprob_diff_mean"):
        assert got["megatron-step"][key] == pytest.approx(got["torch-step"][key], rel=1e-5), key
    assert np.abs(got["megatron"][mask] - free[mask]).max() > 1e-2


def test_support_scores_over_the_kept_sets(skyrl_host) -> None:
    """Top-p 0.7: over the kept sets the megatron trainer's logprobs are the engine's
    (<= 1e-5); over the whole vocabulary they are off by the kept mass."""
    out = {}
    for name, replay in (("none", []), ("support", [strategy(skyrl_host, "support", chunk=50)])):
        loaded = load(skyrl_host, "tiny")
        batch = generate(loaded, routes=False, sampler=TruncatedSampler(temperature=0.9, top_p=0.7, return_support=True))
        assert isinstance(batch.side_channels["sample_support"], CSR)
        batch.rewards = np.random.default_rng(0).random(batch.n_sequences).astype(np.float32)
        be = backend(skyrl_host, "megatron", load(skyrl_host, "tiny"), replay=replay)
        out[name] = train(skyrl_host, be, batch, algorithm(skyrl_host), temperature=0.9)
    assert out["none"]["logprob_diff_mean"] > 0.05
    assert out["support"]["logprob_diff_max"] <= 1e-5
    assert out["support"]["entropy"] < out["none"]["entropy"]


def test_replay_refusals_name_the_problem(skyrl_host) -> None:
    with pytest.raises(ValueError, match="r3.*mixture-of-experts"):
        backend(skyrl_host, "megatron", load(skyrl_host, "tiny"), replay=[strategy(skyrl_host, "r3")])
    be = backend(skyrl_host, "megatron", load(skyrl_host, "tiny-moe"), replay=[strategy(skyrl_host, "r3")])
    batch = random_batch(13, seed=0)
    with pytest.raises(ValueError, match="routed_experts.*return_routed_experts"):
        train(skyrl_host, be, batch, algorithm(skyrl_host))
    batch.side_channels["routed_experts"] = np.zeros((batch.n_tokens, 1, 1), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"must be \[tokens, 2 MoE layers, top_k 2\]"):
        train(skyrl_host, be, batch, algorithm(skyrl_host))


# -- weights and checkpoints --------------------------------------------------------------------


def test_weights_leave_with_the_transformers_names_and_a_checkpoint_resumes_exactly(skyrl_host, tmp_path) -> None:
    """named_weights is the transformers model's state dict (names, shapes, values at
    start); state_dict/load_state_dict and the distributed checkpoint (save_checkpoint /
    load_checkpoint) restore the model, AdamW and the schedule: the resumed backends' next
    steps equal the uninterrupted one's bit for bit."""
    loaded = load(skyrl_host, "tiny-moe")
    start = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    algo = algorithm(skyrl_host)
    be = backend(skyrl_host, "megatron", loaded, reference=True)
    named = dict(be.named_weights())
    assert sorted(named) == sorted(start)
    for k, v in start.items():
        assert torch.equal(named[k], v), k
    for step in range(2):
        train(skyrl_host, be, random_batch(13, seed=step), algo)
    path = tmp_path / "state.pt"
    torch.save(be.state_dict(), path)  # (the in-memory state: what checkpoints of an earlier version hold)
    be.save_checkpoint(str(tmp_path / "dist"))  # (megatron-core's distributed checkpoint: what jobs write)
    resumed = backend(skyrl_host, "megatron", load(skyrl_host, "tiny-moe"), reference=True)
    resumed.load_state_dict(torch.load(path, weights_only=False))
    from_dist = backend(skyrl_host, "megatron", load(skyrl_host, "tiny-moe"), reference=True)
    from_dist.load_checkpoint(str(tmp_path / "dist"))
    assert resumed.steps == from_dist.steps == 2
    for step in (2, 3):
        batch = random_batch(13, seed=step)
        a, b, c = (train(skyrl_host, x, batch, algo) for x in (be, resumed, from_dist))
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"]) \
            == (c["loss"], c["grad_norm"], c["lr"])
    for (k, v), (k2, v2), (k3, v3) in zip(be.named_weights(), resumed.named_weights(), from_dist.named_weights()):
        assert k == k2 == k3 and torch.equal(v, v2) and torch.equal(v, v3), k
    # A torn or foreign folder is refused with what is wrong, before anything is applied.
    before = {k: v.clone() for k, v in from_dist.named_weights()}
    moments = [s["exp_avg"].clone() for s in from_dist.optimizer.state.values()]
    shard = next((tmp_path / "dist").glob("*.distcp"))
    shard.unlink()
    with pytest.raises(ValueError, match=r"cannot be read: rank 0: FileNotFoundError: .*No such file.*\.distcp"):
        from_dist.load_checkpoint(str(tmp_path / "dist"))
    assert all(torch.equal(v, before[k]) for k, v in from_dist.named_weights())
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(from_dist.optimizer.state.values(), moments))
    with pytest.raises(ValueError, match="not a megatron-core distributed checkpoint"):
        from_dist.load_checkpoint(str(tmp_path))
    # The reference policy is the initial model, apart from the trained one.
    ref = backend(skyrl_host, "torch", load(skyrl_host, "tiny-moe"), reference=True)
    batch = random_batch(13, seed=9)
    np.testing.assert_allclose(be.reference_logprobs(batch, temperature=1.0),
                               ref.reference_logprobs(batch, temperature=1.0), atol=1e-5, rtol=0)


def test_an_unmapped_model_is_refused_with_what_is_missing(skyrl_host) -> None:
    from skyrl_host.errors import UserError

    with pytest.raises(UserError, match=r"cannot build this model: model_type 'qwen3_next' is not mapped"):
        backend(skyrl_host, "megatron", load(skyrl_host, "tiny-qwen3-next"))
    # The generic family: what megatron-core's GPT model cannot express is named.
    with pytest.raises(UserError, match=r"model_type 'phi3' is not mapped onto megatron-core"):
        backend(skyrl_host, "megatron", load(skyrl_host, "hf:tiny-phi3"))



# -- tensor, expert and data parallelism across gloo processes ------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tp", "ep", "tp:fp8", "ep:mxfp8", "tp+support", "tp-mla", "tp-mla+r3", "tp+dp", "ep+dp", "tp-ep"])
def test_two_model_parallel_ranks_equal_one(mode: str, mcore_worker) -> None:
    """tensor_parallel = 2 (dense, each rank the whole batch, a vocabulary-parallel head
    whose log-softmax reduces across the ranks) and expert_parallel = 2 (MoE, each rank
    half of every batch and half of the experts) train as one process does: loss, entropy,
    grad norm within 1e-5 for 3 clipped steps, logprobs (tp) and the gathered weights by
    their Hugging Face names. With a precision (weights and activations quantized): each
    rank's quantized weights cut from the whole transformers weights' blocks, a row-parallel
    layer's input quantized in whole rows (lr 1e-9, and most tokens within 1e-5: see
    mcore_worker.train). With support replay under tensor parallelism:
    each rank scores the kept ids in its vocabulary rows, the log-softmax's max and sums
    reduced over the ranks. DeepSeek-V3's attention and MoE layers under tensor (and
    sequence) parallelism, also replaying random routes with r3 (each rank its slice of
    the sequence's). Two data-parallel replicas of a TP = 2 model (4 ranks, each replica
    half of the sequences) and of an EP = 2 model (4 ranks: the dense weights in four
    replicas, each expert in two), their gradients summed over the replicas. TP = 2 and
    EP = 2 together (4 ranks: each expert-parallel rank half of the sequences and of the
    experts, each expert split over the tensor-parallel pair)."""
    import pathlib

    from skyrl_host.testing import run_gloo_ranks

    world = 4 if "+dp" in mode or mode == "tp-ep" else 2
    ranks = run_gloo_ranks(pathlib.Path(__file__).with_name("mcore_worker.py"), "train", world, mode, timeout=300)
    one = mcore_worker.train(0, 1, mode)
    layouts = {"tp+dp": ({"tensor_parallel": 2, "expert_parallel": 1, "data_parallel": 2}, [(0, 2), (0, 2), (1, 2), (1, 2)]),
               "ep+dp": ({"tensor_parallel": 1, "expert_parallel": 2, "data_parallel": 2}, [(0, 4), (1, 4), (2, 4), (3, 4)]),
               "tp-ep": ({"tensor_parallel": 2, "expert_parallel": 2}, [(0, 2), (0, 2), (1, 2), (1, 2)])}
    if ":" in mode:
        # The quantized weights of each version come from the weight sync's gather of it: the first
        # forward's, one per step's sync and the final weights' (without the reuse each later step's first
        # forward gathers its version again: 7).
        assert [r["gathers"] for r in ranks] == [1 + 3 + 1] * len(ranks)
    if mode in layouts:  # (the layout each rank runs, and its data-parallel share)
        assert [r["layout"] for r in ranks] == [layouts[mode][0]] * 4
        assert [tuple(r["data_parallel"]) for r in ranks] == layouts[mode][1]
    for step, want in enumerate(one["metrics"]):
        for r in ranks:
            # (grad_norm to 1e-4: the one process's clip_grad_norm_ sums squares in float32,
            # the model-parallel ranks' in float64)
            for key, rel in (("loss", 1e-5), ("entropy", 1e-5), ("grad_norm", 1e-4), ("loss_tokens", 0)):
                assert r["metrics"][step][key] == pytest.approx(want[key], rel=rel, abs=1e-6), (mode, step, key)
        if mode.startswith("tp") and ":" not in mode:
            for r in ranks:
                np.testing.assert_allclose(r["logprobs"][step], one["logprobs"][step], atol=1e-5, rtol=0)
        elif mode.startswith("tp"):  # activations quantized: the layouts' round-off may flip an e4m3 rounding
            for r in ranks:
                gap = np.abs(r["logprobs"][step] - one["logprobs"][step])
                assert np.mean(gap <= 1e-5) >= 0.9 and gap.mean() < 1e-4, (step, np.sort(gap)[-5:])
    assert ranks[0]["metrics"][0]["grad_norm"] > 0.5  # clipping was active (max_grad_norm 0.5)
    # The weights after 3 AdamW steps (lr 1e-3): nearly every element to 1e-6; the few whose
    # gradient is near zero may differ by a few % of lr (Adam's m / sqrt(v) turns their
    # round-off into a step).
    got, want = ranks[0]["weights"], one["weights"]
    assert sorted(got) == sorted(want)
    gaps = torch.cat([(got[k] - v).abs().reshape(-1) for k, v in want.items()])
    assert float((gaps > 1e-6).float().mean()) < 1e-3 and float(gaps.max()) <= 1e-4, (float((gaps > 1e-6).float().mean()), float(gaps.max()))


@pytest.mark.slow
@pytest.mark.parametrize("mode, written, read", [("tp", 2, 1), ("ep", 1, 2), ("tp-ep", 4, 2), ("cp", 2, 1)])
def test_a_distributed_checkpoint_resumes_under_another_layout(mode: str, written: int, read: int, tmp_path) -> None:
    """megatron-core's distributed checkpointing: a checkpoint written by ``written``
    processes (tensor_parallel = 2, one process, TP = 2 with EP = 2, or context_parallel = 2)
    is read by ``read`` processes (one, expert_parallel = 2, TP = 2 alone, or one), each rank
    its own part of every
    whole tensor; steps 3 and 4
    after it equal the uninterrupted run's (to the float32 round-off between layouts, which
    the parity test bounds): the weights, AdamW's moments and steps, and the schedule."""
    import pathlib

    from skyrl_host.testing import run_gloo_ranks

    worker = pathlib.Path(__file__).with_name("mcore_worker.py")
    folder = tmp_path / "backend"
    folder.mkdir()
    full = run_gloo_ranks(worker, "resharded", written, mode, str(folder), "save", timeout=240)[0]
    files = sorted(p.name for p in folder.iterdir())
    assert "metadata.json" in files and "common.pt" in files
    assert sum(name.endswith(".distcp") for name in files) >= written  # each writer its own shard files
    resumed = run_gloo_ranks(worker, "resharded", read, mode, str(folder), "load", timeout=240)
    assert all(r["steps"] == 4 for r in resumed)
    for step, want in enumerate(full["metrics"]):
        for r in resumed:
            for key, rel in (("loss", 1e-5), ("entropy", 1e-5), ("grad_norm", 1e-4), ("lr", 0)):
                assert r["metrics"][step][key] == pytest.approx(want[key], rel=rel, abs=1e-7), (step, key)
    got, want = resumed[0]["weights"], full["weights"]
    assert sorted(got) == sorted(want)
    assert max(float((got[k] - v).abs().max()) for k, v in want.items()) <= 1e-6


# -- pipeline parallelism across gloo processes ----------------------------------------------------

PIPELINE_MODES = ("pp+old", "pp-moe", "pp-moe+r3+gc", "pp+support", "pp-mla+r3", "pp:fp8")


def assert_trains_like(ranks: list[dict], one: dict, mode: str, logprobs: bool = True) -> None:
    """Every rank's 3 steps are the one process's: loss, entropy (and kl) within 1e-5, grad norm
    within 1e-4, logprobs within 1e-5 + 1e-5 of their size (float32 round-off: 1.9e-5 on a
    logprob of -2.01 seen with AVX-512 kernels); rank 0's gathered weights, nearly every element
    within 1e-6."""
    for step, want in enumerate(one["metrics"]):
        for r in ranks:
            for key, rel in (("loss", 1e-5), ("entropy", 1e-5), ("kl", 1e-5), ("grad_norm", 1e-4), ("loss_tokens", 0)):
                if key in want:
                    assert r["metrics"][step][key] == pytest.approx(want[key], rel=rel, abs=1e-6), (mode, step, key)
            if logprobs:
                np.testing.assert_allclose(r["logprobs"][step], one["logprobs"][step], atol=1e-5, rtol=1e-5,
                                           err_msg=mode)
    got, want = ranks[0]["weights"], one["weights"]
    assert sorted(got) == sorted(want), mode
    gaps = torch.cat([(got[k] - v).abs().reshape(-1) for k, v in want.items()])
    assert float((gaps > 1e-6).float().mean()) < 1e-3 and float(gaps.max()) <= 1e-4, (mode, float(gaps.max()))


@pytest.fixture(scope="module")
def two_stages(mcore_worker, tmp_path_factory) -> dict:
    """Two gloo processes with pipeline_parallel = 2: ``modes``, what each rank's
    ``mcore_worker.train`` returned for each of PIPELINE_MODES; ``saved``, 2 steps, a
    distributed checkpoint into ``by_two`` and 2 more; ``loaded``, a fresh backend reading
    ``by_one`` (written by one process: ``one_saved``) and training 2 more steps. (One
    launch for both tests below: starting the processes is most of their time.)"""
    import pathlib

    from skyrl_host.testing import run_gloo_ranks

    by_two, by_one = tmp_path_factory.mktemp("by_two"), tmp_path_factory.mktemp("by_one")
    one_saved = mcore_worker.resharded(0, 1, "pp", str(by_one), "save")
    runs = run_gloo_ranks(pathlib.Path(__file__).with_name("mcore_worker.py"), "pipeline_and_checkpoints", 2,
                          str(by_two), str(by_one), *PIPELINE_MODES, timeout=300)
    return {"runs": runs, "by_two": by_two, "one_saved": one_saved}


@pytest.mark.slow
def test_two_pipeline_stages_equal_one_process(two_stages, mcore_worker) -> None:
    """pipeline_parallel = 2 across two gloo processes, each stage its half of the layers
    (the first the embedding, the last the final norm and a copy of the tied embedding for
    its head), trains as one process does (3 clipped AdamW steps, lr 1e-3): the qwen presets
    "tiny" (tied embedding and head; two mini-batches and a reference policy, so the
    no-grad passes of old and reference logprobs run through the stages too) and
    "tiny-moe" (alone, and replaying random routes with r3 under activation recompute:
    each stage its own layers' columns of the side channel), "tiny" scoring over random
    kept sets (support, on the last stage), a DeepSeek-V3 model whose dense first layer is
    one stage and its MoE layer the other (r3), and "tiny" with fp8 (each stage's weights
    quantized from the gathered whole)."""
    runs = [r["modes"] for r in two_stages["runs"]]
    for i, mode in enumerate(PIPELINE_MODES):
        ranks = [r[i] for r in runs]
        layout = {"tensor_parallel": 1, "expert_parallel": 1, "pipeline_parallel": 2}
        assert [r["layout"] for r in ranks] == [layout] * 2
        first, last = (set(r["own"]) for r in ranks)
        assert "embedding.word_embeddings.weight" in first and "decoder.final_layernorm.weight" in last
        assert not first & {"decoder.final_layernorm.weight", "output_layer.weight"}
        assert "embedding.word_embeddings.weight" not in last
        assert_trains_like(ranks, mcore_worker.train(0, 1, mode), mode)
    assert runs[0][0]["metrics"][0]["grad_norm"] > 0.5  # clipping was active (max_grad_norm 0.5)
    assert runs[0][0]["metrics"][1]["kl"] > 1e-6  # (the reference policy: the initial model's stages)


@pytest.mark.slow
def test_pipeline_stages_under_bf16_autocast_give_one_process_logprobs(two_stages, mcore_worker) -> None:
    """compute_dtype = "bfloat16": every stage computes under the job's autocast and the
    next stage goes on from the hidden states in their own dtype (bfloat16 after a decoder
    layer; they cross in float32 with their dtype's code), so the two stages' logprobs are
    one process's bit for bit (a first stage computing in float32 gives others). (Training
    under bf16 autocast is not run: megatron-core's linear layers fail in the backward pass
    on a CPU, with or without pipeline parallelism.)"""
    one = mcore_worker.bf16_logprobs(0, 1)
    for r in two_stages["runs"]:
        assert np.array_equal(r["bf16"], one)
    assert np.abs(one).max() > 0


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_in_one_process_and_back(two_stages, mcore_worker) -> None:
    """megatron-core's distributed checkpoint of two pipeline stages (each writes its layers,
    the tied head's copy is the embedding's replica) read by one process, and one process's
    read by two stages: steps 3 and 4 after it equal the uninterrupted run's (weights to
    1e-6, AdamW's moments and steps, the schedule)."""
    runs, by_two = two_stages["runs"], two_stages["by_two"]
    assert sum(p.name.endswith(".distcp") for p in by_two.iterdir()) >= 2  # (each stage its own shard files)
    one_resumed = mcore_worker.resharded(0, 1, "pp", str(by_two), "load")
    for full, resumed in ((runs[0]["saved"], [one_resumed]), (two_stages["one_saved"], [r["loaded"] for r in runs])):
        for step, want in enumerate(full["metrics"]):
            for r in resumed:
                assert r["steps"] == 4
                for key, rel in (("loss", 1e-5), ("entropy", 1e-5), ("grad_norm", 1e-4), ("lr", 0)):
                    assert r["metrics"][step][key] == pytest.approx(want[key], rel=rel, abs=1e-7), (step, key)
        got, want = resumed[0]["weights"], full["weights"]
        assert sorted(got) == sorted(want)
        assert max(float((got[k] - v).abs().max()) for k, v in want.items()) <= 1e-6


@pytest.mark.slow
def test_pipeline_stages_with_tensor_expert_and_data_parallel_ranks_equal_one_process(mcore_worker) -> None:
    """Four gloo processes: two pipeline stages, each over two tensor-parallel ranks ("tiny"),
    over two expert-parallel ranks ("tiny-moe": each its share of the sequences, half of the
    experts), or two data-parallel replicas of a two-stage model ("tiny": each replica half
    of the sequences): the one process's 3 steps (as above)."""
    import pathlib

    from skyrl_host.testing import run_gloo_ranks

    modes = ("pp-tp", "pp-ep", "pp+dp")
    runs = run_gloo_ranks(pathlib.Path(__file__).with_name("mcore_worker.py"), "pipeline", 4, *modes, timeout=400)
    one = {"tiny": mcore_worker.train(0, 1, "pp"), "tiny-moe": mcore_worker.train(0, 1, "pp-moe")}
    layouts = {"pp-tp": ({"tensor_parallel": 2, "expert_parallel": 1, "pipeline_parallel": 2}, [(0, 1)] * 4),
               "pp-ep": ({"tensor_parallel": 1, "expert_parallel": 2, "pipeline_parallel": 2}, [(0, 2), (1, 2)] * 2),
               "pp+dp": ({"tensor_parallel": 1, "expert_parallel": 1, "pipeline_parallel": 2, "data_parallel": 2},
                         [(0, 2), (1, 2)] * 2)}
    for i, mode in enumerate(modes):
        ranks = [r[i] for r in runs]
        assert [r["layout"] for r in ranks] == [layouts[mode][0]] * 4
        assert [tuple(r["data_parallel"]) for r in ranks] == layouts[mode][1]
        assert_trains_like(ranks, one["tiny-moe" if mode == "pp-ep" else "tiny"], mode)


# -- context parallelism across gloo processes ------------------------------------------------------

CONTEXT_MODES = ("cp+old", "cp-moe+r3+gc", "cp+support", "cp-tp", "cp+dp")


@pytest.mark.slow
def test_context_parallel_ranks_equal_one_process(mcore_worker) -> None:
    """Four gloo processes: context_parallel = 4 ("tiny" with two mini-batches and a
    reference policy; "tiny-moe" replaying random routes with r3 under activation
    recompute; "tiny" scoring over random kept sets), two context-parallel ranks over
    tensor-parallel pairs ("tiny"), and two data-parallel replicas of a context_parallel = 2 model. Each
    rank's decoder computes 1 / (context_parallel x tensor_parallel) of every row's slots
    (2 of 2 x context_parallel chunks, its queries attending to every rank's keys) and its
    head the logits of the loss tokens in those slots only (the ranks' shares make up every
    loss token once; with ``support`` the kept tokens' hidden states are gathered for the
    scorer instead), and every rank trains as one process does (3 clipped AdamW steps: loss, entropy, kl,
    logprobs 1e-5, grad norm 1e-4, the weights 1e-6)."""
    import pathlib

    from skyrl_host.testing import run_gloo_ranks

    runs = run_gloo_ranks(pathlib.Path(__file__).with_name("mcore_worker.py"), "pipeline", 4, *CONTEXT_MODES, timeout=400)
    layouts = {"cp+old": ({"tensor_parallel": 1, "expert_parallel": 1, "context_parallel": 4}, [(0, 1)] * 4, 4),
               "cp-moe+r3+gc": ({"tensor_parallel": 1, "expert_parallel": 1, "context_parallel": 4}, [(0, 1)] * 4, 4),
               "cp+support": ({"tensor_parallel": 1, "expert_parallel": 1, "context_parallel": 4}, [(0, 1)] * 4, 4),
               "cp-tp": ({"tensor_parallel": 2, "expert_parallel": 1, "context_parallel": 2}, [(0, 1)] * 4, 4),
               "cp+dp": ({"tensor_parallel": 1, "expert_parallel": 1, "context_parallel": 2, "data_parallel": 2},
                         [(0, 2), (0, 2), (1, 2), (1, 2)], 2)}
    for i, mode in enumerate(CONTEXT_MODES):
        ranks = [r[i] for r in runs]
        layout, shares, split = layouts[mode]
        assert [r["layout"] for r in ranks] == [layout] * 4
        assert [tuple(r["data_parallel"]) for r in ranks] == shares
        for r in ranks:
            assert r["slots"] and all(R % (2 * split) == 0 and seen * split == R for R, seen in r["slots"]), r["slots"]
        if "support" not in mode:
            # The head computes the logits of the rank's own loss tokens only; the context-parallel
            # ranks' shares make up every forward's loss tokens, each token once.
            group = ranks[:split] if mode != "cp-tp" else ranks[::2]  # (cp-tp: ranks 0 and 2 are one TP rank's pair)
            per_forward = list(zip(*[[h for h in r["heads"] if h is not None] for r in group]))
            assert per_forward and all(len({k for k, _, _ in f}) == 1 and sum(o for _, o, _ in f) == f[0][0]
                                       and all(rows == o for _, o, rows in f) for f in per_forward), per_forward[:3]
            assert max(o for f in per_forward for _, o, _ in f) < max(k for f in per_forward for k, _, _ in f)
        one = mcore_worker.train(0, 1, mode.replace("-tp", ""))
        assert_trains_like(ranks, one, mode, logprobs=mode != "cp+dp")  # (a replica's logprobs: its own share)
