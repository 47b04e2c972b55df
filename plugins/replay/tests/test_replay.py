"""The replay strategies in the torch backend: the trainer scores exactly what the
embedded engine sampled.

- r3, every tiny MoE preset of every family: engine (routing capture) -> one
  training step with r3 -> the trainer's pre-update logprobs equal the engine's
  (same weights, same precision) within 1e-5.
- r3 matters: when the trainer's routers would choose other experts (a different
  correction bias), only r3 brings the gap back to round-off; also under gradient
  checkpointing, small micro-batches and packing; the router still gets gradients.
- Multi-turn: a conversation assembled from two turns replays the right rows.
- Sparse-attention indexers (GLM-5, DeepSeek-V3.2): exact score ties make a KV-cached
  decode attend to other keys than the trainer's full forward; r3 replays the
  engine's key picks (side channel ``indexer_topk``) and the gap goes from visible
  to round-off, through packing, gradient checkpointing, multi-turn and the
  RolloutBatch transforms a side channel goes through.
- support: logprobs over the kept sets equal the naive masked log-softmax (values,
  entropy, gradients) and remove the top-p gap in a real step.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from skyrl_engines.embedded import Embedded, EmbeddedConfig
from skyrl_host.interfaces import ReplayStrategy, ReplayView
from skyrl_host.rollout import CSR
from skyrl_replay._impl import RoutingReplay, SupportReplay
from skyrl_replay.support_math import masked_logprobs, support_logprobs
from skyrl_samplers.processing import TruncatedSampler

ALPHABET = "0123456789+=:"
PROMPTS = [[3, 4, 5], [6, 7, 8, 9], [12], [4, 4, 10, 11, 3]]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def load(skyrl_host, family: str, preset: str, seed: int = 0):
    reg = skyrl_host.registry.get("models", family)
    return reg.create(reg.config(preset=preset)).load(alphabet=ALPHABET, seed=seed)


def backend(skyrl_host, loaded, replay=(), **options):
    reg = skyrl_host.registry.get("backends", "torch")
    be = reg.create(reg.config(lr=1e-3, **options))
    be.start(loaded, seed=0, total_steps=2, reference=False, replay=list(replay))
    return be


def grpo(skyrl_host):
    reg = skyrl_host.registry.get("algorithms", "grpo")
    return reg.create(reg.config())


def step(skyrl_host, be, batch, temperature: float = 1.0) -> dict:
    algo = grpo(skyrl_host)
    batch.rewards = np.random.default_rng(0).random(batch.n_sequences).astype(np.float32)
    adv = np.asarray(algo.advantages(batch, batch.rewards), dtype=np.float32)
    return be.train_step(batch, adv, algo, temperature=temperature, max_new_tokens=8)


def generate(loaded, *, routes=True, sampler=None, n=3, seed=1, prompts=PROMPTS, **engine):
    eng = Embedded(EmbeddedConfig(return_routed_experts=routes, **engine))
    eng.start(loaded)
    sampler = sampler or TruncatedSampler(temperature=1.0)
    return eng, eng.generate(prompts, n=n, sampler=sampler, max_new_tokens=6, seed=seed)


def set_bias(model, loaded, scale: float, seed: int) -> None:
    """Give ``model``'s sigmoid routers their own correction bias (a new buffer: a
    module sharing the old one keeps it): it changes which experts they choose, not
    the weights of the chosen ones."""
    gen = torch.Generator().manual_seed(seed)
    for info in loaded.routers:
        gate = model.get_submodule(info.path)
        gate.e_score_correction_bias = scale * torch.randn(info.n_experts, generator=gen)


MOE_PRESETS = [
    ("qwen", "tiny-moe"),
    ("qwen", "tiny-qwen3.5-moe"),
    ("qwen", "tiny-qwen3-next"),
    ("glm", "tiny-glm4-moe"),
    ("glm", "tiny-glm4-moe-lite"),
    ("glm", "tiny-glm-moe-dsa"),
    ("glm", "tiny-glm5-next"),
    ("kimi", "tiny-deepseek-v3.2"),
    ("kimi", "tiny-kimi-linear"),
    ("kimi", "tiny-kimi"),
    ("nemotron", "tiny-nemotron-h"),
    ("nemotron", "tiny-nemotron-3-super"),
    ("hf", "tiny-mixtral"),  # the generic family: routers found by probing
    ("hf", "tiny-qwen2-moe"),
]


# -- the protocol -----------------------------------------------------------------


def test_strategies_are_registered_and_implement_the_protocol(skyrl_host) -> None:
    for name, cls in (("r3", RoutingReplay), ("support", SupportReplay)):
        reg = skyrl_host.registry.get("replay_strategies", name)
        strategy = reg.create(reg.config() if reg.config else None)
        assert isinstance(strategy, cls) and isinstance(strategy, ReplayStrategy)
        assert strategy.name == name and reg.check is not None


# -- r3 ------------------------------------------------------------------------------


INDEXER_PRESETS = [("glm", "tiny-glm-moe-dsa"), ("kimi", "tiny-deepseek-v3.2")]


@pytest.mark.parametrize("family, preset", MOE_PRESETS)
def test_r3_reproduces_the_engines_logprobs(skyrl_host, family: str, preset: str) -> None:
    loaded = load(skyrl_host, family, preset)
    _, batch = generate(loaded)
    assert batch.side_channels["routed_experts"].shape == (batch.n_tokens, len(loaded.routers), loaded.routers[0].top_k)
    if (family, preset) in INDEXER_PRESETS:
        picks = batch.side_channels["indexer_topk"]
        n_indexers = sum(getattr(layer.self_attn, "indexer", None) is not None for layer in loaded.model.model.layers)
        assert picks.shape == (batch.n_tokens, n_indexers, 8) and picks.dtype == np.int32
        # Positions in the token's own sequence, never after it; a token sees min(pos + 1, 8) keys.
        pos = batch.positions()
        assert np.all(picks <= pos[:, None, None])
        fed = np.ones(batch.n_tokens, dtype=bool)
        fed[batch.cu_seqlens[1:] - 1] = False  # a sequence's last token is never fed to the engine
        assert np.array_equal((picks[fed] >= 0).sum(-1), np.broadcast_to(np.minimum(pos[fed] + 1, 8)[:, None],
                                                                          picks[fed].shape[:2]))
        assert np.all(picks[~fed] == -1)
    else:
        assert "indexer_topk" not in batch.side_channels
    be = backend(skyrl_host, loaded, [RoutingReplay()])
    metrics = step(skyrl_host, be, batch)
    assert metrics["logprob_diff_max"] <= 1e-5, metrics["logprob_diff_max"]


def test_r3_removes_a_routing_mismatch(skyrl_host) -> None:
    """The trainer's routers choose other experts than the engine's did: without r3 the
    logprobs part; with r3 they are the engine's again, also with gradient
    checkpointing, tiny micro-batches and rows packing several sequences."""
    results = {}
    for name, replay, options in (
        ("none", [], {}),
        ("r3", [RoutingReplay()], {}),
        ("r3-ckpt-micro", [RoutingReplay()], {"gradient_checkpointing": True, "micro_batch_tokens": 24, "pack_length": 16}),
        # every sequence longer than pack_length: each micro-batch one flat row, attention per sequence
        ("r3-flat", [RoutingReplay()], {"pack_length": 4}),
    ):
        loaded = load(skyrl_host, "kimi", "tiny-kimi")
        _, batch = generate(loaded)
        set_bias(loaded.model, loaded, 0.1, seed=0)  # the trainer's model only: the engine has its own module
        be = backend(skyrl_host, loaded, replay, **options)
        assert be._segment_attention == "built"  # MLA + MoE: flat rows, transformers builds the (unread) mask
        router = loaded.routers[0].path + ".weight"
        before = dict(loaded.model.named_parameters())[router].detach().clone()
        results[name] = step(skyrl_host, be, batch)
        after = dict(loaded.model.named_parameters())[router].detach()
        assert not torch.equal(before, after), f"{name}: the router did not learn"
        results[name]["params"] = {k: v.detach().clone() for k, v in loaded.model.named_parameters()}
    assert results["none"]["logprob_diff_max"] > 1e-3
    assert results["r3"]["logprob_diff_max"] <= 1e-5
    assert results["r3-ckpt-micro"]["logprob_diff_max"] <= 1e-5
    assert results["r3-flat"]["logprob_diff_max"] <= 1e-5
    # The same update however the batch is cut (lr 1e-3; Adam's m / sqrt(v) turns round-off
    # in a near-zero gradient into a visible step, hence 2% of lr).
    for k, v in results["r3"]["params"].items():
        torch.testing.assert_close(results["r3-ckpt-micro"]["params"][k], v, atol=2e-5, rtol=0)
        torch.testing.assert_close(results["r3-flat"]["params"][k], v, atol=2e-5, rtol=0)


def test_r3_errors_name_the_problem(skyrl_host) -> None:
    dense = load(skyrl_host, "qwen", "tiny")
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        backend(skyrl_host, dense, [RoutingReplay()])
    loaded = load(skyrl_host, "kimi", "tiny-kimi")
    _, batch = generate(loaded, routes=False)
    be = backend(skyrl_host, loaded, [RoutingReplay()])
    with pytest.raises(ValueError, match="no 'routed_experts' side channel.*return_routed_experts"):
        step(skyrl_host, be, batch)
    batch.side_channels["routed_experts"] = np.zeros((batch.n_tokens, 5, 2), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"must be \[tokens, 2 MoE layers, top_k 2\].*\[\d+, 5, 2\]"):
        step(skyrl_host, be, batch)
    batch.side_channels["routed_experts"] = np.full((batch.n_tokens, 2, 2), 9, dtype=np.uint8)
    with pytest.raises(ValueError, match="outside 0..7"):
        step(skyrl_host, be, batch)


def test_multi_turn_conversations_replay_the_right_rows(skyrl_host) -> None:
    """Turn 2 is generated after the engine's routers changed their correction bias, so
    turn 2 routes its new tokens differently than turn 1 would have. The assembled
    conversation replays turn 1's rows for turn 1's tokens and turn 2's for the rest:
    the trainer (with yet another bias of its own) reproduces every logprob of both
    turns. Stale rows (the placeholder of turn 1's last token) do not."""
    loaded = load(skyrl_host, "kimi", "tiny-kimi")
    engine = Embedded(EmbeddedConfig(return_routed_experts=True))
    engine.start(loaded)
    sampler = TruncatedSampler(temperature=1.0)
    turn1 = engine.generate(PROMPTS[:2], n=2, sampler=sampler, max_new_tokens=5, seed=1)
    set_bias(engine.model, loaded, 0.1, seed=1)
    seg = engine.continue_turn(turn1, [[10, 11], [12], [10], [12, 3]], sampler=sampler, max_new_tokens=5, seed=2)
    conv = turn1.append_turn(seg)
    set_bias(loaded.model, loaded, 0.1, seed=2)  # the trainer's own routers differ from both turns'
    stale = copy.deepcopy(conv)
    ends = conv.cu_seqlens[:-1] + turn1.seq_lens - 1  # turn 1's last tokens: routed only in turn 2
    stale.side_channels["routed_experts"][ends] = turn1.side_channels["routed_experts"][turn1.cu_seqlens[1:] - 1]
    assert not np.array_equal(stale.side_channels["routed_experts"], conv.side_channels["routed_experts"])

    good = step(skyrl_host, backend(skyrl_host, loaded, [RoutingReplay()]), conv)
    assert good["loss_tokens"] == pytest.approx(float(conv.loss_mask.sum()))  # both turns' generated tokens train
    assert good["logprob_diff_max"] <= 1e-5
    loaded2 = load(skyrl_host, "kimi", "tiny-kimi")
    set_bias(loaded2.model, loaded2, 0.1, seed=2)
    bad = step(skyrl_host, backend(skyrl_host, loaded2, [RoutingReplay()]), stale)
    assert bad["logprob_diff_max"] > 1e-4


# -- sparse-attention indexers -----------------------------------------------------------

# Prompts long enough that most queries see more keys than the indexer keeps (8).
LONG_PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 3, 4, 5, 6], [12, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [4, 4, 10, 11, 3, 9, 9, 8]]


