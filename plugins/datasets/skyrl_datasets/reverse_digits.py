"""reverse_digits: reverse a string of distinct digits, ``"reverse 4071:"`` -> ``"1704"``.

A small verifiable task that a tiny model with a character-level tokenizer can
learn. The reward counts the digits in the right places plus one for the right
length, over the length plus one, so a random guess earns little and only the
exact answer earns 1.0.
"""

from __future__ import annotations

import random
from typing import Any

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import OptionError, ge, in_interval, option
from skyrl_host.interfaces import Task
from skyrl_datasets._scoring import first_token, positional_credit

DIGITS = "0123456789"


@attrs.frozen
class ReverseDigitsConfig:
    """Options of ``[dataset]`` when ``name = "reverse_digits"``."""

    min_len: int = option(3, help="fewest digits in a prompt", validator=in_interval(1, 10))
    max_len: int = option(5, help="most digits in a prompt (digits are distinct, so at most 10)", validator=in_interval(1, 10))
    seed_offset: int = option(0, help="added to the job's seed, to draw other prompts", validator=ge(0))
    prefix: str = option("reverse ", help="text before the digits in each prompt (the prompt is PREFIX + digits + ':')")

    def __attrs_post_init__(self) -> None:
        if self.min_len > self.max_len:
            raise OptionError("min_len", f"expected at most max_len ({self.max_len}), found {self.min_len}")


def prompt_for(digits: str, prefix: str = "reverse ") -> str:
    """The prompt text for a digit string: ``"reverse 4071:"``."""
    return f"{prefix}{digits}:"


class ReverseDigits:
    """The dataset (a :class:`skyrl_host.interfaces.Dataset`)."""

    def __init__(self, config: ReverseDigitsConfig, seed: int = 0):
        self.config = config
        self.seed = seed + config.seed_offset
        # Every character of a prompt or an answer, for character-level tokenizers.
        self.alphabet = "".join(sorted(set(prompt_for(DIGITS, config.prefix) + DIGITS)))

    def batch(self, step: int, size: int) -> list[Task]:
        if step < 1:
            raise ValueError(f"steps count from 1, got step {step}")
        rng = random.Random(f"reverse_digits/{self.seed}/{step}")  # a pure function of (seed, step)
        tasks = []
        for _ in range(size):
            digits = "".join(rng.sample(DIGITS, rng.randint(self.config.min_len, self.config.max_len)))
            tasks.append(Task(prompt=prompt_for(digits, self.config.prefix), answer=digits[::-1], meta={"digits": digits}))
        return tasks

    def reward(self, task: Task, completion: str) -> float:
        """(positions right + 1 if the length is right) / (max(len(answer), len(guess)) + 1),
        on the first whitespace-separated token ``guess`` of the completion."""
        if task.answer is None:
            return 0.0
        return positional_credit(task.answer, first_token(completion))


@hookimpl
def skyrl_register_datasets(register: Any) -> None:
    register(
        "reverse_digits",
        ReverseDigits,
        config=ReverseDigitsConfig,
        description="Reverse a string of distinct digits ('reverse 4071:' -> '1704'); credit per digit in place",
    )
