"""The policy loss against hand-computed values: aggregation modes, clip and
dual-clip, clip_fraction, GSPO's sequence ratio, KL estimators, truncated
importance sampling, and micro-batch shares that add up to the step loss."""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_algorithms._losses import kl_estimate
from skyrl_algorithms.dapo import Dapo, DapoConfig
from skyrl_algorithms.dr_grpo import DrGrpo
from skyrl_algorithms.grpo import Grpo, GrpoConfig
from skyrl_algorithms.gspo import Gspo, GspoConfig
from skyrl_algorithms.rloo import Rloo
from skyrl_host.interfaces import LossInputs

F64 = torch.float64


def t(values, dtype=F64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def make_inputs(
    logp,
    old,
    adv,
    mask,
    seq_ids,
    *,
    engine=None,
    ref=None,
    global_tokens=None,
    global_seqs=None,
    max_response_len=0,
) -> LossInputs:
    logp = t(logp).requires_grad_(True)
    n_seqs = max(seq_ids) + 1
    return LossInputs(
        logprobs=logp,
        old_logprobs=t(old),
        engine_logprobs=t(old if engine is None else engine),
        advantages=t(adv),
        mask=t(mask),
        seq_ids=torch.tensor(seq_ids, dtype=torch.int64),
        n_seqs=n_seqs,
        global_tokens=float(sum(mask) if global_tokens is None else global_tokens),
        global_seqs=float(n_seqs if global_seqs is None else global_seqs),
        ref_logprobs=None if ref is None else t(ref),
        max_response_len=max_response_len,
    )


def loss_and_grad(algo, inputs: LossInputs):
    loss, metrics = algo.loss(inputs)
    (grad,) = torch.autograd.grad(loss, inputs.logprobs)
    return loss.item(), grad.tolist(), {k: v.item() for k, v in metrics.items()}


# -- loss aggregation ---------------------------------------------------------
#
# Two sequences, a masked prompt token first in each (junk logprobs there):
#   seq 0: 2 loss tokens, A = 1.0;  seq 1: 3 loss tokens, A = 0.5;  ratio 1 everywhere.
# Token losses -A: seq 0: -1, -1 (sum -2, mean -1); seq 1: -0.5 x 3 (sum -1.5, mean -0.5).
# The step is larger than this micro-batch: global_tokens = 10, global_seqs = 4,
# max_response_len = 5.
#   token-mean               (-2 - 1.5) / 10        = -0.35     grad per token -A/10
#   seq-mean-token-sum       (-2 - 1.5) / 4         = -0.875    grad -A/4
#   seq-mean-token-mean      (-1 - 0.5) / 4         = -0.375    grad -A/(n_i*4): -1/8, -0.5/12
#   seq-mean-token-sum-norm  (-2 - 1.5) / (4 * 5)   = -0.175    grad -A/20
AGG_LOGP = [-9.0, -1.0, -2.0, 5.0, -1.0, -0.7, -3.0]
AGG_OLD = [0.0, -1.0, -2.0, -40.0, -1.0, -0.7, -3.0]
AGG_ADV = [3.0, 1.0, 1.0, -2.0, 0.5, 0.5, 0.5]  # advantages on masked tokens are ignored too
AGG_MASK = [0, 1, 1, 0, 1, 1, 1]
AGG_SEQ = [0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(
    ("mode", "loss", "grad"),
    [
        ("token-mean", -0.35, [0, -0.1, -0.1, 0, -0.05, -0.05, -0.05]),
        ("seq-mean-token-sum", -0.875, [0, -0.25, -0.25, 0, -0.125, -0.125, -0.125]),
        ("seq-mean-token-mean", -0.375, [0, -0.125, -0.125, 0, -1 / 24, -1 / 24, -1 / 24]),
        ("seq-mean-token-sum-norm", -0.175, [0, -0.05, -0.05, 0, -0.025, -0.025, -0.025]),
    ],
)
def test_loss_aggregation_modes(mode: str, loss: float, grad: list[float]) -> None:
    inputs = make_inputs(
        AGG_LOGP, AGG_OLD, AGG_ADV, AGG_MASK, AGG_SEQ, global_tokens=10, global_seqs=4, max_response_len=5
    )
    got_loss, got_grad, metrics = loss_and_grad(Grpo(GrpoConfig(loss_agg=mode)), inputs)
    assert got_loss == pytest.approx(loss)
    assert got_grad == pytest.approx(grad)
    # Metrics are means over the micro-batch's 5 loss tokens, to be averaged over
    # micro-batches weighted by their loss tokens; pg_loss is the share * 10 / 5.
    assert metrics["pg_loss"] == pytest.approx(loss * 2)
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["clip_fraction"] == 0.0


def test_default_aggregation_of_each_algorithm() -> None:
    inputs = make_inputs(
        AGG_LOGP, AGG_OLD, AGG_ADV, AGG_MASK, AGG_SEQ, global_tokens=10, global_seqs=4, max_response_len=5
    )
    assert Grpo().loss(inputs)[0].item() == pytest.approx(-0.375)  # seq-mean-token-mean
    assert Dapo().loss(inputs)[0].item() == pytest.approx(-0.35)  # token-mean
    assert Rloo().loss(inputs)[0].item() == pytest.approx(-0.35)  # token-mean
    assert DrGrpo().loss(inputs)[0].item() == pytest.approx(-0.175)  # seq-mean-token-sum-norm


def test_sum_norm_needs_the_max_response_length() -> None:
    inputs = make_inputs(AGG_LOGP, AGG_OLD, AGG_ADV, AGG_MASK, AGG_SEQ)  # max_response_len = 0
    with pytest.raises(ValueError, match="max_response_len"):
        DrGrpo().loss(inputs)


# -- clipping -------------------------------------------------------------------
#
# One token, ratio r = exp(logp - 0), DAPO's clip 0.2 / 0.28 -> [0.8, 1.28].
# loss = -min(r A, clip(r) A); gradient w.r.t. logp is -A r when the unclipped
# term is chosen, 0 when the clipped (constant) one is.
@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "clipped", "grad"),
    [
        (1.5, 1.0, -1.28, True, 0.0),  # -min(1.5, 1.28)
        (0.5, 1.0, -0.5, False, -0.5),  # -min(0.5, 0.8): below the range, A > 0: not clipped
        (1.1, 1.0, -1.1, False, -1.1),  # inside the range
        (1.5, -1.0, 1.5, False, 1.5),  # -min(-1.5, -1.28): above the range, A < 0: not clipped
        (0.5, -1.0, 0.8, True, 0.0),  # -min(-0.5, -0.8)
        (0.9, -2.0, 1.8, False, 1.8),  # -min(-1.8, -1.8)... clip(0.9) = 0.9: equal, not clipped
    ],
)
def test_ppo_clip(ratio: float, adv: float, loss: float, clipped: bool, grad: float) -> None:
    inputs = make_inputs([math.log(ratio)], [0.0], [adv], [1], [0])
    got_loss, got_grad, metrics = loss_and_grad(Dapo(), inputs)
    assert got_loss == pytest.approx(loss)
    assert got_grad == pytest.approx([grad])
    assert metrics["clip_fraction"] == (1.0 if clipped else 0.0)
    assert metrics["ratio_mean"] == pytest.approx(ratio)


