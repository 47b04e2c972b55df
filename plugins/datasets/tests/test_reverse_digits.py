"""The reverse_digits dataset: distinct digits, correct answers, the positional reward."""

from __future__ import annotations

import random
import re

import pytest

from skyrl_datasets.reverse_digits import ReverseDigits, ReverseDigitsConfig, prompt_for
from skyrl_host.interfaces import Dataset, Task

TASK = Task(prompt="reverse 4071:", answer="1704")


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("1704", 1.0),
        (" 1704\n", 1.0),
        ("1704 done", 1.0),  # only the first token counts
        ("1705", 4 / 5),  # 3 in place + length right: (3 + 1) / (4 + 1)
        ("1074", 3 / 5),  # '1', '4' in place + length right
        ("4071", 1 / 5),  # the prompt itself: nothing in place, length right
        ("170", 3 / 5),  # 3 in place, length wrong
        ("17045", 4 / 6),  # 4 in place, length wrong, over the longer length (5) + 1
        ("9999", 1 / 5),
        ("", 0.0),
    ],
)
def test_reward_positions_plus_length(completion: str, expected: float) -> None:
    assert ReverseDigits(ReverseDigitsConfig()).reward(TASK, completion) == pytest.approx(expected)


def test_a_random_policy_scores_low() -> None:
    ds = ReverseDigits(ReverseDigitsConfig(min_len=5, max_len=5), seed=0)
    rng = random.Random(0)
    tasks = ds.batch(1, 256)
    mean = sum(ds.reward(t, "".join(rng.choice("0123456789") for _ in range(5))) for t in tasks) / len(tasks)
    assert mean < 0.35  # expected (5 * 0.1 + 1) / 6 = 0.25


def test_prompts_hold_distinct_digits_and_answers_are_their_reverse() -> None:
    ds = ReverseDigits(ReverseDigitsConfig(min_len=2, max_len=10), seed=5)
    lengths = set()
    for step in (1, 2, 3):
        for t in ds.batch(step, 64):
            digits = t.meta["digits"]
            m = re.fullmatch(r"reverse (\d+):", t.prompt)
            assert m and m.group(1) == digits and t.prompt == prompt_for(digits)
            assert len(set(digits)) == len(digits)
            assert t.answer == digits[::-1]
            assert ds.reward(t, t.answer) == 1.0
            lengths.add(len(digits))
    assert lengths == set(range(2, 11))


def test_default_lengths_are_three_to_five() -> None:
    ds = ReverseDigits(ReverseDigitsConfig())
    assert {len(t.answer) for t in ds.batch(1, 128)} == {3, 4, 5}


def test_batches_are_reproducible_and_differ_across_steps_and_seeds() -> None:
    cfg = ReverseDigitsConfig()
    ds = ReverseDigits(cfg, seed=9)
    assert isinstance(ds, Dataset)
    first = ds.batch(4, 32)
    assert first == ReverseDigits(cfg, seed=9).batch(4, 32)
    assert first != ds.batch(5, 32)
    assert first != ReverseDigits(cfg, seed=10).batch(4, 32)
    assert ReverseDigits(ReverseDigitsConfig(seed_offset=1), seed=9).batch(4, 32) == ReverseDigits(cfg, seed=10).batch(4, 32)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_len": 6, "max_len": 5}, "min_len: expected at most max_len (5), found 6"),
        ({"max_len": 11}, "expected a value in [1, 10], found 11"),
        ({"min_len": 0}, "expected a value in [1, 10], found 0"),
    ],
)
def test_config_checks(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ReverseDigitsConfig(**kwargs)


def test_alphabet_covers_every_prompt_and_answer() -> None:
    ds = ReverseDigits(ReverseDigitsConfig(min_len=2, max_len=10), seed=3)
    for t in ds.batch(1, 64):
        assert set(t.prompt + t.answer) <= set(ds.alphabet)
