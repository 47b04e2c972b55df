"""Rewards chosen by a row's ``data_source``, as verl and SkyRL choose them, and the
answer each one extracts (for majority votes).

Every reward here is an object called as ``reward(task, completion) -> float`` in
[0, 1], with ``extract(completion) -> str | None`` (the answer it compares, normalized;
None when the completion holds none) and ``metrics()`` (its counters). ``task.answer``
is the row's ground truth.

- ``gsm8k``: verl's strict GSM8K rule: the last ``#### <number>`` of the completion's
  final 300 characters, commas and dollar signs removed, equals the ground truth (as
  text). ``gsm8k_flexible``: the last number of those characters instead (no ``####``
  needed).
- ``math``: math-verify's equivalence of the completion's final (boxed) answer and the
  ground truth (:mod:`skyrl_datasets.rewards`).
- ``multiple_choice``: the letter the completion chooses (``\\boxed{C}``, ``Answer: C``,
  ``(C)``, or a final lone capital letter, A to Z) equals the ground truth's letter.
- ``exact``: the stripped completion equals the stripped ground truth.
"""

from __future__ import annotations

import abc
import re
import types
from typing import Any, Callable, Mapping

CLIP_CHARS = 300  # verl scores the last 300 characters of a GSM8K solution
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_CHOICE_PATTERNS = (
    re.compile(r"\\boxed\{\s*\(?([A-Z])\)?\s*\}"),
    re.compile(r"(?i:answer)\s*(?:is|:)?\s*[:\s]\s*\(?([A-Z])\)?(?![A-Za-z])"),
    re.compile(r"\(([A-Z])\)"),
    re.compile(r"(?<![A-Za-z])([A-Z])(?![A-Za-z])[\s.)]*$"),
)


class _Counted(abc.ABC):
    """Counters every reward keeps: ``scored``, ``no_answer`` (completions it found no
    answer in) and ``correct``, reported under the reward's name."""

    name = ""

    def __init__(self) -> None:
        self.scored = self.no_answer = self.correct = 0

    def __call__(self, task: Any, completion: str) -> float:
        self.scored += 1
        guess = self.extract(completion)
        if guess is None:
            self.no_answer += 1
            return 0.0
        right = self.same(guess, getattr(task, "answer", None))
        self.correct += right
        return float(right)

    @abc.abstractmethod
    def extract(self, completion: str) -> str | None:
        """The answer of ``completion`` this reward compares (None: it holds none)."""

    def same(self, guess: str, answer: str | None) -> bool:
        return answer is not None and guess == answer.strip()

    def metrics(self) -> dict[str, float]:
        return {
            f"{self.name}_scored": float(self.scored),
            f"{self.name}_no_answer": float(self.no_answer),
            f"{self.name}_correct": float(self.correct),
        }


class Gsm8k(_Counted):
    """verl's GSM8K rule, strict (``#### N``) or flexible (the last number)."""

    needs_answer = True

    def __init__(self, method: str = "strict") -> None:
        if method not in ("strict", "flexible"):
            raise ValueError(f"method: expected 'strict' or 'flexible', found {method!r}")
        super().__init__()
        self.method = method
        self.name = "gsm8k" if method == "strict" else "gsm8k_flexible"

    def extract(self, completion: str) -> str | None:
        text = completion[-CLIP_CHARS:]
        if self.method == "strict":
            found = _STRICT.findall(text)
            return found[-1].replace(",", "").replace("$", "") if found else None
        for number in reversed(_NUMBER.findall(text)):
            if number not in ("", "."):
                return number
        return None


class MultipleChoice(_Counted):
    """The chosen letter against the ground truth's (``"C"``, ``"(C)"``, ``"c"``)."""

    name = "multiple_choice"
    needs_answer = True

    def extract(self, completion: str) -> str | None:
        for pattern in _CHOICE_PATTERNS:
            found = pattern.findall(completion)
            if found:
                return found[-1]
        return None

    def same(self, guess: str, answer: str | None) -> bool:
        if answer is None:
            return False
        letter = answer.strip().strip("()").strip().upper()
        return guess == letter


class Exact(_Counted):
    name = "exact"
    needs_answer = True

    def extract(self, completion: str) -> str | None:
        return completion.strip()


class Math:
    """math-verify on the final answer (:class:`skyrl_datasets.rewards.MathReward`), with
    the boxed answer's text as what a majority vote compares."""

    needs_answer = True

    def __init__(self) -> None:
        from skyrl_datasets.rewards import MathReward

        self._reward = MathReward()

    def __call__(self, task: Any, completion: str) -> float:
        return self._reward(task, completion)

    def extract(self, completion: str) -> str | None:
        from skyrl_datasets.rewards import extract_answer

        found = extract_answer(completion)
        return str(found[0]) if found else None  # sympy's form: equal values mostly print alike

    def metrics(self) -> dict[str, float]:
        return self._reward.metrics()


#: The rewards by name, each made fresh per dataset (their counters live there).
REWARDS: Mapping[str, Callable[[], Any]] = types.MappingProxyType({
    "gsm8k": lambda: Gsm8k("strict"),
    "gsm8k_flexible": lambda: Gsm8k("flexible"),
    "math": Math,
    "multiple_choice": MultipleChoice,
    "exact": Exact,
})

#: The reward of each well-known ``data_source`` (a trailing ``*``: any source starting so),
#: as verl's default scoring picks them.
BY_DATA_SOURCE: Mapping[str, str] = types.MappingProxyType({
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math_dapo": "math",
    "math": "math",
    "aime*": "math",
    "numina_*": "math",
    "cais/mmlu": "multiple_choice",
    "TIGER-Lab/MMLU-Pro": "multiple_choice",
    "Idavidrein/gpqa": "multiple_choice",
    "allenai/ai2_arc": "multiple_choice",
})


def reward_for_source(source: str, table: Mapping[str, str]) -> str | None:
    """The reward ``table`` names for ``source``: its exact key first, then the longest
    ``prefix*`` key it starts with; None when neither."""
    if source in table:
        return table[source]
    best = None
    for key, name in table.items():
        if key.endswith("*") and source.startswith(key[:-1]) and (best is None or len(key) > len(best[0])):
            best = (key, name)
    return best[1] if best else None