def test_clip_fraction_over_several_tokens() -> None:
    # The six cases above as one sequence: clipped at tokens 0 and 4 -> 2/6.
    # Loss: (-1.28 - 0.5 - 1.1 + 1.5 + 0.8 + 1.8) / 6 = 1.22 / 6 = 0.2033333.
    ratios = [1.5, 0.5, 1.1, 1.5, 0.5, 0.9]
    inputs = make_inputs([math.log(r) for r in ratios], [0.0] * 6, [1, 1, 1, -1, -1, -2], [1] * 6, [0] * 6)
    got_loss, _, metrics = loss_and_grad(Dapo(), inputs)
    assert got_loss == pytest.approx(0.2033333)
    assert metrics["clip_fraction"] == pytest.approx(1 / 3)
    assert metrics["ratio_mean"] == pytest.approx(6.0 / 6)


# Dual-clip, c = 3: for A < 0 the loss is min(pg, 3|A|).
@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "dual", "grad"),
    [
        (4.0, -1.0, 3.0, True, 0.0),  # pg = -min(-4, -1.28) = 4 > 3 -> 3
        (2.0, -1.0, 2.0, False, 2.0),  # pg = 2 <= 3
        (8.0, -0.5, 1.5, True, 0.0),  # pg = 4 > 3 * 0.5 = 1.5
        (0.5, -1.0, 0.8, False, 0.0),  # pg = 0.8 (PPO-clipped), under 3
        (4.0, 1.0, -1.28, False, 0.0),  # A > 0: dual-clip does not apply, PPO clip gives -1.28
    ],
)
def test_dual_clip(ratio: float, adv: float, loss: float, dual: bool, grad: float) -> None:
    inputs = make_inputs([math.log(ratio)], [0.0], [adv], [1], [0])
    got_loss, got_grad, metrics = loss_and_grad(Dapo(DapoConfig(dual_clip_c=3.0)), inputs)
    assert got_loss == pytest.approx(loss)
    assert got_grad == pytest.approx([grad])
    assert metrics["dual_clip_fraction"] == (1.0 if dual else 0.0)
    # Without dual-clip the first case would cost 4.
    if ratio == 4.0 and adv == -1.0:
        assert Dapo().loss(inputs)[0].item() == pytest.approx(4.0)