def indexer_step(skyrl_host, family, preset, replay, seed=1, **options):
    loaded = load(skyrl_host, family, preset)
    eng = Embedded(EmbeddedConfig(return_routed_experts=True))
    eng.start(loaded)
    batch = eng.generate(LONG_PROMPTS, n=4, sampler=TruncatedSampler(temperature=1.0), max_new_tokens=10, seed=seed)
    return step(skyrl_host, backend(skyrl_host, loaded, replay, **options), batch)


@pytest.mark.parametrize("family, preset", INDEXER_PRESETS)
def test_r3_replays_the_sparse_attention_indexer(skyrl_host, family: str, preset: str) -> None:
    """Without replay the trainer's indexers break score ties otherwise than the engine's
    cached decode did: a gap a user sees. r3 forces them to the engine's picks: the gap
    is round-off, also with gradient checkpointing and rows packing several sequences."""
    none = indexer_step(skyrl_host, family, preset, [])
    assert none["logprob_diff_max"] > 1e-3, none["logprob_diff_max"]
    r3 = indexer_step(skyrl_host, family, preset, [RoutingReplay()])
    assert r3["logprob_diff_max"] <= 1e-5, r3["logprob_diff_max"]
    packed = indexer_step(skyrl_host, family, preset, [RoutingReplay()],
                          gradient_checkpointing=True, micro_batch_tokens=48, pack_length=40)
    assert packed["logprob_diff_max"] <= 1e-5, packed["logprob_diff_max"]


