"""The off-policy corrections against hand-computed values: truncated (TIS) and masked
(MIS) importance sampling at token, sequence and geometric level, IcePop, the decoupled
PPO objective, their gradients and metrics, the config rules, ``tis_cap`` as before,
and a tiny job that writes the new metrics.

Throughout, ``rho = pi_prox / pi_behav = exp(old - engine)`` (``old``: the trainer's
logprobs before the update, the proximal policy; ``engine``: the behaviour policy)."""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_algorithms._losses import LOG_RATIO_LIMIT
from skyrl_algorithms.grpo import Grpo, GrpoConfig
from skyrl_algorithms.gspo import Gspo, GspoConfig
from skyrl_host.config import Located, structure_table
from skyrl_host.interfaces import LossInputs
from skyrl_host.options import OptionError
from skyrl_host.testing import step_rows

F64 = torch.float64
E = math.exp


def make_inputs(logp, old, adv, mask, seq_ids, *, engine, global_tokens=None, global_seqs=None) -> LossInputs:
    n_seqs = max(seq_ids) + 1
    return LossInputs(
        logprobs=torch.tensor(logp, dtype=F64).requires_grad_(True),
        old_logprobs=torch.tensor(old, dtype=F64),
        engine_logprobs=torch.tensor(engine, dtype=F64),
        advantages=torch.tensor(adv, dtype=F64),
        mask=torch.tensor(mask, dtype=F64),
        seq_ids=torch.tensor(seq_ids, dtype=torch.int64),
        n_seqs=n_seqs,
        global_tokens=float(sum(mask) if global_tokens is None else global_tokens),
        global_seqs=float(n_seqs if global_seqs is None else global_seqs),
    )


def run(inputs: LossInputs, **options):
    """loss, d loss / d logprobs, metrics for a grpo with token-mean and ``options``."""
    algo = Grpo(GrpoConfig(loss_agg="token-mean", **options))
    loss, metrics = algo.loss(inputs)
    (grad,) = torch.autograd.grad(loss, inputs.logprobs)
    return loss.item(), grad.tolist(), {k: v.item() for k, v in metrics.items()}


# -- token level ----------------------------------------------------------------------
#
# logp = old = 0 (PPO ratio 1, no clipping), A = 1 on 3 tokens, engine -1, -0.1, 0.5:
#   rho = e^1 = 2.71828, e^0.1 = 1.10517, e^-0.5 = 0.60653;  loss = -sum(w) / 3, grad -w / 3.
TOKEN = dict(logp=[0.0] * 3, old=[0.0] * 3, adv=[1.0] * 3, mask=[1] * 3, seq_ids=[0] * 3, engine=[-1.0, -0.1, 0.5])
RHO = [E(1.0), E(0.1), E(-0.5)]
KL = sum(r - 1 - math.log(r) for r in RHO) / 3  # k3 of KL(behaviour || proximal), per token


def test_token_tis_truncates_at_the_cap() -> None:
    w = [2.0, E(0.1), E(-0.5)]  # min(rho, 2)
    loss, grad, m = run(make_inputs(**TOKEN), off_policy="tis", off_policy_cap=2.0)
    assert loss == pytest.approx(-(w[0] + w[1] + w[2]) / 3)
    assert loss == pytest.approx(-1.2372339)
    assert grad == pytest.approx([-x / 3 for x in w])
    assert m["off_policy_weight_mean"] == pytest.approx(sum(w) / 3)
    assert m["off_policy_ratio_mean"] == pytest.approx(sum(RHO) / 3)
    assert m["off_policy_truncated_fraction"] == pytest.approx(1 / 3)
    assert m["off_policy_kl"] == pytest.approx(KL)
    assert "off_policy_masked_fraction" not in m and "tis_weight_mean" not in m


