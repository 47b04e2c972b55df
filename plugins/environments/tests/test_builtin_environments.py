"""The built-in environments on their own: the game's rules, the calculator's parser."""

from __future__ import annotations

import pytest

from skyrl_environments.calculator import CalcError, Calculator, CalculatorConfig, calculate
from skyrl_environments.guess_number import GuessNumber, GuessNumberConfig, GuessNumberData, GuessNumberDataConfig
from skyrl_host.interfaces import Task


@pytest.mark.parametrize(("expr", "value"), [
    ("2+3*4", "14"), ("(2+3)*4", "20"), ("-3--2", "-1"), ("7/2", "3.5"), ("2**10", "1024"), ("10 % 4", "2"),
    ("1/3", "0.3333333333"), (" 12 ", "12"), ("2**-1", "0.5"), ("-(2+1)**2", "-9"), (".5*4", "2"),
])
def test_the_calculator_computes(expr: str, value: str) -> None:
    assert calculate(expr) == value


@pytest.mark.parametrize(("expr", "message"), [
    ("1/0", "division by zero"), ("2**1000", "exponents must be integers up to 64"), ("(1+2", "unexpected end"), ("(1+2(", "missing"),
    ("__import__('os')", "unexpected"), ("1+", "unexpected end"), ("", "empty"), ("9**64", "result too large"),
    ("1 2", "unexpected '2'"), ("2**0.5", "exponents must be integers"),
])
def test_the_calculator_refuses_what_is_not_arithmetic(expr: str, message: str) -> None:
    with pytest.raises(CalcError, match=message):
        calculate(expr)


class Exact:
    def reward(self, task, completion):
        return 1.0 if completion.strip() == task.answer else 0.0


def test_the_calculator_answers_calls_then_scores_the_answer() -> None:
    env = Calculator(CalculatorConfig(max_calls=2), dataset=Exact(), seed=0)
    ep = env.episode(Task(prompt="6*7=", answer="42"), seed=1)
    assert ep.reset() == "6*7="
    first = ep.step("let me see <calc>6*7</calc>")
    assert (first.observation, first.done, first.metrics["invalid_calls"]) == ("<result>42</result>", False, 0.0)
    bad = ep.step("<calc>6/0</calc>")
    assert bad.observation == "<result>error: division by zero</result>" and bad.metrics["invalid_calls"] == 1.0
    last = ep.step("<calc>1+1</calc>")  # calls used up: this is the answer, and it is wrong
    assert last.done and last.reward == 0.0 and last.metrics["tool_calls"] == 2.0
    chat = env.episode(Task(prompt="q", answer="42", messages=[{"role": "user", "content": "6*7?"}]), seed=1)
    assert chat.step("<calc>6*7</calc>").observation == [{"role": "user", "content": "<result>42</result>"}]
    assert chat.step("42").reward == 1.0


def test_the_game_gives_hints_and_rewards_a_win() -> None:
    data = GuessNumberData(GuessNumberDataConfig(size=6), seed=0)
    tasks = data.batch(1, 50)
    assert tasks == data.batch(1, 50) and len({t.meta["secret"] for t in tasks}) == 6
    assert set("012345+-:?") == set(data.alphabet)
    env = GuessNumber(GuessNumberConfig(max_guesses=3), dataset=data)
    ep = env.episode(Task(prompt=":", answer="4", meta={"secret": 4, "size": 6}), seed=0)
    assert ep.reset() == ":"
    assert ep.step("2").observation == "+"
    assert ep.step("5").observation == "-"
    won = ep.step("4")
    assert won.done and won.reward == 1.0 and won.metrics["guesses"] == 3.0
    lost = env.episode(Task(prompt=":", meta={"secret": 0, "size": 6}), seed=0)
    assert lost.step("x").observation == "?"  # not a number: a hint that says so
    assert lost.step("9").observation == "?"  # out of range
    end = lost.step("3")
    assert end.done and end.reward == pytest.approx(0.1 / 3)  # one well-formed guess of three