def test_indexer_picks_survive_multi_turn_and_batch_transforms(skyrl_host) -> None:
    """A GLM-5 conversation of two turns (the engine prefills the history with its
    recorded picks forced), then reordered, split, concatenated and sent through the
    array form transports use: r3 still reproduces every logprob. Rows one token off
    are refused, not silently used."""
    from skyrl_host.rollout import RolloutBatch

    loaded = load(skyrl_host, "glm", "tiny-glm-moe-dsa")
    engine = Embedded(EmbeddedConfig(return_routed_experts=True))
    engine.start(loaded)
    sampler = TruncatedSampler(temperature=1.0)
    turn1 = engine.generate(LONG_PROMPTS[:2], n=2, sampler=sampler, max_new_tokens=6, seed=1)
    seg = engine.continue_turn(turn1, [[10, 11], [12], [10], [12, 3]], sampler=sampler, max_new_tokens=6, seed=2)
    assert "indexer_topk" in seg.side_channels
    conv = turn1.append_turn(seg)
    moved = RolloutBatch.from_arrays(RolloutBatch.concat([conv.select([2, 0]), conv.select([3, 1])]).to_arrays())
    assert np.array_equal(moved.side_channels["indexer_topk"], conv.select([2, 0, 3, 1]).side_channels["indexer_topk"])
    good = step(skyrl_host, backend(skyrl_host, loaded, [RoutingReplay()]), moved)
    assert good["loss_tokens"] == pytest.approx(float(conv.loss_mask.sum()))
    assert good["logprob_diff_max"] <= 1e-5, good["logprob_diff_max"]

    loaded2 = load(skyrl_host, "glm", "tiny-glm-moe-dsa")
    be = backend(skyrl_host, loaded2, [RoutingReplay()])
    shifted = copy.deepcopy(conv)
    shifted.side_channels["indexer_topk"] = np.roll(conv.side_channels["indexer_topk"], -1, axis=0)  # each token gets the next one's
    with pytest.raises(ValueError, match="key after its own position"):
        step(skyrl_host, be, shifted)
    del shifted.side_channels["indexer_topk"]
    with pytest.raises(ValueError, match="no 'indexer_topk' side channel.*sparse-attention indexer"):
        step(skyrl_host, be, shifted)