def test_token_mis_masks_tokens_over_the_cap_and_keeps_the_ratio_elsewhere() -> None:
    w = [0.0, E(0.1), E(-0.5)]  # rho if rho <= 2 else 0
    loss, grad, m = run(make_inputs(**TOKEN), off_policy="mis", off_policy_cap=2.0)
    assert loss == pytest.approx(-(E(0.1) + E(-0.5)) / 3)
    assert grad == pytest.approx([0.0, -E(0.1) / 3, -E(-0.5) / 3])
    assert grad[0] == 0.0  # exactly: the masked token gets no gradient
    assert m["off_policy_weight_mean"] == pytest.approx(sum(w) / 3)
    assert m["off_policy_masked_fraction"] == pytest.approx(1 / 3)
    assert m["off_policy_kl"] == pytest.approx(KL)
    assert "off_policy_truncated_fraction" not in m


def test_the_docs_example() -> None:
    # docs/algorithms.md, "Off-policy corrections": the same three tokens under each setting.
    for options, want in (
        (dict(tis_cap=2.0), -1.2372), (dict(off_policy="tis", off_policy_cap=2.0), -1.2372),
        (dict(off_policy="mis", off_policy_cap=2.0), -0.5706), (dict(off_policy="icepop", icepop_beta=2.0), -0.5706),
        (dict(decoupled=True), -1.4767),
    ):
        assert run(make_inputs(**TOKEN), **options)[0] == pytest.approx(want, abs=1e-4), options


# IcePop: 4 tokens, engine -1, -0.1, 0.8, 0.5: rho = 2.718, 1.105, e^-0.8 = 0.4493, 0.6065.
ICE = dict(logp=[0.0] * 4, old=[0.0] * 4, adv=[1.0] * 4, mask=[1] * 4, seq_ids=[0] * 4, engine=[-1.0, -0.1, 0.8, 0.5])


def test_icepop_masks_tokens_outside_one_over_beta_to_beta() -> None:
    # beta = 2: kept iff 0.5 <= rho <= 2 -> tokens 1 and 3, each weighted by its rho.
    loss, grad, m = run(make_inputs(**ICE), off_policy="icepop", icepop_beta=2.0)
    assert loss == pytest.approx(-(E(0.1) + E(-0.5)) / 4)
    assert grad == pytest.approx([0.0, -E(0.1) / 4, 0.0, -E(-0.5) / 4])
    assert grad[0] == 0.0 and grad[2] == 0.0
    assert m["off_policy_masked_fraction"] == pytest.approx(2 / 4)
    assert m["off_policy_weight_mean"] == pytest.approx((E(0.1) + E(-0.5)) / 4)
    # icepop_alpha = 0.4 moves the lower bound: e^-0.8 = 0.449 is kept now.
    loss, grad, m = run(make_inputs(**ICE), off_policy="icepop", icepop_beta=2.0, icepop_alpha=0.4)
    assert loss == pytest.approx(-(E(0.1) + E(-0.8) + E(-0.5)) / 4)
    assert m["off_policy_masked_fraction"] == pytest.approx(1 / 4)
    # MIS with the same cap masks only above: e^-0.8 is kept, only e^1 goes.
    _, _, m = run(make_inputs(**ICE), off_policy="mis", off_policy_cap=2.0)
    assert m["off_policy_masked_fraction"] == pytest.approx(1 / 4)


# -- sequence level -------------------------------------------------------------------
#
# Two sequences, a prompt token (NaN junk, masked) first in each; logp = old (ratio 1).
#   seq 0: d = old - engine = 0.3, 0.4, A = 1        sum 0.7 -> e^0.7 = 2.0138; mean 0.35 -> e^0.35 = 1.4191
#   seq 1: d = 0.5, -0.2, 0.1, A = -0.5              sum 0.4 -> e^0.4 = 1.4918; mean 0.4/3 -> 1.1426
# Every d_t alone is <= 0.5 (rho <= 1.6487 < 2): token level truncates nothing.
# Token losses with ratio 1: -A w (seq 0: -w, seq 1: +0.5 w); token-mean over 5 tokens.
NAN = float("nan")
SEQ = dict(
    logp=[NAN, 0.0, 0.0, NAN, 0.0, 0.0, 0.0],
    old=[NAN, 0.0, 0.0, NAN, 0.0, 0.0, 0.0],
    engine=[NAN, -0.3, -0.4, NAN, -0.5, 0.2, -0.1],
    adv=[NAN, 1.0, 1.0, NAN, -0.5, -0.5, -0.5],
    mask=[0, 1, 1, 0, 1, 1, 1],
    seq_ids=[0, 0, 0, 1, 1, 1, 1],
)
SIGN = [0.0, -1.0, -1.0, 0.0, 0.5, 0.5, 0.5]  # d pg_t / d (w_t * ratio) = -A


