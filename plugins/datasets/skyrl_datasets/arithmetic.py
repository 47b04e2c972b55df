"""arithmetic: integer arithmetic prompts such as ``"37+85="`` with the answer ``"122"``.

A verifiable task for RL on small models: prompts are generated from the job's
seed and the step, the exact answer is known, and the reward gives partial credit
for the digits in the right places (see :func:`skyrl_datasets._scoring.positional_credit`).
"""

from __future__ import annotations

import random
from typing import Any

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import OptionError, ge, gt, option
from skyrl_host.errors import did_you_mean
from skyrl_host.interfaces import Task
from skyrl_datasets._scoring import first_token, positional_credit

OPERATIONS = ("+", "-", "*")


def _check_operations(_inst: Any, _attr: Any, value: list[str]) -> None:
    if not value:
        raise ValueError(f"expected at least one of {', '.join(map(repr, OPERATIONS))}, found an empty array")
    for op in value:
        if op not in OPERATIONS:
            raise ValueError(
                f"expected each operation to be one of {', '.join(map(repr, OPERATIONS))}, "
                f"found {op!r}{did_you_mean(op, OPERATIONS)}"
            )
    for op in OPERATIONS:
        if value.count(op) > 1:
            raise ValueError(f"lists {op!r} twice: {value!r}")


@attrs.frozen
class ArithmeticConfig:
    """Options of ``[dataset]`` when ``name = "arithmetic"``."""

    operations: list[str] = option(
        factory=lambda: ["+"],
        help="operations to draw from, each equally likely: any of '+', '-', '*'",
        validator=_check_operations,
    )
    min_digits: int = option(1, help="fewest digits of an operand", validator=gt(0))
    max_digits: int = option(2, help="most digits of an operand", validator=gt(0))
    allow_negative: bool = option(
        False, help="let '-' give negative results (false: the larger operand comes first)"
    )
    seed_offset: int = option(0, help="added to the job's seed, to draw other prompts", validator=ge(0))

    def __attrs_post_init__(self) -> None:
        if self.min_digits > self.max_digits:
            raise OptionError("min_digits", f"expected at most max_digits ({self.max_digits}), found {self.min_digits}")


class Arithmetic:
    """The dataset (a :class:`skyrl_host.interfaces.Dataset`)."""

    # Every character of a prompt or an answer, for character-level tokenizers.
    alphabet = "0123456789+-*="

    def __init__(self, config: ArithmeticConfig, seed: int = 0):
        self.config = config
        self.seed = seed + config.seed_offset

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.config.min_digits, self.config.max_digits)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(low, 10**digits - 1)

    def batch(self, step: int, size: int) -> list[Task]:
        if step < 1:
            raise ValueError(f"steps count from 1, got step {step}")
        rng = random.Random(f"arithmetic/{self.seed}/{step}")  # a pure function of (seed, step)
        ops = self.config.operations
        tasks = []
        for _ in range(size):
            op = rng.choice(ops)
            a, b = self._operand(rng), self._operand(rng)
            if op == "-" and not self.config.allow_negative and a < b:
                a, b = b, a
            value = a + b if op == "+" else a - b if op == "-" else a * b
            tasks.append(Task(prompt=f"{a}{op}{b}=", answer=str(value), meta={"a": a, "b": b, "op": op}))
        return tasks

    def reward(self, task: Task, completion: str) -> float:
        """1.0 for the exact answer; else partial credit for digits in place (first token only)."""
        if task.answer is None:
            return 0.0
        return positional_credit(task.answer, first_token(completion))


@hookimpl
def skyrl_register_datasets(register: Any) -> None:
    register(
        "arithmetic",
        Arithmetic,
        config=ArithmeticConfig,
        description="Integer arithmetic ('37+85=' -> '122'); partial credit for digits in place",
    )
