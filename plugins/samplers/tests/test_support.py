"""The kept candidate sets, on hand-made logits: top-k, top-p, min-p, their
composition in the fixed order, ties, the 'off' values, and a naive reference."""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_samplers._processing import GreedySampler, TruncatedSampler


def logits_of(*probs: float) -> torch.Tensor:
    """One row of logits whose softmax is ``probs`` (a zero probability is -inf)."""
    return torch.tensor([[math.log(p) if p > 0 else float("-inf") for p in probs]])


def kept(sampler, logits: torch.Tensor) -> set[int]:
    support = sampler.support(logits)
    assert support.dtype == torch.bool and support.shape == logits.shape
    return set(torch.nonzero(support[0]).flatten().tolist())


P = (0.5, 0.3, 0.15, 0.05)  # probabilities of tokens 0..3
SHUFFLED = (0.05, 0.3, 0.5, 0.15)  # the same, with the ranking 2, 1, 3, 0


@pytest.mark.parametrize(
    ("kwargs", "probs", "expected"),
    [
        # off
        ({}, P, {0, 1, 2, 3}),
        ({"top_k": 0, "top_p": 1.0, "min_p": 0.0}, P, {0, 1, 2, 3}),
        # top-k
        ({"top_k": 1}, P, {0}),
        ({"top_k": 2}, SHUFFLED, {2, 1}),
        ({"top_k": 3}, SHUFFLED, {2, 1, 3}),
        ({"top_k": 4}, P, {0, 1, 2, 3}),
        ({"top_k": 1000}, P, {0, 1, 2, 3}),  # larger than the vocabulary
        # top-p: the shortest prefix of the ranking whose mass reaches top_p
        ({"top_p": 0.1}, SHUFFLED, {2}),  # the top token alone already reaches it
        ({"top_p": 0.7}, P, {0, 1}),  # 0.5 < 0.7 <= 0.8
        ({"top_p": 0.7}, SHUFFLED, {2, 1}),
        ({"top_p": 0.85}, P, {0, 1, 2}),  # 0.8 < 0.85 <= 0.95
        ({"top_p": 0.96}, P, {0, 1, 2, 3}),
        ({"top_p": 1.0}, P, {0, 1, 2, 3}),
        # min-p: probability >= min_p * the top probability
        ({"min_p": 0.2}, P, {0, 1, 2}),  # threshold 0.1
        ({"min_p": 0.5}, P, {0, 1}),  # threshold 0.25
        ({"min_p": 0.5}, SHUFFLED, {2, 1}),
        ({"min_p": 0.05}, P, {0, 1, 2, 3}),  # threshold 0.025
        ({"min_p": 0.99}, P, {0}),
    ],
)
def test_single_rules(kwargs: dict, probs: tuple, expected: set[int]) -> None:
    assert kept(TruncatedSampler(**kwargs), logits_of(*probs)) == expected


TIES = (0.1, 0.2, 0.2, 0.3, 0.2)  # ranking: 3, then the tied 1, 2, 4 (lowest id first), then 0


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"top_k": 1}, {3}),
        ({"top_k": 2}, {3, 1}),  # of the tied 1, 2, 4 the lowest id goes first
        ({"top_k": 3}, {3, 1, 2}),
        ({"top_k": 4}, {3, 1, 2, 4}),
        ({"top_p": 0.4}, {3, 1}),  # mass before: 0, 0.3, 0.5, ...
        ({"top_p": 0.6}, {3, 1, 2}),  # 0.5 < 0.6
        ({"top_p": 0.8}, {3, 1, 2, 4}),  # 0.7 < 0.8
        ({"min_p": 0.5}, {3, 1, 2, 4}),  # threshold 0.15: min-p keeps every tied token
        ({"min_p": 0.9}, {3}),
    ],
)
def test_ties_are_cut_by_lowest_id(kwargs: dict, expected: set[int]) -> None:
    assert kept(TruncatedSampler(**kwargs), logits_of(*TIES)) == expected


def test_all_tied_row() -> None:
    logits = torch.zeros(1, 6)
    assert kept(TruncatedSampler(top_k=2), logits) == {0, 1}
    assert kept(TruncatedSampler(top_p=0.4), logits) == {0, 1, 2}  # 2/6 < 0.4 <= 3/6
    assert kept(TruncatedSampler(min_p=0.9), logits) == set(range(6))
    assert kept(GreedySampler(), logits) == {0}


def test_top_p_one_is_off_even_for_a_negligible_tail() -> None:
    logits = logits_of(0.6, 0.4 - 1e-12, 1e-12)
    assert kept(TruncatedSampler(top_p=1.0), logits) == {0, 1, 2}
    assert kept(TruncatedSampler(top_p=0.999), logits) == {0, 1}