def expected(w):
    """loss and gradient for per-token weights ``w`` (prompt tokens 0)."""
    return sum(s * x for s, x in zip(SIGN, w)) / 5, [s * x / 5 for s, x in zip(SIGN, w)]


@pytest.mark.parametrize(
    "options, w, masked, truncated",
    [
        # token TIS, cap 2: nothing truncated, w = e^d per token
        (dict(off_policy="tis", off_policy_cap=2.0),
         [0, E(0.3), E(0.4), 0, E(0.5), E(-0.2), E(0.1)], None, 0.0),
        # sequence TIS, cap 2: seq 0's product 2.0138 is truncated to 2 on both its tokens
        (dict(off_policy="tis", off_policy_cap=2.0, off_policy_level="sequence"),
         [0, 2.0, 2.0, 0, E(0.4), E(0.4), E(0.4)], None, 2 / 5),
        # sequence MIS, cap 2: seq 0 is dropped whole, seq 1 keeps its product
        (dict(off_policy="mis", off_policy_cap=2.0, off_policy_level="sequence"),
         [0, 0.0, 0.0, 0, E(0.4), E(0.4), E(0.4)], 2 / 5, None),
        # token MIS, cap 2: nothing over the cap, the same weights as token TIS
        (dict(off_policy="mis", off_policy_cap=2.0),
         [0, E(0.3), E(0.4), 0, E(0.5), E(-0.2), E(0.1)], 0.0, None),
        # geometric MIS, cap 1.2: seq 0's e^0.35 = 1.419 > 1.2 is dropped, seq 1's 1.1426 kept
        (dict(off_policy="mis", off_policy_cap=1.2, off_policy_level="geometric"),
         [0, 0.0, 0.0, 0, E(0.4 / 3), E(0.4 / 3), E(0.4 / 3)], 2 / 5, None),
        # geometric TIS, cap 1.2: seq 0 truncated to 1.2
        (dict(off_policy="tis", off_policy_cap=1.2, off_policy_level="geometric"),
         [0, 1.2, 1.2, 0, E(0.4 / 3), E(0.4 / 3), E(0.4 / 3)], None, 2 / 5),
    ],
)
def test_sequence_and_token_levels(options, w, masked, truncated) -> None:
    loss, grad, m = run(make_inputs(**SEQ), **options)
    want_loss, want_grad = expected(w)
    assert loss == pytest.approx(want_loss)
    assert grad == pytest.approx(want_grad)
    assert m["off_policy_weight_mean"] == pytest.approx(sum(w) / 5)
    assert m.get("off_policy_masked_fraction") == (None if masked is None else pytest.approx(masked))
    assert m.get("off_policy_truncated_fraction") == (None if truncated is None else pytest.approx(truncated))
    # The KL estimate is per token whatever the level.
    d = [0.3, 0.4, 0.5, -0.2, 0.1]
    assert m["off_policy_kl"] == pytest.approx(sum(E(x) - 1 - x for x in d) / 5)
    assert all(math.isfinite(v) for v in m.values())