# -- GSPO -------------------------------------------------------------------
#
#   seq 0: masked prompt token (junk), then log-ratios 0.1, 0.3: mean 0.2, s0 = exp(0.2) = 1.2214028, A = +1
#   seq 1: masked prompt token, then log-ratios -0.2, -0.4, 0.0: mean -0.2, s1 = exp(-0.2) = 0.8187308, A = -1
GSPO_OLD = [0.0, -1.0, -1.0, 0.0, -1.0, -1.0, -1.0]
GSPO_LOGP = [-30.0, -0.9, -0.7, 9.0, -1.2, -1.4, -1.0]
GSPO_ADV = [0.0, 1.0, 1.0, 0.0, -1.0, -1.0, -1.0]
GSPO_MASK = [0, 1, 1, 0, 1, 1, 1]
GSPO_SEQ = [0, 0, 0, 1, 1, 1, 1]


def test_gspo_sequence_ratio_clipped_per_sequence() -> None:
    # Default ranges 3e-4 / 4e-4 -> [0.9997, 1.0004]; seq-mean-token-mean over 2 sequences.
    #   seq 0: -min(1.2214 * 1, 1.0004 * 1) = -1.0004 on each token, token mean -1.0004
    #   seq 1: -min(0.8187 * -1, 0.9997 * -1) = 0.9997 on each token, token mean 0.9997
    #   loss = (-1.0004 + 0.9997) / 2 = -0.00035; every token clipped, no gradient.
    # ratio_mean = (2 * 1.2214028 + 3 * 0.8187308) / 5 = 0.9797996
    inputs = make_inputs(GSPO_LOGP, GSPO_OLD, GSPO_ADV, GSPO_MASK, GSPO_SEQ)
    got_loss, got_grad, metrics = loss_and_grad(Gspo(), inputs)
    assert got_loss == pytest.approx(-0.00035, abs=1e-9)
    assert got_grad == pytest.approx([0.0] * 7)
    assert metrics["clip_fraction"] == pytest.approx(1.0)
    assert metrics["ratio_mean"] == pytest.approx(0.9797996)