def test_minus_infinity_is_never_kept() -> None:
    logits = logits_of(0.5, 0.0, 0.5, 0.0)
    samplers = (TruncatedSampler(), TruncatedSampler(top_k=3), TruncatedSampler(top_p=1.0), TruncatedSampler(min_p=0.0))
    for sampler in samplers:
        assert kept(sampler, logits) == {0, 2}


P4 = (0.4, 0.3, 0.2, 0.1)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # top-p alone: mass before 0, 0.4, 0.7, 0.9
        ({"top_p": 0.75}, {0, 1, 2}),
        # top-k first (3 tokens, renormalised to 4/9, 3/9, 2/9), then top-p: mass before 0, 0.44, 0.78
        ({"top_k": 3, "top_p": 0.75}, {0, 1}),
        # top-p keeps everything (0.9 < 0.95); min-p then cuts below 0.3 * 0.4 = 0.12
        ({"top_p": 0.95, "min_p": 0.3}, {0, 1, 2}),
        # top-k 3, top-p 0.7 over 4/9, 3/9, 2/9: keeps 0, 1 (0.44 < 0.7 <= 0.78); then min-p: token 1 is
        # 0.75 times as likely as token 0, so min-p 0.8 cuts it and 0.7 keeps it
        ({"top_k": 3, "top_p": 0.7, "min_p": 0.8}, {0}),
        ({"top_k": 3, "top_p": 0.7, "min_p": 0.7}, {0, 1}),
        # min-p's threshold is relative to the top token, so renormalising does not move it
        ({"top_k": 3, "min_p": 0.6}, {0, 1}),
        ({"min_p": 0.6}, {0, 1}),
    ],
)
def test_composition_in_the_fixed_order(kwargs: dict, expected: set[int]) -> None:
    assert kept(TruncatedSampler(**kwargs), logits_of(*P4)) == expected


def test_temperature_scales_before_truncation() -> None:
    logits = logits_of(*P)
    assert kept(TruncatedSampler(top_p=0.7), logits) == {0, 1}
    # At T = 2 the probabilities are proportional to sqrt(P): 0.379, 0.294, 0.208, 0.120.
    assert kept(TruncatedSampler(temperature=2.0, top_p=0.7), logits) == {0, 1, 2}
    # min-p 0.5 at T = 0.5 (proportional to P**2: threshold 0.5 * 0.25 = 0.125 against 0.09): {0}
    assert kept(TruncatedSampler(temperature=0.5, min_p=0.5), logits) == {0}
    assert kept(TruncatedSampler(temperature=1.0, min_p=0.5), logits) == {0, 1}


def test_rows_are_independent() -> None:
    rows = [logits_of(*P), logits_of(*SHUFFLED), logits_of(*P4), torch.zeros(1, 4)]
    batch = torch.cat(rows)
    samplers = (
        TruncatedSampler(top_k=2), TruncatedSampler(top_p=0.7), TruncatedSampler(top_k=3, top_p=0.75, min_p=0.3)
    )
    for sampler in samplers:
        together = sampler.support(batch)
        for i, row in enumerate(rows):
            assert torch.equal(together[i : i + 1], sampler.support(row))


def reference_support(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """A naive row-by-row implementation of the documented rules, in float64."""
    out = torch.zeros(logits.shape, dtype=torch.bool)
    for b in range(logits.shape[0]):
        x = [float(v) / temperature for v in logits[b].double()]
        ranking = sorted(range(len(x)), key=lambda i: (-x[i], i))
        kept = [i for i in ranking if x[i] != float("-inf")]
        if top_k:
            kept = kept[:top_k]
        if top_p < 1.0:
            z = sum(math.exp(x[i] - x[kept[0]]) for i in kept)
            mass, prefix = 0.0, []
            for i in kept:
                if prefix and mass >= top_p:
                    break
                prefix.append(i)
                mass += math.exp(x[i] - x[kept[0]]) / z
            kept = prefix
        if min_p > 0.0:
            kept = [i for i in kept if math.exp(x[i] - x[kept[0]]) >= min_p]
        out[b, kept] = True
    return out


@pytest.mark.parametrize("integer_logits", [False, True], ids=["random", "many-ties"])
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 5, 1.0, 0.0), (0.7, 0, 0.63, 0.0), (1.3, 0, 1.0, 0.12), (0.9, 12, 0.81, 0.07), (1.0, 3, 0.5, 0.3)],
)
def test_matches_a_naive_reference(
    integer_logits: bool, temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    g = torch.Generator().manual_seed(11)
    if integer_logits:
        logits = torch.randint(-3, 3, (48, 20), generator=g).float()
    else:
        logits = torch.randn(48, 20, generator=g) * 2
    logits[::7, 5] = float("-inf")
    sampler = TruncatedSampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    assert torch.equal(sampler.support(logits), reference_support(logits, temperature, top_k, top_p, min_p))