def test_sequence_level_differs_from_token_level() -> None:
    token = run(make_inputs(**SEQ), off_policy="tis", off_policy_cap=2.0)
    sequence = run(make_inputs(**SEQ), off_policy="tis", off_policy_cap=2.0, off_policy_level="sequence")
    # seq 0: token level weighs e^0.3 and e^0.4, sequence level 2 on both (the product 2.0138, truncated)
    assert token[0] == pytest.approx(-(E(0.3) + E(0.4)) / 5 + 0.5 * (E(0.5) + E(-0.2) + E(0.1)) / 5)
    assert sequence[0] == pytest.approx(-4.0 / 5 + 1.5 * E(0.4) / 5)
    assert sequence[0] == pytest.approx(-0.3524526)
    assert token[0] != pytest.approx(sequence[0])


def test_sequence_ratio_with_gspo_and_micro_batches_of_one_sequence() -> None:
    # The off-policy weight multiplies GSPO's clipped sequence loss the same way.
    inputs = make_inputs(**SEQ)
    algo = Gspo(GspoConfig(loss_agg="token-mean", off_policy="mis", off_policy_cap=2.0, off_policy_level="sequence"))
    loss, _ = algo.loss(inputs)
    assert loss.item() == pytest.approx(1.5 * E(0.4) / 5)


# -- decoupled PPO --------------------------------------------------------------------
#
# old (proximal) = 0; logp = 0.5, -0.1, 0.05; engine (behaviour) 0.2, -0.3, -1.0; A = 1, 1, -1.
#   r = pi / pi_prox = e^0.5 = 1.6487, e^-0.1 = 0.9048, e^0.05 = 1.0513, clipped to [0.8, 1.2]
#   pg = max(-r A, -clip(r) A):  t0 -1.2 (clipped: no gradient), t1 -e^-0.1, t2 +e^0.05
#   rho = pi_prox / pi_behav = e^-0.2 = 0.8187, e^0.3 = 1.3499, e^1 = 2.7183  (detached)
#   decoupled loss = (1/3) sum rho_t pg_t, grad (1/3) rho_t d pg_t/d logp_t: 0, -rho1 r1, +rho2 r2
DEC = dict(logp=[0.5, -0.1, 0.05], old=[0.0] * 3, adv=[1.0, 1.0, -1.0], mask=[1] * 3, seq_ids=[0] * 3,
           engine=[0.2, -0.3, -1.0])


def test_decoupled_ppo_weighs_the_clipped_loss_by_the_behaviour_ratio() -> None:
    rho = [E(-0.2), E(0.3), E(1.0)]
    pg = [-1.2, -E(-0.1), E(0.05)]
    loss, grad, m = run(make_inputs(**DEC), decoupled=True)
    assert loss == pytest.approx(sum(r * p for r, p in zip(rho, pg)) / 3)
    assert loss == pytest.approx((-1.2 * 0.8187308 - 0.9048374 * 1.3498588 + 1.0512711 * 2.7182818) / 3)
    assert grad == pytest.approx([0.0, -rho[1] * E(-0.1) / 3, rho[2] * E(0.05) / 3])
    assert m["off_policy_weight_mean"] == pytest.approx(sum(rho) / 3)
    assert m["clip_fraction"] == pytest.approx(1 / 3)  # the clip is on pi / pi_prox: only t0
    assert "off_policy_masked_fraction" not in m
    # With off_policy_cap = 2, t2 (rho = 2.718) is masked out.
    loss, grad, m = run(make_inputs(**DEC), decoupled=True, off_policy_cap=2.0)
    assert loss == pytest.approx((rho[0] * pg[0] + rho[1] * pg[1]) / 3)
    assert grad[2] == 0.0
    assert m["off_policy_masked_fraction"] == pytest.approx(1 / 3)
    # Without the correction the behaviour policy is ignored: PPO on pi / pi_prox alone.
    loss, _, m = run(make_inputs(**DEC))
    assert loss == pytest.approx(sum(pg) / 3)
    assert "off_policy_weight_mean" not in m


# -- gradients ------------------------------------------------------------------------