def test_gspo_unclipped_value_and_token_gradient() -> None:
    # Wide ranges [0.8, 1.28]: both sequence ratios pass unclipped.
    #   loss = (-1.2214028 + 0.8187308) / 2 = -0.2013360
    # GSPO-token gradient: s_i * (-A_i) * w_t with w_t = 1 / (n_i * 2):
    #   seq 0: -1.2214028 / 4 = -0.3053507;  seq 1: 0.8187308 / 6 = 0.1364551
    # the same as the gradient of the sequence-level objective -A_i * exp(mean_t(logp - old)) / 2.
    inputs = make_inputs(GSPO_LOGP, GSPO_OLD, GSPO_ADV, GSPO_MASK, GSPO_SEQ)
    got_loss, got_grad, metrics = loss_and_grad(Gspo(GspoConfig(clip_low=0.2, clip_high=0.28)), inputs)
    assert got_loss == pytest.approx(-0.2013360)
    assert got_grad == pytest.approx([0, -0.3053507, -0.3053507, 0, 0.1364551, 0.1364551, 0.1364551])
    assert metrics["clip_fraction"] == 0.0


# -- KL ---------------------------------------------------------------------
#
#   d = logp - ref = 0.5:  k1 = 0.5,  k2 = 0.125, k3 = exp(-0.5) + 0.5 - 1 = 0.1065307
#   d = -0.5:              k1 = -0.5, k2 = 0.125, k3 = exp(0.5) - 0.5 - 1 = 0.1487213
@pytest.mark.parametrize(
    ("estimator", "expected"),
    [("k1", [0.5, -0.5, 0.0]), ("k2", [0.125, 0.125, 0.0]), ("k3", [0.1065307, 0.1487213, 0.0])],
)
def test_kl_estimators(estimator: str, expected: list[float]) -> None:
    got = kl_estimate(t([-1.0, -2.0, -0.3]), t([-1.5, -1.5, -0.3]), estimator)
    assert got.tolist() == pytest.approx(expected, abs=1e-7)


def test_kl_term_in_the_loss() -> None:
    # A = 0, so the loss is kl_coef * token-mean(k3) = 0.1 * (0.1065307 + 0.1487213) / 2 = 0.0127626.
    # d k3 / d logp = 1 - exp(-d): d = 0.5 -> 0.3934693, d = -0.5 -> -0.6487213; times 0.1 / 2
    # -> 0.01967347, -0.03243606.
    inputs = make_inputs([-1.0, -2.0], [-1.0, -2.0], [0.0, 0.0], [1, 1], [0, 0], ref=[-1.5, -1.5])
    algo = Dapo(DapoConfig(kl_coef=0.1))
    assert algo.needs_reference
    got_loss, got_grad, metrics = loss_and_grad(algo, inputs)
    assert got_loss == pytest.approx(0.0127626)
    assert got_grad == pytest.approx([0.01967347, -0.03243606])
    assert metrics["kl"] == pytest.approx(0.1276260)
    # kl_in_reward: the KL moves to the rewards; the loss has none, the metric stays.
    in_reward = Dapo(DapoConfig(kl_coef=0.1, kl_in_reward=True))
    assert in_reward.needs_reference
    loss, metrics = in_reward.loss(inputs)
    assert loss.item() == 0.0 and metrics["kl"].item() == pytest.approx(0.1276260)
    # k1 in the loss: 0.1 * (0.5 - 0.5) / 2 = 0, gradient 0.1 / 2 on each token.
    got_loss, got_grad, _ = loss_and_grad(Dapo(DapoConfig(kl_coef=0.1, kl_estimator="k1")), inputs)
    assert got_loss == pytest.approx(0.0) and got_grad == pytest.approx([0.05, 0.05])


def test_kl_in_the_loss_needs_reference_logprobs() -> None:
    inputs = make_inputs([-1.0], [-1.0], [1.0], [1], [0])
    with pytest.raises(ValueError, match="ref_logprobs"):
        Grpo(GrpoConfig(kl_coef=0.1)).loss(inputs)
    assert "kl" not in Grpo().loss(inputs)[1]


