"""The arithmetic dataset: prompts, answers, partial-credit reward, config checks."""

from __future__ import annotations

import re

import attrs
import pytest

from skyrl_datasets.arithmetic import Arithmetic, ArithmeticConfig
from skyrl_host.interfaces import Dataset, Task

TASK = Task(prompt="37+85=", answer="122")


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("122", 1.0),
        ("  122\n", 1.0),  # surrounding whitespace is stripped
        ("122 because 37+85 is 122", 1.0),  # only the first token counts
        ("132", 3 / 4),  # '1' and '2' in place, length right: (2 + 1) / (3 + 1)
        ("123", 3 / 4),
        ("221", 2 / 4),  # only the middle '2' in place: (1 + 1) / 4
        ("12", 2 / 4),  # '1', '2' in place, length wrong: (2 + 0) / 4
        ("1220", 3 / 5),  # all three in place, length wrong; the extra character counts against it
        ("999", 1 / 4),  # nothing in place, length right
        ("9", 0.0),
        ("", 0.0),
        ("   ", 0.0),
        ("x 122", 0.0),  # the first token is 'x': nothing in place, length wrong
        ("1 22", 1 / 4),  # the first token is '1': (1 + 0) / 4
    ],
)
def test_reward_partial_credit(completion: str, expected: float) -> None:
    assert Arithmetic(ArithmeticConfig()).reward(TASK, completion) == pytest.approx(expected)


def test_reward_negative_answer_counts_the_sign_as_a_character() -> None:
    ds = Arithmetic(ArithmeticConfig(operations=["-"], allow_negative=True))
    task = Task(prompt="12-40=", answer="-28")
    assert ds.reward(task, "-28") == 1.0
    assert ds.reward(task, "28") == 0.0  # '2' vs '-', '8' vs '2': nothing in place, length wrong
    assert ds.reward(task, "-27") == pytest.approx(3 / 4)
    assert ds.reward(task, "-2") == pytest.approx(2 / 4)


def test_batches_are_reproducible_and_differ_across_steps_and_seeds() -> None:
    cfg = ArithmeticConfig(operations=["+", "-", "*"], min_digits=1, max_digits=3)
    ds = Arithmetic(cfg, seed=3)
    assert isinstance(ds, Dataset)
    first = ds.batch(1, 32)
    assert len(first) == 32
    assert first == Arithmetic(cfg, seed=3).batch(1, 32)
    assert ds.batch(1, 8) == first[:8]  # a smaller batch is a prefix of a larger one
    assert first != ds.batch(2, 32)
    assert first != Arithmetic(cfg, seed=4).batch(1, 32)
    # seed_offset draws other prompts; seed + offset is what counts.
    assert first != Arithmetic(attrs.evolve(cfg, seed_offset=1), seed=3).batch(1, 32)
    assert Arithmetic(attrs.evolve(cfg, seed_offset=1), seed=3).batch(5, 8) == Arithmetic(cfg, seed=4).batch(5, 8)


def test_answers_are_correct_and_operands_have_the_configured_digits() -> None:
    cfg = ArithmeticConfig(operations=["+", "-", "*"], min_digits=2, max_digits=3)
    ds = Arithmetic(cfg, seed=1)
    ops = set()
    for step in (1, 2, 3):
        for t in ds.batch(step, 64):
            a, op, b = t.meta["a"], t.meta["op"], t.meta["b"]
            ops.add(op)
            assert t.prompt == f"{a}{op}{b}="
            assert t.answer == str(eval(f"{a}{op}{b}"))  # noqa: S307 - integers and one operator
            assert 2 <= len(str(a)) <= 3 and 2 <= len(str(b)) <= 3
            assert int(t.answer) >= 0  # allow_negative is false
            assert ds.reward(t, t.answer) == 1.0
    assert ops == {"+", "-", "*"}


def test_one_digit_operands_include_zero_and_subtraction_stays_non_negative() -> None:
    ds = Arithmetic(ArithmeticConfig(operations=["-"], min_digits=1, max_digits=1))
    tasks = [t for s in range(1, 6) for t in ds.batch(s, 64)]
    assert {t.meta["a"] for t in tasks} | {t.meta["b"] for t in tasks} == set(range(10))
    assert all(t.meta["a"] >= t.meta["b"] for t in tasks)


def test_allow_negative_gives_negative_results() -> None:
    ds = Arithmetic(ArithmeticConfig(operations=["-"], allow_negative=True), seed=2)
    answers = [int(t.answer) for t in ds.batch(1, 64)]
    assert min(answers) < 0 <= max(answers)


def test_default_config_is_addition_of_one_or_two_digit_numbers() -> None:
    cfg = ArithmeticConfig()
    assert (cfg.operations, cfg.min_digits, cfg.max_digits, cfg.allow_negative, cfg.seed_offset) == (["+"], 1, 2, False, 0)
    assert all("+" in t.prompt for t in Arithmetic(cfg).batch(1, 16))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_digits": 3, "max_digits": 2}, "min_digits: expected at most max_digits (2), found 3"),
        ({"min_digits": 0}, "expected a value > 0, found 0"),
        ({"operations": []}, "found an empty array"),
        ({"operations": ["+", "/"]}, "found '/'"),
        ({"operations": ["*", "*"]}, "lists '*' twice"),
        ({"seed_offset": -1}, "expected a value >= 0, found -1"),
    ],
)
def test_config_checks(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ArithmeticConfig(**kwargs)


def test_steps_count_from_one() -> None:
    with pytest.raises(ValueError, match="steps count from 1"):
        Arithmetic(ArithmeticConfig()).batch(0, 4)


def test_alphabet_covers_every_prompt_and_answer() -> None:
    ds = Arithmetic(ArithmeticConfig(operations=["+", "-", "*"], allow_negative=True, max_digits=3), seed=3)
    for t in ds.batch(1, 64):
        assert set(t.prompt + t.answer) <= set(ds.alphabet)
