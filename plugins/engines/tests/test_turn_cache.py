"""The embedded engine's turn cache (``[engine] turn_cache_mb``): a conversation's KV is
kept between ``continue_turn`` calls, so a turn prefills only its new tokens. Same tokens
and logprobs (1e-5) as re-prefilling the history, the trainer reproduces them, and the
cache is bounded and cleared at weight updates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from skyrl_host.interfaces import EnvStep, Task
from skyrl_host.multiturn import EnvWorkers, MultiTurnOptions, MultiTurnRollout

ALPHABET = "0123456789:ab"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Echo:
    """Answers every response with 'ab' (text) until ``turns`` responses; reward 1 a step."""

    def __init__(self, turns):
        self.turns = turns

    def episode(self, task, *, seed):
        env = self

        class Ep:
            t = 0

            def reset(self):
                return task.prompt

            def step(self, response):
                self.t += 1
                done = self.t >= env.turns
                return EnvStep(observation=None if done else "ab:", reward=1.0, done=done)

            def close(self):
                pass

        return Ep()


def make(skyrl_host, kind, name, **options):
    reg = skyrl_host.registry.get(kind, name)
    return reg.create(reg.config(**options))


def rollout(skyrl_host, loaded, engine, turns=4, n=3):
    sampler = make(skyrl_host, "samplers", "temperature", temperature=1.0)
    opts = MultiTurnOptions(max_turns=turns, max_total_tokens=300, max_new_tokens=8, step_timeout=30.0,
                            reward_gamma=1.0, failed_trajectories="zero")
    mt = MultiTurnRollout(Echo(turns), engine, sampler, loaded.tokenizer, loaded.stop_token_ids, opts, EnvWorkers(4))
    return mt.run([Task(prompt="12:"), Task(prompt="3456:"), Task(prompt="7:")], n, seed=5)


def test_kept_kv_gives_the_same_turns_as_prefilling_the_history(skyrl_host) -> None:
    loaded = make(skyrl_host, "models", "qwen", preset="tiny").load(alphabet=ALPHABET, seed=0)
    cached, plain = make(skyrl_host, "engines", "embedded"), make(skyrl_host, "engines", "embedded", turn_cache_mb=0)
    cached.start(loaded)
    plain.start(loaded)
    a, b = rollout(skyrl_host, loaded, cached), rollout(skyrl_host, loaded, plain)
    assert plain._turns is None
    # 9 conversations, 4 turns: turn 2 prefills the history (the first turn was a plain
    # generate), turns 3 and 4 start from the kept KV.
    assert (cached._turns.hits, cached._turns.misses) == (18, 9)
    np.testing.assert_array_equal(a.batch.tokens, b.batch.tokens)
    np.testing.assert_array_equal(a.batch.loss_mask, b.batch.loss_mask)
    np.testing.assert_allclose(a.batch.logprobs, b.batch.logprobs, atol=1e-5, rtol=0)
    # The trainer, scoring the assembled rows in one forward each, reproduces the engine.
    be = make(skyrl_host, "backends", "torch", lr=1e-3)
    be.start(loaded, seed=0, total_steps=1, reference=False, replay=[])
    algo = make(skyrl_host, "algorithms", "grpo")
    adv = np.asarray(algo.advantages(a.batch, a.rewards), dtype=np.float32)
    metrics = be.train_step(a.batch, adv, algo, temperature=1.0, max_new_tokens=300)
    assert metrics["logprob_diff_max"] <= 1e-5, metrics["logprob_diff_max"]


def test_the_cache_is_bounded_and_cleared_at_weight_updates(skyrl_host) -> None:
    loaded = make(skyrl_host, "models", "qwen", preset="tiny").load(alphabet=ALPHABET, seed=0)
    engine = make(skyrl_host, "engines", "embedded", turn_cache_mb=1)
    engine.start(loaded)
    rollout(skyrl_host, loaded, engine, turns=3, n=40)  # 120 conversations
    cache = engine._turns
    assert 0 < cache.nbytes <= 1 << 20 and 0 < len(cache) < 120  # the oldest were dropped
    engine.update_weights(loaded.model.named_parameters(), version=1)
    assert len(cache) == 0 and cache.nbytes == 0  # KV of the old weights is never reused


def test_no_turn_cache_where_layers_keep_state_or_routes_are_recorded(skyrl_host) -> None:
    hybrid = make(skyrl_host, "models", "qwen", preset="tiny-qwen3.5").load(alphabet=ALPHABET, seed=0)
    engine = make(skyrl_host, "engines", "embedded")
    engine.start(hybrid)
    assert engine._turns is None  # linear-attention layers: a state, not per-token KV
    moe = make(skyrl_host, "models", "qwen", preset="tiny-moe").load(alphabet=ALPHABET, seed=0)
    routed = make(skyrl_host, "engines", "embedded", return_routed_experts=True)
    routed.start(moe)
    assert routed._turns is None  # r3 re-prefills the history with its routes forced
    plain = make(skyrl_host, "engines", "embedded")
    plain.start(moe)
    assert plain._turns is not None
