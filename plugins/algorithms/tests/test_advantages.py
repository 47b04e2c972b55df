"""Rewards to advantages, dynamic sampling, overlong shaping and the KL reward
penalty, against values worked out by hand in the comments."""

from __future__ import annotations

import numpy as np
import pytest

import skyrl_algorithms
from skyrl_algorithms.dapo import Dapo, DapoConfig
from skyrl_algorithms.dr_grpo import DrGrpo
from skyrl_algorithms.grpo import Grpo, GrpoConfig
from skyrl_algorithms.gspo import Gspo
from skyrl_algorithms.rloo import Rloo
from skyrl_host.interfaces import Algorithm
from skyrl_host.rollout import RolloutBatch

# Eight sequences in four groups (ids 7, 3, 5, 9; not contiguous, not sorted):
#   seq  group  prompt  response    reward
#   0    7      2 tok   2 tok       1.0
#   1    3      1       3           0.2
#   2    7      2       1           0.0
#   3    3      1       1           0.6
#   4    7      2       3           0.5
#   5    5      1       1           0.3
#   6    5      1       2           0.3
#   7    9      1       1           0.4   (a group of one)
GROUPS = [7, 3, 7, 3, 7, 5, 5, 9]
REWARDS = [1.0, 0.2, 0.0, 0.6, 0.5, 0.3, 0.3, 0.4]
PROMPTS = [[1, 2], [1], [1, 2], [1], [1, 2], [1], [1], [1]]
RESPONSES = [[3, 4], [5, 6, 7], [8], [9], [3, 3, 3], [4], [4, 4], [2]]


def make_batch() -> RolloutBatch:
    batch = RolloutBatch.from_sequences(
        PROMPTS, RESPONSES, [[-0.5] * len(r) for r in RESPONSES], group_ids=GROUPS
    )
    batch.rewards[:] = REWARDS
    return batch


def test_every_algorithm_is_an_algorithm() -> None:
    for cls in (Grpo, Dapo, DrGrpo, Gspo, Rloo):
        algo = cls()
        assert isinstance(algo, Algorithm)
        assert algo.needs_reference is False


# GRPO, population std, eps = 1e-6:
#   group 7: rewards 1, 0, 0.5: mean 0.5, deviations 0.5, -0.5, 0;
#            var = (0.25 + 0.25 + 0) / 3 = 1/6, std = 0.4082483
#            -> 0.5 / 0.4082493 = 1.2247419, -1.2247419, 0
#   group 3: rewards 0.2, 0.6: mean 0.4, std 0.2 -> -0.2 / 0.200001 = -0.999995, +0.999995
#   group 5: rewards 0.3, 0.3: std 0 -> 0 / (0 + eps) = 0, 0
#   group 9: one reward: r - mean = 0 -> 0
GRPO_SEQ = [1.2247419, -0.999995, -1.2247419, 0.999995, 0.0, 0.0, 0.0, 0.0]
# Dr. GRPO: r - mean, no std.
DR_GRPO_SEQ = [0.5, -0.2, -0.5, 0.2, 0.0, 0.0, 0.0, 0.0]
# RLOO: r_i - mean of the group's others:
#   group 7: 1 - (0 + 0.5)/2 = 0.75;  0 - (1 + 0.5)/2 = -0.75;  0.5 - (1 + 0)/2 = 0
#   group 3: 0.2 - 0.6 = -0.4;  0.6 - 0.2 = 0.4;   group 5: 0, 0;   group 9 (alone): 0
RLOO_SEQ = [0.75, -0.4, -0.75, 0.4, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("algo", "expected"),
    [(Grpo(), GRPO_SEQ), (Dapo(), GRPO_SEQ), (Gspo(), GRPO_SEQ), (DrGrpo(), DR_GRPO_SEQ), (Rloo(), RLOO_SEQ)],
    ids=["grpo", "dapo", "gspo", "dr_grpo", "rloo"],
)
def test_sequence_advantages(algo, expected) -> None:
    batch = make_batch()
    got = algo.sequence_advantages(batch, batch.rewards)
    assert got.dtype == np.float32
    assert got == pytest.approx(expected, abs=2e-6)


def test_token_advantages_sit_on_loss_tokens_only() -> None:
    batch = make_batch()
    got = DrGrpo().advantages(batch, batch.rewards)
    assert got.dtype == np.float32 and len(got) == batch.n_tokens
    # Prompt tokens 0; each response token carries its sequence's advantage.
    expected = (
        [0, 0, 0.5, 0.5]  # seq 0
        + [0, -0.2, -0.2, -0.2]  # seq 1
        + [0, 0, -0.5]  # seq 2
        + [0, 0.2]  # seq 3
        + [0, 0, 0, 0, 0]  # seq 4
        + [0, 0]  # seq 5
        + [0, 0, 0]  # seq 6
        + [0, 0]  # seq 7
    )
    assert got == pytest.approx(expected, abs=1e-7)


