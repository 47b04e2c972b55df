"""guess_number: find a secret number with "higher" / "lower" hints.

A multi-turn game a tiny model learns on CPU. The prompt is ``":"``; each response is
one guess (exactly the number's digits, then the end token). A wrong guess is answered
``"+"`` (the secret is higher), ``"-"`` (lower) or ``"?"`` (not a number in range),
and the model guesses again, up to ``max_guesses`` times. Reward: 1.0 for finding the
secret, else ``format_credit`` times the fraction of well-formed guesses (so a model
that cannot yet write a number still learns to). With ``size = 6`` and 3 guesses a
binary search always wins; ignoring the hints wins at most half the games.

The dataset (``[dataset] name = "guess_number"``) draws the secrets; the environment
(``[environment] name = "guess_number"``) plays them. Both are pure functions of their
seeds.
"""

from __future__ import annotations

import random
from typing import Any

import attrs

from skyrl_host import hookimpl
from skyrl_host.interfaces import EnvStep, Task
from skyrl_host.options import ge, in_interval, option

PROMPT = ":"
HIGHER, LOWER, INVALID = "+", "-", "?"


@attrs.frozen
class GuessNumberDataConfig:
    """Options of ``[dataset]`` when ``name = "guess_number"``."""

    size: int = option(6, help="secrets are 0 .. size-1", validator=in_interval(2, 10))
    seed_offset: int = option(0, help="added to the job's seed, to draw other secrets", validator=ge(0))


class GuessNumberData:
    """Secrets to find (a :class:`skyrl_host.interfaces.Dataset`; its ``reward`` scores
    a single guess, for single-turn use)."""

    def __init__(self, config: GuessNumberDataConfig, seed: int = 0):
        self.config = config
        self.seed = seed + config.seed_offset
        self.alphabet = "".join(str(d) for d in range(config.size)) + PROMPT + HIGHER + LOWER + INVALID

    def batch(self, step: int, size: int) -> list[Task]:
        if step < 1:
            raise ValueError(f"steps count from 1, got step {step}")
        rng = random.Random(f"guess_number/{self.seed}/{step}")
        secrets = [rng.randrange(self.config.size) for _ in range(size)]
        return [Task(prompt=PROMPT, answer=str(s), meta={"secret": s, "size": self.config.size}) for s in secrets]

    def reward(self, task: Task, completion: str) -> float:
        return 1.0 if completion.strip() == task.answer else 0.0


@attrs.frozen
class GuessNumberConfig:
    """Options of ``[environment]`` when ``name = "guess_number"``."""

    max_guesses: int = option(3, help="guesses per game", validator=in_interval(1, 20))
    format_credit: float = option(
        0.1, help="reward of a lost game with only well-formed guesses (scaled by their fraction)",
        validator=in_interval(0, 1, high_open=True),
    )


class GuessNumberEpisode:
    def __init__(self, config: GuessNumberConfig, secret: int, size: int):
        self.config, self.secret, self.size = config, secret, size
        self.guesses = 0
        self.well_formed = 0

    def reset(self) -> str:
        return PROMPT

    def step(self, response: str) -> EnvStep:
        self.guesses += 1
        text = response.strip()
        guess = int(text) if text.isdigit() and len(text) <= 2 else None
        if guess is not None and not 0 <= guess < self.size:
            guess = None
        self.well_formed += guess is not None
        metrics = {"well_formed": float(guess is not None)}
        if guess == self.secret:
            return EnvStep(reward=1.0, done=True, metrics={**metrics, "won": 1.0, "guesses": float(self.guesses)})
        if self.guesses >= self.config.max_guesses:
            credit = self.config.format_credit * self.well_formed / self.guesses
            return EnvStep(reward=credit, done=True, metrics={**metrics, "won": 0.0, "guesses": float(self.guesses)})
        hint = INVALID if guess is None else (HIGHER if self.secret > guess else LOWER)
        return EnvStep(observation=hint, metrics=metrics)

    def close(self) -> None:
        pass


class GuessNumber:
    """The game (a :class:`skyrl_host.interfaces.Environment`). The secret is the task's
    ``meta["secret"]`` (the guess_number dataset's), else drawn from the episode seed."""

    def __init__(self, config: GuessNumberConfig, *, dataset: Any = None, seed: int = 0):
        self.config = config

    def episode(self, task: Task, *, seed: int) -> GuessNumberEpisode:
        size = int(task.meta.get("size", 6))
        secret = task.meta.get("secret")
        if secret is None:
            secret = random.Random(seed).randrange(size)
        return GuessNumberEpisode(self.config, int(secret), size)


@hookimpl
def skyrl_register_datasets(register: Any) -> None:
    register(
        "guess_number",
        GuessNumberData,
        config=GuessNumberDataConfig,
        description="Secret numbers for the guess_number environment (prompt ':', answer the secret)",
    )


@hookimpl
def skyrl_register_environments(register: Any) -> None:
    register(
        "guess_number",
        GuessNumber,
        config=GuessNumberConfig,
        description="Guess a secret number with higher/lower hints (a multi-turn game a tiny model learns on CPU)",
    )
