"""calculator: a tool the model calls as ``<calc>2+3*4</calc>``.

Each response either calls the tool (the first ``<calc>...</calc>`` in it: the
environment answers ``<result>14</result>``, or ``<result>error: ...</result>``) or is
the final answer, scored by the dataset's ``reward``. The expression is parsed by a
small recursive-descent parser (numbers, ``+ - * / %``, ``**`` with a bounded exponent,
parentheses, unary signs): nothing is evaluated as Python.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

import attrs

from skyrl_host import hookimpl
from skyrl_host.interfaces import EnvStep, Task
from skyrl_host.options import gt, in_interval, option

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|(\*\*|[-+*/%()]))")


class CalcError(ValueError):
    """An expression the calculator refuses (its message is shown to the model)."""


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = TOKEN.match(text, pos)
        if m is None:
            raise CalcError(f"unexpected {text[pos:].strip()[:10]!r}")
        out.append(m.group(1) or m.group(2))
        pos = m.end()
    return out


class _Parser:
    """expr := term (('+'|'-') term)*;  term := unary (('*'|'/'|'%') unary)*;
    unary := ('+'|'-') unary | power;  power := atom ('**' unary)?;  atom := NUMBER | '(' expr ')'"""

    def __init__(self, tokens: list[str], max_magnitude: Fraction):
        self.t, self.i, self.max = tokens, 0, max_magnitude

    def peek(self) -> str | None:
        return self.t[self.i] if self.i < len(self.t) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise CalcError("unexpected end of expression")
        self.i += 1
        return tok

    def bound(self, v: Fraction) -> Fraction:
        if abs(v) > self.max:
            raise CalcError("result too large")
        return v

    def expr(self) -> Fraction:
        v = self.term()
        while self.peek() in ("+", "-"):
            v = self.bound(v + self.term() if self.take() == "+" else v - self.term())
        return v

    def term(self) -> Fraction:
        v = self.unary()
        while self.peek() in ("*", "/", "%"):
            op, w = self.take(), self.unary()
            if op != "*" and w == 0:
                raise CalcError("division by zero")
            v = self.bound(v * w if op == "*" else v / w if op == "/" else v % w)
        return v

    def unary(self) -> Fraction:
        if self.peek() in ("+", "-"):
            return -self.unary() if self.take() == "-" else self.unary()
        return self.power()

    def power(self) -> Fraction:
        v = self.atom()
        if self.peek() == "**":
            self.take()
            e = self.unary()
            if e.denominator != 1 or abs(e) > 64:
                raise CalcError("exponents must be integers up to 64")
            if v == 0 and e < 0:
                raise CalcError("division by zero")
            v = self.bound(v ** int(e))
        return v

    def atom(self) -> Fraction:
        tok = self.take()
        if tok == "(":
            v = self.expr()
            if self.take() != ")":
                raise CalcError("missing ')'")
            return v
        if tok[0].isdigit() or tok[0] == ".":
            return self.bound(Fraction(tok))
        raise CalcError(f"unexpected {tok!r}")


def calculate(text: str, *, max_length: int = 200, max_magnitude: float = 1e15) -> str:
    """The value of an arithmetic expression as text (integers exactly, others to 10
    significant digits); raises :class:`CalcError` for anything else."""
    if len(text) > max_length:
        raise CalcError(f"expression longer than {max_length} characters")
    tokens = _tokens(text)
    if not tokens:
        raise CalcError("empty expression")
    p = _Parser(tokens, Fraction(max_magnitude))
    value = p.expr()
    if p.peek() is not None:
        raise CalcError(f"unexpected {p.peek()!r}")
    if value.denominator == 1:
        return str(value.numerator)
    f = float(value)
    return f"{f:.10g}" if math.isfinite(f) else "nan"


@attrs.frozen
class CalculatorConfig:
    """Options of ``[environment]`` when ``name = "calculator"``."""

    max_calls: int = option(4, help="tool calls per trajectory; the response after the last is the answer",
                            validator=in_interval(0, 100))
    max_length: int = option(200, help="longest expression, in characters", validator=gt(0))


class CalculatorEpisode:
    def __init__(self, config: CalculatorConfig, dataset: Any, task: Task):
        self.config, self.dataset, self.task = config, dataset, task
        self.calls = 0

    def reset(self) -> Any:
        return list(self.task.messages) if self.task.messages is not None else self.task.prompt

    def step(self, response: str) -> EnvStep:
        m = CALL.search(response)
        if m is None or self.calls >= self.config.max_calls:
            reward = float(self.dataset.reward(self.task, response))
            return EnvStep(reward=reward, done=True, metrics={"tool_calls": float(self.calls)})
        self.calls += 1
        try:
            result = calculate(m.group(1), max_length=self.config.max_length)
            metrics = {"invalid_calls": 0.0}
        except CalcError as exc:
            result, metrics = f"error: {exc}", {"invalid_calls": 1.0}
        text = f"<result>{result}</result>"
        obs: Any = [{"role": "user", "content": text}] if self.task.messages is not None else text
        return EnvStep(observation=obs, metrics=metrics)

    def close(self) -> None:
        pass


class Calculator:
    """The calculator tool (a :class:`skyrl_host.interfaces.Environment`): chat tasks get
    the result as a user message, plain-text tasks as text after the response."""

    def __init__(self, config: CalculatorConfig, *, dataset: Any, seed: int = 0):
        self.config, self.dataset = config, dataset

    def episode(self, task: Task, *, seed: int) -> CalculatorEpisode:
        return CalculatorEpisode(self.config, self.dataset, task)


@hookimpl
def skyrl_register_environments(register: Any) -> None:
    register(
        "calculator",
        Calculator,
        config=CalculatorConfig,
        description="A calculator tool: <calc>2+3*4</calc> is answered <result>14</result>; the final answer is "
        "scored by the dataset",
    )
