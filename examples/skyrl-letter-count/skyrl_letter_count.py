"""letter_count: "How many times does 'a' occur in 'banana'?" -> "3".

A verifiable task for RL: prompts are generated from a seed, the reference answer
is known, and the reward gives partial credit for near misses. This module is
the example third-party plugin walked through in docs/writing-plugins.md.
"""

from __future__ import annotations

import random
from typing import Any

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import OptionError, ge, gt, in_interval, option
from skyrl_host.interfaces import Task


@attrs.frozen
class LetterCountConfig:
    """Options of ``[dataset]`` when ``name = "letter_count"``."""

    min_len: int = option(4, help="shortest word", validator=gt(0))
    max_len: int = option(12, help="longest word", validator=gt(0))
    alphabet: str = option("abcde", help="letters words are made of (at least 2)")
    partial_credit: float = option(
        0.5, help="reward for an answer off by one (halved per further step)", validator=in_interval(0, 1, high_open=True)
    )
    seed_offset: int = option(0, help="added to the job's seed, to draw other prompts", validator=ge(0))

    @alphabet.validator
    def _check_alphabet(self, attribute: Any, value: str) -> None:
        if len(set(value)) < 2:
            raise ValueError(f"expected at least 2 distinct letters, found {value!r}")

    def __attrs_post_init__(self) -> None:
        if self.min_len > self.max_len:  # located at the key: job.toml:5: dataset.min_len: ...
            raise OptionError("min_len", f"expected at most max_len ({self.max_len}), found {self.min_len}")


class LetterCount:
    """The dataset object the factory returns (a :class:`skyrl_host.interfaces.Dataset`)."""

    def __init__(self, config: LetterCountConfig, seed: int = 0):
        self.config = config
        self.seed = seed + config.seed_offset
        # Every character of a prompt or an answer, for character-level tokenizers.
        template = "How many times does '' occur in ''? Answer with a number.0123456789"
        self.alphabet = "".join(sorted(set(template + config.alphabet)))

    def batch(self, step: int, size: int) -> list[Task]:
        rng = random.Random(f"letter_count/{self.seed}/{step}")  # a pure function of (seed, step)
        cfg = self.config
        tasks = []
        for _ in range(size):
            word = "".join(rng.choice(cfg.alphabet) for _ in range(rng.randint(cfg.min_len, cfg.max_len)))
            letter = rng.choice(cfg.alphabet)
            prompt = f"How many times does '{letter}' occur in '{word}'? Answer with a number."
            tasks.append(Task(prompt=prompt, answer=str(word.count(letter)), meta={"word": word, "letter": letter}))
        return tasks

    def reward(self, task: Task, completion: str) -> float:
        text = completion.strip().split()
        if not text or not text[0].isdigit():
            return 0.0
        miss = abs(int(text[0]) - int(task.answer))  # type: ignore[arg-type]
        return 1.0 if miss == 0 else self.config.partial_credit / 2 ** (miss - 1)


@hookimpl
def skyrl_register_datasets(register: Any) -> None:
    register(
        "letter_count",
        LetterCount,
        config=LetterCountConfig,
        description="Count a letter in a random word; partial credit for near misses",
    )