def test_teacher_kl_term_in_the_loss() -> None:
    # A = 0, token-mean over 2 tokens, logp - teacher = 0.5 and -0.5, teacher_kl_coef 0.2.
    # k2: loss 0.2 * (0.125 + 0.125) / 2 = 0.025; d/d logp = 0.2 * d / 2 -> 0.05, -0.05 (the
    # reverse KL's gradient on the student's own samples: pushed toward the teacher's logprob).
    inputs = make_inputs([-1.0, -2.0], [-1.0, -2.0], [0.0, 0.0], [1, 1], [0, 0])
    inputs.teacher_logprobs = t([-1.5, -1.5])
    algo = Dapo(DapoConfig(teacher_kl_coef=0.2))
    got_loss, got_grad, metrics = loss_and_grad(algo, inputs)
    assert got_loss == pytest.approx(0.025) and got_grad == pytest.approx([0.05, -0.05])
    assert metrics["teacher_kl_loss"] == pytest.approx(0.125)
    assert not algo.needs_reference  # the teacher is not a frozen copy of the policy
    # k3: 0.2 * (0.1065307 + 0.1487213) / 2 = 0.0255252; d/d logp = 0.2 (1 - exp(-d)) / 2.
    got_loss, got_grad, _ = loss_and_grad(Dapo(DapoConfig(teacher_kl_coef=0.2, teacher_kl_estimator="k3")), inputs)
    assert got_loss == pytest.approx(0.0255252) and got_grad == pytest.approx([0.03934693, -0.06487213])
    # Beside the policy gradient: the two add up.
    adv = make_inputs([-1.0, -2.0], [-1.0, -2.0], [1.0, 1.0], [1, 1], [0, 0])
    pg_only, pg_grad, _ = loss_and_grad(Dapo(DapoConfig()), adv)
    adv.teacher_logprobs = t([-1.5, -1.5])
    both, both_grad, _ = loss_and_grad(Dapo(DapoConfig(teacher_kl_coef=0.2)), adv)
    assert both == pytest.approx(pg_only + 0.025)
    assert both_grad == pytest.approx([pg_grad[0] + 0.05, pg_grad[1] - 0.05])


def test_teacher_kl_over_the_teachers_top_k() -> None:
    # One token, the teacher's top 2 with p = 0.5, 0.3; the policy gives them 0.4, 0.4.
    # tkl = 0.5 ln(0.5 / 0.4) + 0.3 ln(0.3 / 0.4) = 0.1115718 - 0.0863046 = 0.0252672;
    # d/dS_j = -coef p_j: -0.5, -0.3 (coef 1, token-mean over one token).
    inputs = make_inputs([-1.0], [-1.0], [0.0], [1], [0])
    inputs.teacher_topk_logprobs = t([[math.log(0.5), math.log(0.3)]])
    inputs.topk_logprobs = t([[math.log(0.4), math.log(0.4)]]).requires_grad_(True)
    algo = Dapo(DapoConfig(teacher_kl_coef=1.0, teacher_kl_topk=2))
    loss, metrics = algo.loss(inputs)
    (grad,) = torch.autograd.grad(loss, inputs.topk_logprobs)
    assert loss.item() == pytest.approx(0.0252672, abs=1e-6) and metrics["teacher_kl_loss"].item() == pytest.approx(0.0252672, abs=1e-6)
    assert grad[0].tolist() == pytest.approx([-0.5, -0.3])
    # A token outside the mask contributes nothing, whatever its (finite) numbers.
    masked = make_inputs([-1.0, -1.0], [-1.0, -1.0], [0.0, 0.0], [1, 0], [0, 0])
    masked.teacher_topk_logprobs = t([[math.log(0.5), math.log(0.3)], [-1.0e4, -1.0e4]])
    masked.topk_logprobs = t([[math.log(0.4), math.log(0.4)], [-50.0, 3.0]])
    assert algo.loss(masked)[0].item() == pytest.approx(0.0252672, abs=1e-6)
    with pytest.raises(ValueError, match="teacher_topk_logprobs"):
        algo.loss(make_inputs([-1.0], [-1.0], [0.0], [1], [0]))
    from skyrl_algorithms._algorithm import declared_traits

    assert declared_traits(DapoConfig(teacher_kl_coef=1.0, teacher_kl_topk=2)).teacher_topk == 2
    assert declared_traits(DapoConfig(teacher_kl_topk=2)).teacher_topk == 0  # no coefficient: no teacher asked


