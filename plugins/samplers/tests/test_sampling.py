"""Drawing tokens: the empirical distribution is the truncated, renormalised one;
temperature, greedy, reproducibility, full-vocabulary logprobs, bf16 logits."""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_host.interfaces import SampleOutput, Sampler
from skyrl_samplers._processing import GreedySampler, TruncatedSampler, draw

Q = torch.tensor([0.3, 0.25, 0.2, 0.12, 0.08, 0.05], dtype=torch.float64)  # token probabilities at T = 1
LOGITS = Q.log().float()[None, :]
N = 20_000


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    ("kwargs", "kept"),
    [
        ({}, [0, 1, 2, 3, 4, 5]),
        ({"temperature": 0.5}, [0, 1, 2, 3, 4, 5]),  # probabilities proportional to Q**2
        ({"temperature": 2.0}, [0, 1, 2, 3, 4, 5]),  # proportional to sqrt(Q)
        ({"top_k": 3}, [0, 1, 2]),
        ({"top_p": 0.8}, [0, 1, 2, 3]),  # mass before token 3 is 0.75 < 0.8, before token 4 0.87
        ({"min_p": 0.5}, [0, 1, 2]),  # threshold 0.15
        # sqrt(Q) over the top 4, renormalised: 0.297, 0.272, 0.243, 0.188; top-p 0.8 stops after 3
        ({"temperature": 2.0, "top_k": 4, "top_p": 0.8}, [0, 1, 2]),
    ],
    ids=["plain", "T=0.5", "T=2", "top_k=3", "top_p=0.8", "min_p=0.5", "T=2+top_k=4+top_p=0.8"],
)
def test_empirical_distribution_is_the_truncated_renormalised_one(kwargs: dict, kept: list[int]) -> None:
    sampler = TruncatedSampler(**kwargs)
    temperature = kwargs.get("temperature", 1.0)
    expected = torch.zeros_like(Q)
    expected[kept] = Q[kept] ** (1.0 / temperature)
    expected /= expected.sum()

    out = sampler.sample(LOGITS.expand(N, -1), gen(0))
    freq = torch.bincount(out.token_ids, minlength=Q.numel()).double() / N
    # Each count is binomial(N, p): allow 5 standard deviations of the frequency.
    tolerance = 5 * torch.sqrt(expected * (1 - expected) / N)
    assert torch.all((freq - expected).abs() <= tolerance), (freq, expected, tolerance)
    dropped = [i for i in range(Q.numel()) if i not in kept]
    assert freq[dropped].sum() == 0.0  # a truncated token is never drawn


def test_draw_follows_unnormalised_weights_and_never_draws_a_zero() -> None:
    # Zeros at both ends and in the middle (where a cumulative sum is flat), weights summing to 7.
    weights = torch.tensor([0.0, 3.0, 0.0, 0.0, 1.0, 3.0, 0.0, 0.0])
    ids = draw(weights.expand(N, -1), gen(4))
    freq = torch.bincount(ids, minlength=weights.numel()).double() / N
    expected = weights.double() / 7
    assert freq[weights == 0].sum() == 0.0
    assert torch.all((freq - expected).abs() <= 5 * torch.sqrt(expected * (1 - expected) / N)), freq
    # A one-hot row always gives its token, wherever it is; a tiny share is still drawn at its rate.
    assert draw(torch.eye(6)[[5, 0, 3]], gen(5)).tolist() == [5, 0, 3]
    tail = torch.full((4, 49_152), 1e-6)
    tail[:, 0] = 1.0 - 49_151e-6  # token 0 holds 95.1%; 49,151 tokens of 1e-6 hold the rest
    hits = sum(int((draw(tail, gen(s)) != 0).sum()) for s in range(1000))
    assert abs(hits / 4000 - 0.049151) <= 5 * math.sqrt(0.049 * 0.951 / 4000), hits


def test_temperature_sharpens_and_flattens() -> None:
    cold = TruncatedSampler(temperature=0.25).sample(LOGITS.expand(N, -1), gen(1)).token_ids
    hot = TruncatedSampler(temperature=4.0).sample(LOGITS.expand(N, -1), gen(1)).token_ids
    # P(token 0) is 0.3 at T = 1; Q**4 renormalised gives 0.55, Q**0.25 gives 0.19.
    assert (cold == 0).double().mean() > 0.5
    assert (hot == 0).double().mean() < 0.22


def test_logprobs_are_of_the_distribution_sampled_from() -> None:
    logits = torch.randn(64, 40, generator=gen(2)) * 3
    samplers = (TruncatedSampler(temperature=0.7, top_k=2), TruncatedSampler(top_p=0.5, min_p=0.1), TruncatedSampler())
    for sampler in samplers:
        out = sampler.sample(logits, gen(3))
        assert isinstance(out, SampleOutput)
        assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (64,)
        assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (64,)
        scaled = logits / sampler.temperature
        truncated = torch.log_softmax(scaled.masked_fill(~sampler.support(logits), float("-inf")), dim=-1)
        torch.testing.assert_close(out.logprobs, truncated.gather(-1, out.token_ids[:, None]).squeeze(-1))
    # Without truncation the processed distribution is the full one.
    plain = TruncatedSampler(temperature=0.7)
    out = plain.sample(logits, gen(3))
    full = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, out.token_ids[:, None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs, full)


