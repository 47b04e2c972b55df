"""chat_arithmetic: small arithmetic questions asked as chats, for instruction-tuned models.

``"What is 7 + 5? Answer with just the number."`` as the user's message; the driver
renders it with the model's own chat template. The reward is 1.0 when the last integer in
the response is the answer, else 0.0: what a chat model says around it ("7 + 5 = 12") does
not matter, only the number it ends on. Tasks, by option:

- ``add``, ``subtract`` (the larger operand first unless ``allow_negative``), ``multiply``:
  two operands from ``min_value`` to ``max_value`` (single digits by default);
- ``compare``: "Which is larger, 17 or 23?": the answer is the larger one (never a tie).

Prompts are a pure function of the job's seed and the step, as every dataset's. This is
the task of ``examples/real_model.toml``: SmolLM2-135M-Instruct answers single-digit
additions right about a third of the time when sampled at temperature 1 (two thirds
greedily), and GRPO takes it above 0.8.
"""

from __future__ import annotations

import random
import re
from types import MappingProxyType
from typing import Any

import attrs

from skyrl_host import hookimpl
from skyrl_host.errors import did_you_mean
from skyrl_host.interfaces import Task
from skyrl_host.options import OptionError, ge, option

TASKS = ("add", "subtract", "multiply", "compare")
_SYMBOL = MappingProxyType({"add": "+", "subtract": "-", "multiply": "*"})
_INTEGER = re.compile(r"-?\d+")


def _check_tasks(_inst: Any, _attr: Any, value: list[str]) -> None:
    if not value:
        raise ValueError(f"expected at least one of {', '.join(map(repr, TASKS))}, found an empty array")
    for task in value:
        if task not in TASKS:
            raise ValueError(f"expected each task to be one of {', '.join(map(repr, TASKS))}, "
                             f"found {task!r}{did_you_mean(task, TASKS)}")
    repeated = sorted({t for t in value if value.count(t) > 1})
    if repeated:
        raise ValueError(f"lists {repeated[0]!r} twice: {value!r}")


@attrs.frozen
class ChatArithmeticConfig:
    """Options of ``[dataset]`` when ``name = "chat_arithmetic"``."""

    tasks: list[str] = option(factory=lambda: ["add"], help="tasks to draw from, each equally likely: any of "
                              + ", ".join(f"'{t}'" for t in TASKS), validator=_check_tasks)
    min_value: int = option(0, help="smallest operand", validator=ge(0))
    max_value: int = option(9, help="largest operand", validator=ge(0))
    allow_negative: bool = option(False, help="let 'subtract' give negative results (false: the larger operand first)")
    instruction: str = option("Answer with just the number.", help="appended to every question (may be empty)")
    system_prompt: str | None = option(None, help="a system message before the question (none: the chat template's own "
                                       "default, if it has one)")
    seed_offset: int = option(0, help="added to the job's seed, to draw other questions", validator=ge(0))

    def __attrs_post_init__(self) -> None:
        if self.min_value > self.max_value:
            raise OptionError("min_value", f"expected at most max_value ({self.max_value}), found {self.min_value}")
        if "compare" in self.tasks and self.min_value == self.max_value:
            raise OptionError("max_value", "'compare' needs two different numbers: widen min_value..max_value")


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (None: there is none)."""
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


class ChatArithmetic:
    """The dataset (a :class:`skyrl_host.interfaces.Dataset`): chat tasks, no alphabet (it
    is for models with their own tokenizer and chat template)."""

    def __init__(self, config: ChatArithmeticConfig, seed: int = 0):
        self.config = config
        self.seed = seed + config.seed_offset

    def _question(self, rng: random.Random) -> tuple[str, int, dict[str, Any]]:
        cfg = self.config
        task = rng.choice(cfg.tasks)
        a, b = rng.randint(cfg.min_value, cfg.max_value), rng.randint(cfg.min_value, cfg.max_value)
        if task == "compare":
            while a == b:
                b = rng.randint(cfg.min_value, cfg.max_value)
            return f"Which is larger, {a} or {b}?", max(a, b), {"task": task, "a": a, "b": b}
        if task == "subtract" and not cfg.allow_negative and a < b:
            a, b = b, a
        value = a + b if task == "add" else a - b if task == "subtract" else a * b
        return f"What is {a} {_SYMBOL[task]} {b}?", value, {"task": task, "a": a, "b": b}

    def batch(self, step: int, size: int) -> list[Task]:
        if step < 1:
            raise ValueError(f"steps count from 1, got step {step}")
        rng = random.Random(f"chat_arithmetic/{self.seed}/{step}")  # a pure function of (seed, step)
        tasks = []
        for _ in range(size):
            question, value, meta = self._question(rng)
            text = f"{question} {self.config.instruction}".strip()
            messages = ([{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else [])
            messages.append({"role": "user", "content": text})
            tasks.append(Task(prompt=text, answer=str(value), meta=meta, messages=messages))
        return tasks

    def reward(self, task: Task, completion: str) -> float:
        """1.0 when the last integer of ``completion`` is the answer, else 0.0."""
        if task.answer is None:
            return 0.0
        got = last_integer(completion)
        return 1.0 if got is not None and got == int(task.answer) else 0.0

    def extract_answer(self, task: Task, completion: str) -> str | None:
        """The answer the reward compares (the last integer), for majority votes."""
        got = last_integer(completion)
        return None if got is None else str(got)


@hookimpl
def skyrl_register_datasets(register: Any) -> None:
    register(
        "chat_arithmetic",
        ChatArithmetic,
        config=ChatArithmeticConfig,
        description="Arithmetic and comparisons asked as chats ('What is 7 + 5? Answer with just the number.'); "
        "1 when the response's last integer is the answer",
    )