def test_teacher_kl_needs_the_teachers_logprobs_and_declares_it() -> None:
    from skyrl_algorithms._algorithm import declared_traits
    inputs = make_inputs([-1.0], [-1.0], [1.0], [1], [0])
    with pytest.raises(ValueError, match="teacher_logprobs"):
        Grpo(GrpoConfig(teacher_kl_coef=0.1)).loss(inputs)
    assert "teacher_kl_loss" not in Grpo().loss(inputs)[1]
    assert declared_traits(GrpoConfig(teacher_kl_coef=0.1)).teacher and not declared_traits(GrpoConfig()).teacher


# -- truncated importance sampling --------------------------------------------
#
# old = 0, ratio 1, A = 1, engine logprobs -1, -0.1, 0.5, cap 2:
#   w = min(exp(0 - engine), 2) = min(2.7182818, 2) = 2, exp(0.1) = 1.1051709, exp(-0.5) = 0.6065307
#   loss = -(2 + 1.1051709 + 0.6065307) / 3 = -1.2372339; the weight is detached: grad -w / 3.
def test_truncated_importance_sampling() -> None:
    inputs = make_inputs([0.0] * 3, [0.0] * 3, [1.0] * 3, [1] * 3, [0] * 3, engine=[-1.0, -0.1, 0.5])
    algo = Grpo(GrpoConfig(tis_cap=2.0, loss_agg="token-mean"))
    got_loss, got_grad, metrics = loss_and_grad(algo, inputs)
    assert got_loss == pytest.approx(-1.2372339)
    assert got_grad == pytest.approx([-0.6666667, -0.3683903, -0.2021769])
    assert metrics["tis_weight_mean"] == pytest.approx(1.2372339)
    assert "tis_weight_mean" not in Grpo().loss(inputs)[1]


# -- micro-batch shares -----------------------------------------------------------


def random_step(seed: int):
    """Five sequences (one masked prompt token each) as per-token tensors."""
    g = torch.Generator().manual_seed(seed)
    lens = [3, 5, 2, 4, 6]
    seq_ids = torch.repeat_interleave(torch.arange(5), torch.tensor(lens))
    n = int(sum(lens))
    mask = torch.ones(n, dtype=F64)
    starts = [0, 3, 8, 10, 14]
    mask[starts] = 0
    old = -1 - torch.rand(n, generator=g, dtype=F64)
    logp = old + 0.3 * torch.randn(n, generator=g, dtype=F64)
    engine = old + 0.3 * torch.randn(n, generator=g, dtype=F64)
    ref = old + 0.2 * torch.randn(n, generator=g, dtype=F64)
    adv = torch.randn(5, generator=g, dtype=F64)[seq_ids] * mask
    return dict(logp=logp, old=old, engine=engine, ref=ref, adv=adv, mask=mask, seq_ids=seq_ids, starts=starts)


