"""Scoring helpers shared by the verifiable tasks of this distribution (no hooks here)."""

from __future__ import annotations


def first_token(completion: str) -> str:
    """The completion with surrounding whitespace removed, cut at its first inner
    whitespace: ``"  122 because ..."`` -> ``"122"``; ``""`` for a blank completion."""
    parts = completion.split(maxsplit=1)
    return parts[0] if parts else ""


def positional_credit(answer: str, guess: str) -> float:
    """1.0 when ``guess == answer``; otherwise the characters of ``guess`` equal to
    ``answer``'s at the same position (aligned from the left), plus 1 when the
    lengths agree, over ``max(len(answer), len(guess)) + 1``.

    Dividing by the longer of the two makes extra characters cost credit: without
    it, a policy that never stops writing scores as well on the digits as one that
    stops at the right place, and RL drifts towards never stopping.

    ``positional_credit("122", "132") == (2 + 1) / 4``; ``positional_credit("122", "12") == 2 / 4``;
    ``positional_credit("122", "12222") == 3 / 6``.
    """
    if guess == answer:
        return 1.0
    right = sum(a == b for a, b in zip(answer, guess))
    right += len(guess) == len(answer)
    return right / (max(len(answer), len(guess)) + 1)
