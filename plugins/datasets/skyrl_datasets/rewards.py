"""Rewards for math RL: is the final answer right (checked by math-verify), and is it
written in the expected form.

With the ``jsonl`` dataset select one by name, ``reward = "math"``, ``"format"`` or
``"math_format"`` (``format_weight`` sets the share of the format term), or by path,
``reward = "skyrl_datasets.rewards:MathReward"``. The dataset makes one reward object
and keeps it for its lifetime; that object counts what it scored (:meth:`MathReward.metrics`).

- **math**: the completion's final answer is extracted (the ``\\boxed{...}`` answer
  first, else the last number or expression) and compared with the record's answer
  by ``math_verify.verify``: 1.0 when equivalent (``1/2``, ``0.5``, ``\\frac{1}{2}``,
  ``50%``), 0.0 otherwise. A reference answer the verifier cannot parse scores 0.0
  and is counted in ``unparsed``, never raised.
- **format**: 1.0 when :func:`well_formatted` holds (exactly one ``\\boxed{...}``,
  non-empty and brace-balanced, ending the completion), else 0.0. Needs no answer.
- **math_format**: ``(1 - format_weight) * math + format_weight * format``.

This module is imported when plugins are discovered, so it imports math-verify
(and sympy through it) only inside the functions that score.
"""

from __future__ import annotations

import re
import threading
from typing import Any

NAMES = ("math", "format", "math_format")
DEFAULT_FORMAT_WEIGHT = 0.1
PARSE_TIMEOUT_S = 5  # math-verify's own limit per parse or comparison (main thread only)
_CACHE_SIZE = 10_000  # parsed reference answers kept per reward object

_BOXED = "\\boxed"
# What may follow the boxed answer at the end of a completion: whitespace, a full
# stop, and the closing of a math environment ($, $$, \], \)).
_TAIL = re.compile(r"(?:\s|\.|\$|\\\]|\\\))*")