def inputs_for(step, logp, lo: int, hi: int, first_seq: int, n_seqs: int) -> LossInputs:
    return LossInputs(
        logprobs=logp[lo:hi],
        old_logprobs=step["old"][lo:hi],
        engine_logprobs=step["engine"][lo:hi],
        advantages=step["adv"][lo:hi],
        mask=step["mask"][lo:hi],
        seq_ids=step["seq_ids"][lo:hi] - first_seq,
        n_seqs=n_seqs,
        global_tokens=float(step["mask"].sum()),
        global_seqs=5.0,
        ref_logprobs=step["ref"][lo:hi],
        max_response_len=6,
    )


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_shares_add_up_to_the_step(mode: str, ratio_level: str) -> None:
    step = random_step(seed=3)
    cfg = GrpoConfig(
        clip_low=0.1, clip_high=0.15, dual_clip_c=1.5, ratio_level=ratio_level, loss_agg=mode, kl_coef=0.05, tis_cap=1.2
    )
    algo = Grpo(cfg)
    whole = step["logp"].clone().requires_grad_(True)
    full_loss, full_metrics = algo.loss(inputs_for(step, whole, 0, 20, 0, 5))
    (full_grad,) = torch.autograd.grad(full_loss, whole)

    split = step["logp"].clone().requires_grad_(True)
    cut = step["starts"][2]  # sequences 0-1 | 2-4
    first, m1 = algo.loss(inputs_for(step, split, 0, cut, 0, 2))
    second, m2 = algo.loss(inputs_for(step, split, cut, 20, 2, 3))
    (split_grad,) = torch.autograd.grad(first + second, split)

    assert (first + second).item() == pytest.approx(full_loss.item(), abs=1e-12)
    assert torch.allclose(split_grad, full_grad, rtol=0, atol=1e-12)
    assert set(m1) == set(full_metrics)
    # Metrics: the step's value is the micro-batches' average weighted by their loss tokens.
    n1, n2 = step["mask"][:cut].sum().item(), step["mask"][cut:].sum().item()
    for key, value in full_metrics.items():
        weighted = (n1 * m1[key] + n2 * m2[key]).item() / (n1 + n2)
        assert weighted == pytest.approx(value.item(), abs=1e-12), key
    assert full_metrics["pg_loss"].item() + cfg.kl_coef * full_metrics["kl_loss"].item() == pytest.approx(
        full_loss.item(), abs=1e-12
    )
    # The example exercises the clipped branches and the gradient is not trivially zero.
    assert full_metrics["clip_fraction"].item() > 0
    assert full_grad.abs().sum().item() > 0
    assert not any(v.requires_grad for v in full_metrics.values())


def test_float32_inputs_give_float32_loss() -> None:
    inputs = make_inputs(AGG_LOGP, AGG_OLD, AGG_ADV, AGG_MASK, AGG_SEQ)
    inputs.logprobs = inputs.logprobs.detach().float().requires_grad_(True)
    inputs.old_logprobs = inputs.old_logprobs.float()
    inputs.advantages = inputs.advantages.float()
    inputs.mask = torch.tensor(AGG_MASK, dtype=torch.uint8)  # a byte mask works too
    loss, metrics = Grpo().loss(inputs)
    assert loss.dtype == torch.float32
    # seq-mean-token-mean over the micro-batch's own 2 sequences: (-1 - 0.5) / 2
    assert loss.item() == pytest.approx(-0.75)


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_junk_outside_the_mask_never_reaches_loss_or_gradient(ratio_level: str) -> None:
    # The aggregation example with NaN/inf on the prompt tokens of every input.
    nan, inf = float("nan"), float("inf")
    inputs = make_inputs(
        [nan, -1.0, -2.0, inf, -1.0, -0.7, -3.0],
        [nan, -1.0, -2.0, -inf, -1.0, -0.7, -3.0],
        [nan, 1.0, 1.0, inf, 0.5, 0.5, 0.5],
        AGG_MASK,
        AGG_SEQ,
        engine=[nan, -1.0, -2.0, inf, -1.0, -0.7, -3.0],
        ref=[nan, -1.0, -2.0, -inf, -1.0, -0.7, -3.0],
        global_tokens=10,
        global_seqs=4,
    )
    algo = Grpo(GrpoConfig(ratio_level=ratio_level, loss_agg="token-mean", kl_coef=0.1, tis_cap=2.0, dual_clip_c=3.0))
    got_loss, got_grad, metrics = loss_and_grad(algo, inputs)
    # Same as the token-mean case above (ratio 1, KL 0, TIS weight 1).
    assert got_loss == pytest.approx(-0.35)
    assert got_grad == pytest.approx([0, -0.1, -0.1, 0, -0.05, -0.05, -0.05])
    assert all(math.isfinite(v) for v in metrics.values())