def random_inputs(seed: int, n_seqs: int = 4, length: int = 5) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = n_seqs * length
    old = -1 - torch.rand(n, generator=g, dtype=F64)
    return dict(
        logp=(old + 0.3 * torch.randn(n, generator=g, dtype=F64)).tolist(),
        old=old.tolist(),
        engine=(old + 0.5 * torch.randn(n, generator=g, dtype=F64)).tolist(),
        adv=torch.randn(n_seqs, generator=g, dtype=F64).repeat_interleave(length).tolist(),
        mask=[0 if i % length == 0 else 1 for i in range(n)],
        seq_ids=[i // length for i in range(n)],
    )


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_each_tokens_gradient_is_the_uncorrected_one_times_its_weight(mode: str) -> None:
    data = random_inputs(seed=5)
    _, plain, _ = run(make_inputs(**data), clip_low=0.1, clip_high=0.1, dual_clip_c=2.0)
    _, got, m = run(make_inputs(**data), clip_low=0.1, clip_high=0.1, dual_clip_c=2.0, off_policy=mode, off_policy_cap=1.3)
    masked = 0
    for i, (g0, g) in enumerate(zip(plain, got)):
        rho = E(data["old"][i] - data["engine"][i]) if data["mask"][i] else 0.0
        if mode == "tis":
            w = min(rho, 1.3)
        else:
            w = rho if rho <= 1.3 else 0.0
            masked += data["mask"][i] and rho > 1.3
        assert g == pytest.approx(g0 * w, abs=1e-12), i
    if mode == "mis":  # the example masks some tokens and keeps others
        assert 0 < masked < sum(data["mask"])
        assert m["off_policy_masked_fraction"] == pytest.approx(masked / sum(data["mask"]))


@pytest.mark.parametrize(
    "options",
    [
        dict(off_policy="tis", off_policy_cap=1.5),
        dict(off_policy="mis", off_policy_cap=1.5, off_policy_level="sequence"),
        dict(off_policy="tis", off_policy_cap=1.1, off_policy_level="geometric"),
        dict(off_policy="icepop", icepop_beta=1.5),
        dict(decoupled=True, off_policy_cap=2.0),
    ],
)
def test_micro_batch_shares_and_metrics_add_up_to_the_step(options) -> None:
    data = random_inputs(seed=11)
    algo = Grpo(GrpoConfig(loss_agg="seq-mean-token-mean", **options))
    whole = make_inputs(**data)
    full, full_m = algo.loss(whole)
    (full_grad,) = torch.autograd.grad(full, whole.logprobs)
    cut = 10  # sequences 0-1 | 2-3

    def part(lo: int, hi: int) -> LossInputs:
        sub = {k: v[lo:hi] for k, v in data.items()}
        sub["seq_ids"] = [s - data["seq_ids"][lo] for s in sub["seq_ids"]]
        return make_inputs(**sub, global_tokens=sum(data["mask"]), global_seqs=4)

    a, b = part(0, cut), part(cut, 20)
    (la, ma), (lb, mb) = algo.loss(a), algo.loss(b)
    (ga,) = torch.autograd.grad(la, a.logprobs)
    (gb,) = torch.autograd.grad(lb, b.logprobs)
    assert (la + lb).item() == pytest.approx(full.item(), abs=1e-12)
    assert torch.allclose(torch.cat([ga, gb]), full_grad, rtol=0, atol=1e-12)
    na, nb = sum(data["mask"][:cut]), sum(data["mask"][cut:])
    assert set(ma) == set(full_m)
    for key, value in full_m.items():
        assert (na * ma[key] + nb * mb[key]).item() / (na + nb) == pytest.approx(value.item(), abs=1e-12), key


# -- tis_cap: as before -------------------------------------------------------------


def old_tis_loss(inputs: LossInputs, cap: float) -> torch.Tensor:
    """The token-mean loss of the tis_cap code before the off-policy options (ratio 1)."""
    on = inputs.mask != 0
    zero = torch.zeros_like(inputs.logprobs)
    ratio = torch.exp(torch.where(on, inputs.logprobs - inputs.old_logprobs, zero))
    adv = torch.where(on, inputs.advantages, zero)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    delta = torch.where(on, inputs.old_logprobs - inputs.engine_logprobs, zero)
    tis = torch.exp(delta.clamp(max=LOG_RATIO_LIMIT)).clamp(max=cap).detach()
    return (inputs.mask / inputs.global_tokens * pg * tis).sum()


def test_tis_cap_is_token_tis_and_unchanged() -> None:
    data = random_inputs(seed=2)
    old_inputs, new_inputs, spelled = make_inputs(**data), make_inputs(**data), make_inputs(**data)
    want = old_tis_loss(old_inputs, 1.4)
    (want_grad,) = torch.autograd.grad(want, old_inputs.logprobs)
    algo = Grpo(GrpoConfig(loss_agg="token-mean", tis_cap=1.4))
    got, m = algo.loss(new_inputs)
    (got_grad,) = torch.autograd.grad(got, new_inputs.logprobs)
    assert got.item() == pytest.approx(want.item(), abs=1e-15)
    assert torch.allclose(got_grad, want_grad, rtol=0, atol=1e-15)
    assert m["tis_weight_mean"].item() == m["off_policy_weight_mean"].item()
    assert 0 < m["off_policy_truncated_fraction"].item() < 1
    new, m2 = Grpo(GrpoConfig(loss_agg="token-mean", off_policy="tis", off_policy_cap=1.4)).loss(spelled)
    assert torch.equal(new, got)
    assert "tis_weight_mean" not in m2
    assert algo.off_policy == "tis"
    assert Grpo().off_policy == "none" and Grpo(GrpoConfig(decoupled=True)).off_policy == "decoupled"


# -- config rules ----------------------------------------------------------------------


def problems(data: dict) -> list[str]:
    out = Located("job.toml", {})
    structure_table(GrpoConfig, data, "algorithm", out)
    return [f"{p.key}: {p.message}" for p in out.problems]


def test_valid_combinations() -> None:
    for data in (
        {"off_policy": "tis", "off_policy_cap": 2},
        {"off_policy": "mis", "off_policy_cap": 2, "off_policy_level": "sequence"},
        {"off_policy": "icepop", "icepop_beta": 5, "icepop_alpha": 0.5},
        {"decoupled": True},
        {"decoupled": True, "off_policy_cap": 5},
        {"tis_cap": 2},
        {"tis_cap": 2, "off_policy": "tis"},
        {"tis_cap": 2, "off_policy": "tis", "off_policy_cap": 2},
    ):
        assert problems(data) == [], data


@pytest.mark.parametrize(
    "data, message",
    [
        ({"off_policy": "tis"}, "algorithm.off_policy_cap: off_policy = 'tis' needs off_policy_cap, the cap C (e.g. 2)"),
        ({"off_policy": "mis", "off_policy_level": "geometric"},
         "algorithm.off_policy_cap: off_policy = 'mis' needs off_policy_cap, the cap C (e.g. 2)"),
        ({"off_policy": "icepop"},
         "algorithm.icepop_beta: off_policy = 'icepop' needs icepop_beta, the upper bound (e.g. 5)"),
        ({"off_policy": "icepop", "icepop_beta": 5, "off_policy_level": "sequence"},
         "algorithm.off_policy_level: IcePop masks tokens: expected 'token', found 'sequence' (to mask whole "
         "sequences use off_policy = 'mis' with off_policy_level = 'sequence')"),
        ({"off_policy": "icepop", "icepop_beta": 5, "off_policy_cap": 2},
         "algorithm.off_policy_cap: off_policy = 'icepop' takes icepop_beta (and icepop_alpha), not off_policy_cap"),
        ({"off_policy": "tis", "off_policy_cap": 2, "icepop_beta": 5},
         "algorithm.icepop_beta: applies to off_policy = 'icepop' only, found off_policy = 'tis'"),
        ({"off_policy_cap": 2},
         "algorithm.off_policy_cap: applies to off_policy = 'tis' or 'mis' (or decoupled), found off_policy = 'none'"),
        ({"off_policy_level": "sequence"},
         "algorithm.off_policy_level: applies to off_policy = 'tis' or 'mis', found off_policy = 'none'"),
        ({"decoupled": True, "off_policy": "mis", "off_policy_cap": 2},
         "algorithm.decoupled: decoupled already weights each token by rho = exp(logp_old - logp_engine); "
         "off_policy = 'mis' weights it again: set off_policy = 'none' (with off_policy_cap to mask rho > C), or "
         "drop decoupled (off_policy = 'tis' is the decoupled objective with rho truncated at off_policy_cap)"),
        ({"decoupled": True, "off_policy_level": "sequence"},
         "algorithm.off_policy_level: decoupled weights tokens: expected 'token', found 'sequence'"),
        ({"tis_cap": 2, "off_policy": "mis", "off_policy_cap": 2},
         "algorithm.tis_cap: tis_cap = C is off_policy = 'tis' with off_policy_level = 'token' and off_policy_cap "
         "= C; it conflicts with off_policy = 'mis', off_policy_level = 'token', off_policy_cap = 2.0: set tis_cap "
         "or the off_policy options, not both"),
        ({"tis_cap": 2, "off_policy": "tis", "off_policy_cap": 3},
         "algorithm.tis_cap: tis_cap = C is off_policy = 'tis' with off_policy_level = 'token' and off_policy_cap "
         "= C; it conflicts with off_policy = 'tis', off_policy_level = 'token', off_policy_cap = 3.0: set tis_cap "
         "or the off_policy options, not both"),
        ({"tis_cap": 2, "decoupled": True},
         "algorithm.tis_cap: tis_cap = C is off_policy = 'tis' with off_policy_level = 'token' and off_policy_cap "
         "= C; it conflicts with decoupled = true: set tis_cap or the off_policy options, not both"),
    ],
)
def test_bad_combinations_are_one_clear_problem(data: dict, message: str) -> None:
    assert problems(data) == [message]


def test_bounds_and_choices() -> None:
    assert problems({"off_policy_cap": 0.5, "icepop_beta": 1.0, "icepop_alpha": 1.0}) == [
        "algorithm.off_policy_cap: expected a value >= 1, found 0.5",
        "algorithm.icepop_beta: expected a value > 1, found 1.0",
        "algorithm.icepop_alpha: expected a value in (0, 1), found 1.0",
    ]
    got = problems({"off_policy": "ice-pop"})
    assert len(got) == 1 and got[0].startswith(
        "algorithm.off_policy: expected one of 'none', 'tis', 'mis', 'icepop', found string 'ice-pop'"
    )
    assert "did you mean 'icepop'" in got[0]
    with pytest.raises(OptionError, match="off_policy_cap: off_policy = 'mis' needs off_policy_cap"):
        GrpoConfig(off_policy="mis")  # the same rule when a config is built in Python


# -- a job ----------------------------------------------------------------------------


def test_an_icepop_job_writes_the_correction_metrics(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    """The engine samples in bfloat16 and the trainer computes in float32: rho is not 1,
    and a tight IcePop band masks some tokens."""
    job = skyrl_tiny_rl_job(
        tmp_path, "icepop",
        job={"steps": 2, "batch_size": 4},
        engine={"dtype": "bfloat16"},
        algorithm={"name": "grpo", "off_policy": "icepop", "icepop_beta": 1.001},
    )
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 0, result.stderr
    rows = step_rows(job.out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert 0 < row["off_policy_masked_fraction"] < 1
        assert row["off_policy_weight_mean"] < 1
        assert row["off_policy_kl"] > 0
        assert abs(row["off_policy_ratio_mean"] - 1) < 0.1
        assert row["logprob_diff_max"] > math.log(1.001)  # what the masked tokens were masked for