def _timeout() -> int | None:
    # math-verify times out with signal.alarm, which works only in the main thread.
    return PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _configs() -> tuple[Any, ...]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    # The boxed answer first (priority 0), then LaTeX after "final answer is" and
    # similar anchors, then the last plain number or expression.
    return (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


def _parse(text: str) -> list[Any]:
    from math_verify import parse

    return parse(text, extraction_config=_configs(), fallback_mode="no_fallback", parsing_timeout=_timeout())


def extract_answer(completion: str) -> list[Any]:
    """The final answer of ``completion`` as math-verify parses it (sympy objects), or
    ``[]`` when it holds none: the ``\\boxed{...}`` answer when there is one (several
    boxed answers make one set), else the last number or expression."""
    return _parse(completion)


def parse_reference(answer: str) -> list[Any]:
    """The reference answer ``answer`` (a bare answer such as ``"0.5"``, ``"\\frac{1}{2}"``,
    ``"50%"`` or ``"1,234"``) parsed by math-verify, or ``[]`` when it cannot be parsed.
    It is read as the content of a ``\\boxed{}`` first (so ``3\\frac{1}{2}`` is 7/2, not
    the last number), then as plain text."""
    text = answer.strip()
    if not text:
        return []
    return _parse(_BOXED + "{" + text + "}") or _parse(text)


def equivalent(reference: list[Any], completion: str) -> bool:
    """Whether ``completion``'s final answer equals the parsed ``reference`` by math-verify."""
    if not reference:
        return False
    from math_verify import verify

    guess = extract_answer(completion)
    return bool(guess) and bool(verify(reference, guess, timeout_seconds=_timeout()))


def _boxed_spans(text: str) -> list[tuple[int, int] | None]:
    """(start of content, index of the closing brace) of each ``\\boxed{...}``; None
    for a ``\\boxed`` not followed by ``{`` or whose braces never close."""
    spans: list[tuple[int, int] | None] = []
    start = text.find(_BOXED)
    while start != -1:
        i = start + len(_BOXED)
        while i < len(text) and text[i] == " ":
            i += 1
        span = None
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{" and text[j - 1] != "\\":
                    depth += 1
                elif text[j] == "}" and text[j - 1] != "\\":
                    depth -= 1
                    if depth == 0:
                        span = (i + 1, j)
                        break
        spans.append(span)
        start = text.find(_BOXED, start + len(_BOXED))
    return spans


def well_formatted(completion: str) -> bool:
    """The format rule: the completion holds exactly one ``\\boxed{...}``, its content is
    not blank and its braces balance, and nothing but whitespace, ``.``, ``$``, ``\\]``
    or ``\\)`` follows it (the answer ends the completion)."""
    spans = _boxed_spans(completion)
    if len(spans) != 1 or spans[0] is None:
        return False
    begin, close = spans[0]
    return bool(completion[begin:close].strip()) and _TAIL.fullmatch(completion, close + 1) is not None


def format_reward(task: Any, completion: str) -> float:
    """1.0 when :func:`well_formatted` holds, else 0.0 (``reward = "skyrl_datasets.rewards:format_reward"``)."""
    return float(well_formatted(completion))


def math_reward(task: Any, completion: str) -> float:
    """The math reward without counters (``reward = "skyrl_datasets.rewards:math_reward"``):
    1.0 when the completion's final answer is equivalent to ``task.answer``, else 0.0,
    also when the answer cannot be parsed. :class:`MathReward` counts those."""
    answer = getattr(task, "answer", None)
    return float(isinstance(answer, str) and equivalent(parse_reference(answer), completion))


class MathReward:
    """``reward = "math"``: 1.0 when the completion's final answer is equivalent to the
    record's answer (math-verify), else 0.0.

    Counters over the object's lifetime: ``scored`` (rewards computed against a parsed
    reference), ``unparsed`` (rewards of 0.0 because the record's answer could not be
    parsed, or is missing), ``no_answer`` (of ``scored``, completions holding no answer
    the verifier could extract) and ``correct`` (of ``scored``, rewards of 1.0)."""

    needs_answer = True

    def __init__(self) -> None:
        self.scored = 0
        self.unparsed = 0
        self.no_answer = 0
        self.correct = 0
        self._references: dict[str, list[Any]] = {}

    def _reference(self, answer: str) -> list[Any]:
        ref = self._references.get(answer)
        if ref is None:
            if len(self._references) >= _CACHE_SIZE:
                self._references.clear()
            ref = self._references[answer] = parse_reference(answer)
        return ref

    def correctness(self, task: Any, completion: str) -> float:
        answer = getattr(task, "answer", None)
        reference = self._reference(answer) if isinstance(answer, str) else []
        if not reference:
            self.unparsed += 1
            return 0.0
        self.scored += 1
        guess = extract_answer(completion)
        if not guess:
            self.no_answer += 1
            return 0.0
        from math_verify import verify

        right = bool(verify(reference, guess, timeout_seconds=_timeout()))
        self.correct += right
        return float(right)

    def __call__(self, task: Any, completion: str) -> float:
        return self.correctness(task, completion)

    def metrics(self) -> dict[str, float]:
        """The counters, named for a job's metrics (counts since this object was made)."""
        return {
            "math_scored": float(self.scored),
            "math_unparsed": float(self.unparsed),
            "math_no_answer": float(self.no_answer),
            "math_correct": float(self.correct),
        }


class FormatReward:
    """``reward = "format"``: :func:`format_reward`, counting ``scored`` and ``well_formatted``."""

    needs_answer = False

    def __init__(self) -> None:
        self.scored = 0
        self.well_formatted = 0

    def __call__(self, task: Any, completion: str) -> float:
        ok = well_formatted(completion)
        self.scored += 1
        self.well_formatted += ok
        return float(ok)

    def metrics(self) -> dict[str, float]:
        return {"format_scored": float(self.scored), "format_ok": float(self.well_formatted)}


class MathFormatReward(MathReward):
    """``reward = "math_format"``: ``(1 - format_weight) * math + format_weight * format``,
    in [0, 1]; the math counters of :class:`MathReward` plus ``well_formatted``."""

    def __init__(self, format_weight: float = DEFAULT_FORMAT_WEIGHT) -> None:
        if not 0.0 <= format_weight <= 1.0:
            raise ValueError(f"format_weight: expected a value in [0, 1], found {format_weight!r}")
        super().__init__()
        self.format_weight = float(format_weight)
        self.well_formatted = 0

    def __call__(self, task: Any, completion: str) -> float:
        ok = well_formatted(completion)
        self.well_formatted += ok
        w = self.format_weight
        return (1.0 - w) * self.correctness(task, completion) + w * float(ok)

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), "format_ok": float(self.well_formatted)}


def make_reward(name: str, *, format_weight: float | None = None) -> MathReward | FormatReward:
    """A new reward object for ``name`` (one of :data:`NAMES`); ``format_weight`` is for ``math_format``."""
    if name == "math":
        return MathReward()
    if name == "format":
        return FormatReward()
    if name == "math_format":
        return MathFormatReward(DEFAULT_FORMAT_WEIGHT if format_weight is None else format_weight)
    raise ValueError(f"expected one of {', '.join(map(repr, NAMES))}, found {name!r}")
