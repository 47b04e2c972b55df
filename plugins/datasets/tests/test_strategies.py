"""The data sampling strategies: exact determinism, every document once per epoch,
mixing proportions, the temperature formula, and exact resume from state_dict."""

from __future__ import annotations

import collections
import json
import math

import numpy as np
import pytest

from skyrl_datasets._order import Permutation
from skyrl_datasets.curriculum import Curriculum, CurriculumConfig
from skyrl_datasets.mix import Mix, MixConfig, temperature_probabilities
from skyrl_datasets.sequential import Sequential
from skyrl_datasets.shuffled import Shuffled, ShuffledConfig

SIZES = [3, 0, 7, 5]


def lengths_of(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 200, size=n).astype(np.int32) for n in sizes]


def make(name, **options):
    return {
        "sequential": lambda: Sequential(),
        "shuffled": lambda: Shuffled(ShuffledConfig(**options)),
        "mix": lambda: Mix(MixConfig(**options)),
        "curriculum": lambda: Curriculum(CurriculumConfig(**options)),
    }[name]()


def draws(strategy, n, step=1):
    return [strategy.draw(step) for _ in range(n)]


def bound(name, sizes=SIZES, seed=7, **options):
    s = make(name, **options)
    s.bind(lengths_of(sizes), seed)
    return s


ALL = ["sequential", "shuffled", "mix", "curriculum"]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 1000, 4097])
def test_permutation_is_a_bijection(n) -> None:
    perm = Permutation(n, key=12345)
    assert sorted(perm(i) for i in range(n)) == list(range(n))
    if n >= 17:
        assert [perm(i) for i in range(n)] != list(range(n))
        assert [perm(i) for i in range(n)] != [Permutation(n, key=12346)(i) for i in range(n)]


def test_block_evaluation_equals_one_index_at_a_time() -> None:
    from skyrl_datasets._order import Concatenation, uniform, uniforms

    for n in (1, 5, 1000, 70_001):
        perm = Permutation(n, key=99)
        stop = min(n, 3000)
        assert perm.block(0, stop).tolist() == [perm(i) for i in range(stop)]
        assert perm.block(n - 7 if n > 7 else 0, n).tolist() == [perm(i) for i in range(max(0, n - 7), n)]
    assert uniforms((3, 4), 10, 500).tolist() == [uniform(3, 4, k) for k in range(10, 500)]
    docs = Concatenation([3, 0, 0, 7, 5, 0])
    g = np.arange(15)
    d, i = docs.locate_many(g)
    assert list(zip(d.tolist(), i.tolist())) == [docs.locate(x) for x in range(15)]
    assert all(docs.sizes[x] > 0 for x in d.tolist())


@pytest.mark.parametrize("name", ALL)
def test_same_seed_same_draws_and_another_seed_others(name) -> None:
    a, b = bound(name), bound(name)
    first = draws(a, 300, step=1000)
    assert first == draws(b, 300, step=1000)
    assert all(0 <= d < len(SIZES) and 0 <= i < SIZES[d] for d, i in first)
    if name != "sequential":
        assert draws(bound(name, seed=8), 300, step=1000) != first


def test_sequential_reads_in_order_and_wraps() -> None:
    got = draws(bound("sequential"), 2 * sum(SIZES) + 1)
    one_epoch = [(d, i) for d, n in enumerate(SIZES) for i in range(n)]
    assert got == one_epoch + one_epoch + one_epoch[:1]


@pytest.mark.parametrize("name", ["shuffled", "curriculum"])
def test_every_epoch_is_a_new_permutation_of_every_document(name) -> None:
    options = {"start_max_len": 1000} if name == "curriculum" else {}
    s = bound(name, **options)
    n = sum(SIZES)
    everything = sorted((d, i) for d, size in enumerate(SIZES) for i in range(size))
    epochs = [draws(s, n, step=5) for _ in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == everything
    assert epochs[0] != epochs[1] != epochs[2]
    assert s.state_dict()["epoch"] == 3


def four_sigma(count, n, p):
    return abs(count - n * p) <= 4 * math.sqrt(n * p * (1 - p))


def test_mix_weights_give_their_proportions() -> None:
    n = 100_000
    sizes = [50, 3, 1000]
    s = bound("mix", sizes=sizes, weights=[5.0, 3.0, 2.0])
    assert s.probabilities == pytest.approx([0.5, 0.3, 0.2])
    counts = collections.Counter(d for d, _ in draws(s, n))
    for d, p in enumerate([0.5, 0.3, 0.2]):
        assert four_sigma(counts[d], n, p), (d, counts[d], n * p)
    # Pearson's chi-square with 2 degrees of freedom: P(> 18.4) = 1e-4.
    chi2 = sum((counts[d] - n * p) ** 2 / (n * p) for d, p in enumerate([0.5, 0.3, 0.2]))
    assert chi2 < 18.4
    # Each dataset's own stream visits its documents once per epoch (dataset 1 wrapped ~10,000 times).
    per_epoch = collections.Counter(i for d, i in draws(bound("mix", sizes=sizes, weights=[5, 3, 2]), n) if d == 1)
    assert set(per_epoch) == {0, 1, 2} and max(per_epoch.values()) - min(per_epoch.values()) <= 1


def test_mix_zero_weight_never_draws_that_dataset() -> None:
    got = draws(bound("mix", sizes=[10, 10], weights=[1, 0]), 2000)
    assert {d for d, _ in got} == {0}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0, 1e6])