def test_full_logprobs_on_request() -> None:
    logits = torch.randn(64, 40, generator=gen(2)) * 3
    for kw in ({"temperature": 0.7, "top_k": 2}, {"top_p": 0.5, "min_p": 0.1}):
        sampler = TruncatedSampler(**kw, logprobs="full")
        out = sampler.sample(logits, gen(3))
        full = torch.log_softmax(logits / sampler.temperature, dim=-1)
        torch.testing.assert_close(out.logprobs, full.gather(-1, out.token_ids[:, None]).squeeze(-1))
        # The same tokens as "processed", whose logprobs are higher by -log(kept mass) > 0.
        processed = TruncatedSampler(**kw).sample(logits, gen(3))
        assert torch.equal(processed.token_ids, out.token_ids)
        assert torch.all(processed.logprobs > out.logprobs)
    with pytest.raises(ValueError, match="logprobs"):
        TruncatedSampler(logprobs="raw")


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    logits = torch.randn(256, 50, generator=gen(4))
    sampler = TruncatedSampler(temperature=0.9, top_p=0.9)
    first = sampler.sample(logits, gen(123)).token_ids
    assert torch.equal(first, sampler.sample(logits, gen(123)).token_ids)
    assert not torch.equal(first, sampler.sample(logits, gen(124)).token_ids)
    g = gen(123)
    sampler.sample(logits, g)
    assert not torch.equal(first, sampler.sample(logits, g).token_ids)  # the generator's state moves on


def test_sample_with_support_draws_inside_the_support() -> None:
    logits = torch.randn(512, 30, generator=gen(5)) * 2
    sampler = TruncatedSampler(top_k=10, top_p=0.8, min_p=0.05)
    out, support = sampler.sample_with_support(logits, gen(6))
    assert torch.equal(support, sampler.support(logits))
    assert torch.all(support.gather(-1, out.token_ids[:, None]))
    assert torch.equal(out.token_ids, sampler.sample(logits, gen(6)).token_ids)


def test_bf16_logits_are_computed_in_float32() -> None:
    logits = (torch.randn(8, 100, generator=gen(7)) * 4).to(torch.bfloat16)
    sampler = TruncatedSampler(temperature=0.8, top_k=20, top_p=0.9)
    out = sampler.sample(logits, gen(8))
    assert out.token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    scaled = logits.float() / 0.8
    kept = torch.log_softmax(scaled.masked_fill(~sampler.support(logits), float("-inf")), dim=-1)
    torch.testing.assert_close(out.logprobs, kept.gather(-1, out.token_ids[:, None]).squeeze(-1))
    assert torch.equal(sampler.support(logits), sampler.support(logits.float()))
    greedy = GreedySampler().sample(logits, gen(8))
    assert torch.equal(greedy.token_ids, logits.float().argmax(-1)) and greedy.logprobs.dtype == torch.float32


def test_greedy_is_the_argmax_with_logprobs_at_temperature_one() -> None:
    logits = torch.randn(32, 17, generator=gen(9))
    logits[0] = torch.tensor([0.0] * 5 + [2.0, 1.0, 2.0] + [0.0] * 9)  # a tie: the lowest id wins
    greedy = GreedySampler()
    assert isinstance(greedy, Sampler) and greedy.temperature == 1.0
    out = greedy.sample(logits, gen(10))
    assert torch.equal(out.token_ids, logits.argmax(-1)) and out.token_ids[0] == 5
    assert torch.equal(out.token_ids, greedy.sample(logits, gen(11)).token_ids)
    assert torch.equal(out.token_ids, greedy.sample(logits, None).token_ids)
    at_argmax = torch.log_softmax(logits, -1).gather(-1, out.token_ids[:, None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs, at_argmax)
    support = greedy.support(logits)
    assert torch.equal(support.sum(-1), torch.ones(32, dtype=torch.long))
    assert torch.all(support.gather(-1, out.token_ids[:, None]))


def test_a_one_token_vocabulary_and_a_single_row() -> None:
    out = TruncatedSampler(top_k=5, top_p=0.5, min_p=0.5).sample(torch.tensor([[1.5]]), gen(0))
    assert out.token_ids.tolist() == [0] and out.logprobs.tolist() == [0.0]


@pytest.mark.parametrize(
    "logits",
    [torch.zeros(5), torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 0)],
    ids=["1-d", "3-d", "integer", "empty-vocab"],
)
def test_bad_logits_are_rejected(logits: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="logits"):
        TruncatedSampler().sample(logits, gen(0))
    with pytest.raises(ValueError, match="logits"):
        GreedySampler().sample(logits, gen(0))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 0.0}, "temperature: expected a finite value > 0, found 0.0"),
        ({"temperature": math.inf}, "temperature: expected a finite value > 0, found inf"),
        ({"top_k": -1}, "top_k: expected an integer >= 0, found -1"),
        ({"top_p": 0.0}, "top_p: expected a value in (0, 1], found 0.0"),
        ({"top_p": 1.5}, "top_p: expected a value in (0, 1], found 1.5"),
        ({"min_p": 1.0}, "min_p: expected a value in [0, 1), found 1.0"),
    ],
)
def test_direct_construction_checks_its_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        TruncatedSampler(**kwargs)
    assert str(info.value) == message