def test_leave_one_out_with_std_scaling() -> None:
    # RLOO's baseline with GRPO's scaling, group 3 only: (0.2 - 0.6) / (0.2 + 1e-6) = -1.99999, +1.99999.
    batch = make_batch().select([1, 3])
    algo = Rloo(skyrl_algorithms.rloo.RlooConfig(scale_by_std=True))
    assert algo.sequence_advantages(batch, batch.rewards) == pytest.approx([-1.99999, 1.99999], abs=1e-5)


# GRPO with std = "unbiased" (divide the squared deviations by n - 1, as torch.std, TRL and verl):
#   group 7: squares 0.5, var = 0.5 / 2 = 0.25, std 0.5 -> 0.5 / 0.500001 = 0.999998, -0.999998, 0
#   group 3: squares 0.08, var = 0.08 / 1, std 0.2828427 -> 0.2 / 0.2828437 = 0.7071043, -0.7071043
#   group 5: std 0 -> 0, 0;   group 9 (one reward): std 0 (not 0/0) -> 0
GRPO_UNBIASED_SEQ = [0.999998, -0.7071043, -0.999998, 0.7071043, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("cls", [Grpo, Dapo, Gspo], ids=["grpo", "dapo", "gspo"])
def test_unbiased_std(cls) -> None:
    algo = cls(cls.config_class(std="unbiased"))
    batch = make_batch()
    got = algo.sequence_advantages(batch, batch.rewards)
    assert got.dtype == np.float32 and not np.isnan(got).any()
    assert got == pytest.approx(GRPO_UNBIASED_SEQ, abs=2e-6)
    # The same as torch.std (unbiased) on every group of two or more.
    torch = pytest.importorskip("torch")
    r = torch.tensor(REWARDS, dtype=torch.float64)
    for gid in (7, 3, 5):
        idx = [i for i, g in enumerate(GROUPS) if g == gid]
        expected = (r[idx] - r[idx].mean()) / (r[idx].std() + 1e-6)
        assert got[idx] == pytest.approx(expected.tolist(), abs=1e-6)


def test_unbiased_std_group_of_one_and_leave_one_out() -> None:
    # Only groups of one: std 0 with either convention, advantages 0, no NaN, no warning.
    batch = make_batch().select([7])
    for std in ("population", "unbiased"):
        got = Grpo(GrpoConfig(std=std)).sequence_advantages(batch, batch.rewards)
        assert got.tolist() == [0.0]
    # RLOO's baseline with the unbiased std, group 7: (0.75, -0.75, 0) / (0.5 + 1e-6).
    batch = make_batch().select([0, 2, 4])
    algo = Rloo(skyrl_algorithms.rloo.RlooConfig(scale_by_std=True, std="unbiased"))
    assert algo.sequence_advantages(batch, batch.rewards) == pytest.approx([1.499997, -1.499997, 0.0], abs=2e-6)


def test_population_std_is_still_the_default_and_std_off_ignores_it() -> None:
    batch = make_batch()
    assert GrpoConfig().std == "population"
    default = Grpo().sequence_advantages(batch, batch.rewards)
    explicit = Grpo(GrpoConfig(std="population")).sequence_advantages(batch, batch.rewards)
    assert default.tobytes() == explicit.tobytes()
    # Without std scaling the choice changes nothing (Dr. GRPO's r - mean).
    dr = skyrl_algorithms.dr_grpo
    off = DrGrpo(dr.DrGrpoConfig(std="unbiased")).sequence_advantages(batch, batch.rewards)
    assert off == pytest.approx(DR_GRPO_SEQ, abs=1e-7)


def test_unscored_rewards_are_an_error() -> None:
    batch = make_batch()
    batch.rewards[2] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        Grpo().advantages(batch, batch.rewards)
    with pytest.raises(ValueError, match="NaN"):
        Dapo().shape_rewards(batch, 10)


def test_dynamic_sampling_drops_groups_with_equal_rewards() -> None:
    batch = make_batch()
    # Group 5 (0.3, 0.3) has no spread; group 9 has one sample; groups 7 and 3 stay whole.
    assert Dapo().keep(batch, batch.rewards).tolist() == [True, True, True, True, True, False, False, False]
    # Off for the others: everything stays.
    assert Grpo().keep(batch, batch.rewards).tolist() == [True] * 8
    on = Grpo(GrpoConfig(dynamic_sampling=True, max_refill_rounds=3))
    assert on.dynamic_sampling and on.max_refill_rounds == 3
    assert on.keep(batch, batch.rewards).tolist() == [True, True, True, True, True, False, False, False]
    # It looks at the rewards it is given (e.g. shaped ones), not batch.rewards.
    shaped = batch.rewards.copy()
    shaped[6] -= 0.25
    assert Dapo().keep(batch, shaped).tolist() == [True] * 7 + [False]
    assert Dapo().dynamic_sampling and Dapo().max_refill_rounds == 10


def lengths_batch(lengths: list[int]) -> RolloutBatch:
    batch = RolloutBatch.from_sequences(
        [[1]] * len(lengths), [[2] * n for n in lengths], [[0.0] * n for n in lengths], group_ids=range(len(lengths))
    )
    batch.rewards[:] = 1.0
    return batch


def test_overlong_shaping_values() -> None:
    # Lmax = 10, buffer L = 4, factor 1: no penalty up to 10 - 4 = 6 tokens, then
    # -(l - 6) / 4: l = 7 -> -0.25, l = 8 -> -0.5, l = 10 -> -1; beyond Lmax -> -1.
    batch = lengths_batch([5, 6, 7, 8, 10, 11])
    algo = Dapo(DapoConfig(overlong_buffer=4))
    got = algo.shape_rewards(batch, max_new_tokens=10)
    assert got.dtype == np.float32
    assert got == pytest.approx([1.0, 1.0, 0.75, 0.5, 0.0, 0.0])
    assert batch.rewards.tolist() == [1.0] * 6  # the batch is not modified


def test_overlong_penalty_factor_default_buffer_and_clamp() -> None:
    # factor 0.5, L = 4, Lmax = 10: l = 9 -> -(3/4) * 0.5 = -0.375.
    got = Dapo(DapoConfig(overlong_buffer=4, overlong_penalty=0.5)).shape_rewards(lengths_batch([9]), 10)
    assert got == pytest.approx([0.625])
    # Default buffer: max_new_tokens // 5 = 20 // 5 = 4, so the ramp starts after 16:
    # l = 16 -> 0, l = 17 -> -0.25, l = 20 -> -1.
    got = Dapo().shape_rewards(lengths_batch([16, 17, 20]), 20)
    assert got == pytest.approx([1.0, 0.75, 0.0])
    # A buffer longer than max_new_tokens is cut to it: L = 10, l = 5 -> -0.5.
    got = Dapo(DapoConfig(overlong_buffer=50)).shape_rewards(lengths_batch([5]), 10)
    assert got == pytest.approx([0.5])
    # Tiny jobs: max_new_tokens = 3 -> buffer max(1, 0) = 1: l = 2 -> 0, l = 3 -> -1.
    assert Dapo().shape_rewards(lengths_batch([2, 3]), 3) == pytest.approx([1.0, 0.0])


def test_overlong_shaping_is_off_by_default_except_dapo_and_available_to_all() -> None:
    batch = lengths_batch([5, 8])
    for cls in (Grpo, DrGrpo, Gspo, Rloo):
        assert cls().shape_rewards(batch, 10).tolist() == [1.0, 1.0]
    on = Grpo(GrpoConfig(overlong_shaping=True, overlong_buffer=4))
    assert on.shape_rewards(batch, 10) == pytest.approx([1.0, 0.5])  # l = 8: -(8 - 6) / 4


# Two sequences, prompt token first (masked):
#   seq 0: engine logp -1.0, -2.0; ref -1.5, -1.5 -> d = logp - ref = 0.5, -0.5
#          k1 = 0.5 - 0.5 = 0
#          k2 = 0.125 + 0.125 = 0.25
#          k3 = (exp(-0.5) + 0.5 - 1) + (exp(0.5) - 0.5 - 1)
#             = 0.1065307 + 0.1487213 = 0.2552519
#   seq 1: logp == ref -> 0 for every estimator.
ENGINE = [0.0, -1.0, -2.0, 0.0, -0.5]
REF = [7.0, -1.5, -1.5, 7.0, -0.5]  # prompt positions hold junk; they are masked
MASK = [0, 1, 1, 0, 1]
SEQ_IDS = [0, 0, 0, 1, 1]


@pytest.mark.parametrize(("estimator", "expected"), [("k1", 0.0), ("k2", 0.25), ("k3", 0.2552519)])
def test_kl_reward_penalty(estimator: str, expected: float) -> None:
    got = skyrl_algorithms.kl_reward_penalty(ENGINE, REF, MASK, SEQ_IDS, estimator)
    assert got.dtype == np.float32
    assert got == pytest.approx([expected, 0.0], abs=1e-6)


def test_kl_in_reward_through_the_algorithm() -> None:
    batch = RolloutBatch.from_sequences([[1], [1]], [[2, 3], [4]], [[-1.0, -2.0], [-0.5]], group_ids=[0, 0])
    algo = Grpo(GrpoConfig(kl_coef=0.1, kl_in_reward=True))
    assert algo.needs_reference  # the driver must compute reference logprobs
    # 0.1 * 0.2552519 (see above) = 0.0255252; seq 1 has no KL.
    assert algo.kl_reward_penalty(batch, np.asarray(REF, dtype=np.float32)) == pytest.approx([0.0255252, 0.0], abs=1e-6)
    # Off (the default, or kl_coef = 0): zeros.
    assert Grpo(GrpoConfig(kl_coef=0.1)).kl_reward_penalty(batch, REF).tolist() == [0.0, 0.0]
    assert Grpo(GrpoConfig(kl_in_reward=True)).kl_reward_penalty(batch, REF).tolist() == [0.0, 0.0]