def test_mix_temperature_formula_and_draws(temperature) -> None:
    sizes = [100, 1000, 10_000]
    expected = [n ** (1 / temperature) for n in sizes]
    expected = [e / sum(expected) for e in expected]
    s = bound("mix", sizes=sizes, temperature=temperature)
    assert s.probabilities == pytest.approx(expected, rel=1e-9)
    if temperature == 1.0:
        assert s.probabilities == pytest.approx([100 / 11_100, 1000 / 11_100, 10_000 / 11_100])
    if temperature == 1e6:
        assert s.probabilities == pytest.approx([1 / 3] * 3, rel=1e-4)
    n = 50_000
    counts = collections.Counter(d for d, _ in draws(s, n))
    for d, p in enumerate(expected):
        assert four_sigma(counts[d], n, p), (d, counts[d], n * p)


def test_mix_default_is_proportional_to_size_and_huge_sizes_do_not_overflow() -> None:
    assert bound("mix", sizes=[10, 30]).probabilities == pytest.approx([0.25, 0.75])
    assert temperature_probabilities([10**12, 10**12, 0], 0.01) == pytest.approx([0.5, 0.5, 0.0])


def test_mix_rejects_weights_for_another_number_of_datasets() -> None:
    s = make("mix", weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="weights has 2 entries but there are 4 datasets"):
        s.bind(lengths_of(SIZES), 0)
    with pytest.raises(ValueError, match="dataset 1 has weight 1.0 but no documents"):
        make("mix", weights=[1.0, 1.0, 1.0, 1.0]).bind(lengths_of(SIZES), 0)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("stop_after", [0, 1, 14, 15, 16, 40])
def test_resume_from_state_dict_continues_exactly(name, stop_after) -> None:
    options = {"weights": [1, 0, 2, 1]} if name == "mix" else {}
    if name == "curriculum":
        options = {"start_max_len": 50, "ramp_steps": 30}
    original = bound(name, **options)
    steps = [1 + k // 3 for k in range(stop_after + 200)]  # three documents per step
    before = [original.draw(s) for s in steps[:stop_after]]
    state = json.loads(json.dumps(original.state_dict()))  # a checkpoint holds JSON
    expected = [original.draw(s) for s in steps[stop_after:]]
    resumed = bound(name, **options)
    resumed.load_state_dict(state)
    assert [resumed.draw(s) for s in steps[stop_after:]] == expected
    fresh = bound(name, **options)
    assert [fresh.draw(s) for s in steps] == before + expected


def test_curriculum_starts_short_and_admits_longer_documents_later() -> None:
    lengths = [np.arange(1, 401, dtype=np.int32)]  # document i has i + 1 tokens
    s = Curriculum(CurriculumConfig(start_max_len=50, ramp_steps=10))
    s.bind(lengths, 0)
    assert [s.max_len(step) for step in (1, 6, 11, 50)] == [50, 225, 400, 400]
    early = [i + 1 for _, i in draws(s, 40, step=1)]
    assert max(early) <= 50
    late = [i + 1 for _, i in draws(s, 200, step=11)]
    assert max(late) > 300
    with pytest.raises(ValueError, match="no document of at most 5 tokens"):
        c = Curriculum(CurriculumConfig(start_max_len=5))
        c.bind([np.full(10, 9, dtype=np.int32)], 0)
        c.draw(1)


def test_no_documents_is_an_error() -> None:
    for name in ALL:
        with pytest.raises(ValueError, match="no documents"):
            make(name).bind([np.zeros(0, np.int32)], 0)


def test_strategies_are_registered_plugins(skyrl_host) -> None:
    names = skyrl_host.registry.names("data_strategies")
    assert {"sequential", "shuffled", "mix", "curriculum"} <= set(names)
    reg = skyrl_host.get("data_strategies", "mix")
    assert reg.origin.distribution == "skyrl-datasets"
    from skyrl_host.interfaces import DataStrategy

    assert isinstance(reg.create(MixConfig(weights=[1.0])), DataStrategy)