# -- support ----------------------------------------------------------------------


def random_sets(K: int, V: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sets = [torch.randperm(V, generator=g)[: int(torch.randint(1, 40, (1,), generator=g))] for _ in range(K)]
    targets = torch.stack([s[int(torch.randint(len(s), (1,), generator=g))] for s in sets])
    offsets = torch.zeros(K + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(torch.tensor([len(s) for s in sets]), 0)
    return targets, offsets, torch.cat(sets)


@pytest.mark.parametrize("temperature, bias, chunk", [(1.0, False, 1 << 16), (0.7, True, 37), (1.3, False, 1)])
def test_support_logprobs_equal_the_masked_log_softmax(temperature: float, bias: bool, chunk: int) -> None:
    K, H, V = 64, 24, 500
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(K, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    b = torch.randn(V, generator=g, requires_grad=True) if bias else None
    targets, offsets, ids = random_sets(K, V, 1)
    upstream = torch.randn(K, generator=g)

    lp, ent = support_logprobs(hidden, weight, b, targets, offsets, ids, temperature=temperature, chunk=chunk)
    (lp * upstream).sum().backward()
    grads = [t.grad.clone() for t in (hidden, weight, b) if t is not None]
    for t in (hidden, weight, b):
        if t is not None:
            t.grad = None
    logits = hidden @ weight.T + (b if b is not None else 0)
    lp2, ent2 = masked_logprobs(logits, targets, offsets, ids, temperature=temperature)
    (lp2 * upstream).sum().backward()
    torch.testing.assert_close(lp, lp2, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent2, atol=1e-5, rtol=0)
    for got, t in zip(grads, [t for t in (hidden, weight, b) if t is not None]):
        torch.testing.assert_close(got, t.grad, atol=1e-5, rtol=0)
    assert not ent.requires_grad and bool((ent >= -1e-6).all())
    # A set of one token: logprob 0, entropy 0.
    lp1, ent1 = support_logprobs(hidden[:1], weight, None, targets[:1], torch.tensor([0, 1]), targets[:1])
    assert float(lp1.detach().abs().max()) < 1e-6 and float(ent1.abs().max()) < 1e-6


def test_support_refuses_tokens_outside_their_sets() -> None:
    hidden, weight = torch.randn(2, 4), torch.randn(10, 4)
    with pytest.raises(ValueError, match="scored token 1 \\(id 7\\) is not in its kept set"):
        support_logprobs(hidden, weight, None, torch.tensor([3, 7]), torch.tensor([0, 2, 4]), torch.tensor([3, 4, 5, 6]))
    with pytest.raises(ValueError, match="3 kept sets for 2 scored tokens"):
        support_logprobs(hidden, weight, None, torch.tensor([3, 7]), torch.tensor([0, 1, 2, 3]), torch.tensor([3, 7, 1]))


def test_support_removes_the_top_p_gap(skyrl_host) -> None:
    """Top-p 0.7: the engine reports the logprob of the distribution it sampled from;
    a trainer normalising over the whole vocabulary is off by the log of the kept mass,
    one normalising over the kept set is not. The entropy metric follows the sets."""
    out = {}
    for name, replay, options in (("none", [], {}), ("support", [SupportReplay(chunk=50)], {}),
                                  ("support-flat", [SupportReplay(chunk=50)], {"pack_length": 4})):
        loaded = load(skyrl_host, "qwen", "tiny")
        _, batch = generate(loaded, routes=False, sampler=TruncatedSampler(temperature=0.9, top_p=0.7, return_support=True))
        be = backend(skyrl_host, loaded, replay, **options)
        out[name] = step(skyrl_host, be, batch, temperature=0.9)
    assert out["none"]["logprob_diff_mean"] > 0.05
    assert out["support"]["logprob_diff_max"] <= 1e-5
    assert be._segment_attention == "prepared" and out["support-flat"]["logprob_diff_max"] <= 1e-5  # flat rows
    assert out["support-flat"]["entropy"] == pytest.approx(out["support"]["entropy"], rel=1e-5)
    assert out["support"]["entropy"] < out["none"]["entropy"]


def test_support_errors_name_the_problem(skyrl_host) -> None:
    loaded = load(skyrl_host, "qwen", "tiny")
    _, batch = generate(loaded, routes=False, sampler=TruncatedSampler(top_p=0.7))
    be = backend(skyrl_host, loaded, [SupportReplay()])
    with pytest.raises(ValueError, match="no 'sample_support' side channel.*return_support"):
        step(skyrl_host, be, batch)
    # Support sets of other tokens (rows shifted by one): caught, not silently used.
    _, batch = generate(loaded, routes=False, sampler=TruncatedSampler(top_p=0.3, return_support=True))
    sets = batch.side_channels["sample_support"]
    batch.side_channels["sample_support"] = CSR.concat([sets.take(np.arange(1, sets.n_rows)), sets.take([0])])
    with pytest.raises(ValueError, match="not in its kept set"):
        step(skyrl_host, be, batch)


def test_view_maps_slots_back_to_batch_tokens(skyrl_host) -> None:
    """What the strategies see: every real slot of every forward names its batch token."""
    seen: list[ReplayView] = []

    class Spy:
        name, side_channel = "spy", "none"

        def bind(self, model, loaded):
            pass

        def replaying(self, view):
            seen.append(view)
            import contextlib

            return contextlib.nullcontext()

    loaded = load(skyrl_host, "qwen", "tiny")
    _, batch = generate(loaded, routes=False)
    step(skyrl_host, backend(skyrl_host, loaded, [Spy()], micro_batch_tokens=20, pack_length=12), batch)
    assert len(seen) > 1
    covered = np.concatenate([v.slot_tokens[v.slot_tokens >= 0] for v in seen])
    assert sorted(covered.tolist()) == list(range(batch.n_tokens))
    for v in seen:
        real = v.slot_tokens[v.slot_tokens >= 0]
        assert set(v.scored_tokens.tolist()) <= set(real.tolist())
        assert np.all(batch.loss_mask[v.scored_tokens] == 1)
