"""jsonl: prompts (and answers) from a JSON-lines file, with a choice of reward.

Each non-blank line of the file is a JSON object holding at least the prompt: plain
text (``prompt_key``) or a chat (``messages_key``: a list of ``{"role", "content"}``
objects, oldest first, not ending with the assistant's), rendered by the ``rl`` driver
with the model's chat template (:attr:`Task.messages`; :attr:`Task.prompt` is then the
last user message). ``system_prompt`` makes every record a chat that opens with that
system message (a plain prompt becomes the user's message; a chat that has its own
system message keeps it). The answer (``answer_key``) is needed by the ``exact`` and
``regex`` rewards. Every other field is kept in :attr:`Task.meta`.

Batches walk an endless sequence of epochs. Each epoch is every record once: a
permutation seeded by (seed, epoch) when ``shuffle`` is true, file order
otherwise. Step ``s`` (counting from 1) with batch size ``n`` takes items
``[(s-1)*n, s*n)`` of that sequence, so a batch may straddle two epochs.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import numbers
import os
import pathlib
import random
import re
from typing import Any, Callable

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import in_interval, option
from skyrl_host.errors import Problem, UserError, did_you_mean
from skyrl_host.interfaces import Task

from skyrl_datasets import rewards as math_rewards

BUILTIN_REWARDS = ("exact", "regex")
MATH_REWARDS = math_rewards.NAMES  # "math", "format", "math_format": skyrl_datasets.rewards
MAX_PROBLEMS = 20  # malformed lines reported at once; the rest are counted
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _check_path(_inst: Any, _attr: Any, value: str) -> None:
    p = pathlib.Path(value)
    where = "" if p.is_absolute() else f" (relative to the current folder {os.getcwd()!r})"
    if p.is_dir():
        raise ValueError(f"expected an existing file, found a folder {value!r}{where}")
    if not p.exists():
        raise ValueError(f"expected an existing file, found nothing at {value!r}{where}")


def _check_format_weight(inst: Any, attr: Any, value: float | None) -> None:
    if value is None:
        return
    in_interval(0, 1)(inst, attr, value)
    if inst.reward != "math_format":
        raise ValueError(f"applies only to reward = 'math_format', found reward = {inst.reward!r}")


def _check_key(_inst: Any, _attr: Any, value: str) -> None:
    if not value:
        raise ValueError("expected a non-empty string, found ''")


def _check_reward(_inst: Any, _attr: Any, value: str) -> None:
    if value in BUILTIN_REWARDS or value in MATH_REWARDS:
        return
    module, sep, func = value.partition(":")
    if not sep:
        raise ValueError(
            f"expected 'exact', 'regex' or 'module:function', found {value!r}"
            f"{did_you_mean(value, BUILTIN_REWARDS + MATH_REWARDS)}; or a math reward: 'math', 'format', 'math_format'"
        )
    if not _DOTTED.fullmatch(module) or not _DOTTED.fullmatch(func):
        raise ValueError(f"expected 'module:function' (dotted Python names), found {value!r}")
    # Find the module without importing it (a dotted name imports its parent packages).
    try:
        spec = importlib.util.find_spec(module)
    except Exception as exc:  # noqa: BLE001 - a missing parent package, or a parent that fails to import
        raise ValueError(f"cannot find module {module!r} of {value!r}: {exc}") from None
    if spec is None:
        raise ValueError(f"cannot find module {module!r} of {value!r}; is it installed or on sys.path (PYTHONPATH)?")


@attrs.frozen
class JsonlConfig:
    """Options of ``[dataset]`` when ``name = "jsonl"``."""

    path: str = option(
        help="the JSON-lines file, one object per line (relative paths from the current folder)",
        validator=_check_path,
    )
    prompt_key: str = option("prompt", help="the field holding the prompt text", validator=_check_key)
    messages_key: str = option(
        "messages",
        help="the field holding a chat prompt instead: a list of {role, content} objects, rendered with the "
        "model's chat template",
        validator=_check_key,
    )
    system_prompt: str | None = option(
        None,
        help="a system message opening every prompt (plain prompts become the user's message of a chat); "
        "records with their own system message keep theirs",
    )
    answer_key: str = option(
        "answer", help="the field holding the answer (a regular expression when reward = 'regex')", validator=_check_key
    )
    reward: str = option(
        "exact",
        help="'exact' (stripped completion equals the stripped answer), 'regex' (the answer is a pattern "
        "that must fullmatch the stripped completion), 'math' (the final answer is equivalent by math-verify), "
        "'format' (one \\boxed{} answer ends the completion), 'math_format' (their weighted sum) "
        "or 'module:function' (f(task, completion) -> float in [0, 1]; a class is made once, then called)",
        validator=_check_reward,
    )
    format_weight: float | None = option(
        None,
        help="reward = 'math_format' only: the format term's share, (1 - w) * math + w * format (default 0.1)",
        validator=_check_format_weight,
    )
    shuffle: bool = option(True, help="a new permutation of the records each epoch, seeded by (seed, epoch)")

    def __attrs_post_init__(self) -> None:
        if self.prompt_key == self.answer_key:
            raise ValueError(f"prompt_key and answer_key must differ, both are {self.prompt_key!r}")
        for other in ("prompt_key", "answer_key"):
            if self.messages_key == getattr(self, other):
                raise ValueError(f"messages_key and {other} must differ, both are {self.messages_key!r}")


def _load_reward(spec: str) -> Callable[[Task, str], Any]:
    module_name, _, attr_path = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(Problem(f"cannot import {module_name!r} of {spec!r}: {exc}", key="dataset.reward")) from None
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise UserError(Problem(f"module {module_name!r} has no attribute {attr_path!r}", key="dataset.reward"))
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserError(Problem(f"{spec!r} is {type(obj).__name__}, not a callable f(task, completion)", key="dataset.reward"))
    if isinstance(obj, type):  # a reward class: one instance for the dataset's lifetime (its counters live there)
        try:
            obj = obj()
        except TypeError as exc:
            raise UserError(Problem(f"cannot make {spec!r} with no arguments: {exc}", key="dataset.reward")) from None
    return obj


class Jsonl:
    """The dataset (a :class:`skyrl_host.interfaces.Dataset`). Reads the whole file at creation."""

    def __init__(self, config: JsonlConfig, seed: int = 0):
        self.config = config
        self.seed = seed
        if config.reward in MATH_REWARDS:
            self._custom = math_rewards.make_reward(config.reward, format_weight=config.format_weight)
        else:
            self._custom = None if config.reward in BUILTIN_REWARDS else _load_reward(config.reward)
        self.tasks: list[Task] = self._read()
        self._orders: dict[int, list[int]] = {}
        # Every character of a prompt or an answer, for character-level tokenizers.
        self.alphabet = "".join(
            sorted({
                c
                for t in self.tasks
                for text in (t.prompt, t.answer or "", str(t.meta.get(config.answer_key, "")),
                             *(m["content"] for m in t.messages or ()))
                for c in text
            })
        )

    # -- reading ---------------------------------------------------------------

    def _read(self) -> list[Task]:
        cfg = self.config
        file = cfg.path
        try:
            text = pathlib.Path(file).read_text(encoding="utf-8-sig")
        except UnicodeDecodeError as exc:
            raise UserError(Problem(f"not UTF-8 text: {exc}", file=file)) from None
        except OSError as exc:
            raise UserError(Problem(f"cannot read: {exc.strerror or exc}", file=file, key="dataset.path")) from None
        tasks: list[Task] = []
        problems: list[Problem] = []
        needs_answer = cfg.reward in BUILTIN_REWARDS or bool(getattr(self._custom, "needs_answer", False))
        # split("\n"), not splitlines(): a JSON string may hold a raw U+2028 or form feed.
        for lineno, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                task = self._task(line, needs_answer)
            except ValueError as exc:
                problems.append(Problem(str(exc), file=file, line=lineno))
                continue
            tasks.append(task)
        if problems:
            if len(problems) > MAX_PROBLEMS:
                more = len(problems) - MAX_PROBLEMS
                problems = problems[:MAX_PROBLEMS] + [Problem(f"... and {more} more malformed lines", file=file)]
            raise UserError(problems)
        if not tasks:
            raise UserError(Problem("holds no records (expected one JSON object per line)", file=file))
        return tasks

    def _task(self, line: str, needs_answer: bool) -> Task:
        cfg = self.config
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"invalid JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(record, dict):
            raise ValueError(f"expected a JSON object, found {type(record).__name__}")
        messages = None
        if cfg.messages_key in record:
            if cfg.prompt_key in record:
                raise ValueError(f"give either the prompt {cfg.prompt_key!r} or the messages {cfg.messages_key!r}, not both")
            messages = self._messages(record.pop(cfg.messages_key))
            prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
        elif cfg.prompt_key not in record:
            raise ValueError(f"missing the prompt key {cfg.prompt_key!r}; keys: {', '.join(map(repr, record)) or '(none)'}")
        else:
            prompt = record.pop(cfg.prompt_key)
            if not isinstance(prompt, str):
                raise ValueError(f"expected the prompt {cfg.prompt_key!r} to be a string, found {json.dumps(prompt)}")
            if cfg.system_prompt is not None:
                messages = ({"role": "user", "content": prompt},)
        if messages is not None and cfg.system_prompt is not None and messages[0]["role"] != "system":
            messages = ({"role": "system", "content": cfg.system_prompt}, *messages)
        answer = record.pop(cfg.answer_key, None)
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = json.dumps(answer)  # a number answer is compared as its JSON text: 42 -> "42"
        if answer is not None and not isinstance(answer, str):
            raise ValueError(f"expected the answer {cfg.answer_key!r} to be a string or a number, found {json.dumps(answer)}")
        if answer is None and needs_answer:
            raise ValueError(f"missing the answer key {cfg.answer_key!r} (reward = {cfg.reward!r} needs it)")
        if cfg.reward == "regex":
            try:
                re.compile(answer)  # type: ignore[arg-type]
            except re.error as exc:
                raise ValueError(f"invalid regular expression {answer!r} in {cfg.answer_key!r}: {exc}") from None
            # A pattern is not a completion that earns the reward, so it goes to meta, not to Task.answer.
            record[cfg.answer_key] = answer
            answer = None
        return Task(prompt=prompt, answer=answer, meta=record, messages=messages)

    def _messages(self, value: Any) -> tuple[dict[str, str], ...]:
        key = self.config.messages_key
        if not isinstance(value, list) or not value:
            raise ValueError(f"expected the messages {key!r} to be a non-empty list of {{role, content}} objects, "
                             f"found {json.dumps(value)}")
        out = []
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"expected {key}[{i}] to be an object with string 'role' and 'content', "
                                 f"found {json.dumps(m)}")
            out.append({"role": m["role"], "content": m["content"]})
        if out[-1]["role"] == "assistant":
            raise ValueError(f"the last of the messages {key!r} is the assistant's; a prompt ends with the user's turn "
                             f"(drop the answer, or move it to {self.config.answer_key!r})")
        return tuple(out)

    # -- the Dataset protocol ------------------------------------------------------

    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self.tasks)))
            if self.config.shuffle:
                random.Random(f"jsonl/{self.seed}/{epoch}").shuffle(order)
            if len(self._orders) >= 4:
                self._orders.pop(next(iter(self._orders)))
            self._orders[epoch] = order
        return order

    def batch(self, step: int, size: int) -> list[Task]:
        if step < 1:
            raise ValueError(f"steps count from 1, got step {step}")
        n = len(self.tasks)
        out = []
        for i in range((step - 1) * size, step * size):
            epoch, pos = divmod(i, n)
            out.append(self.tasks[self._order(epoch)[pos]])
        return out

    def reward(self, task: Task, completion: str) -> float:
        kind = self.config.reward
        if kind == "exact":
            return float(task.answer is not None and completion.strip() == task.answer.strip())
        if kind == "regex":
            pattern = task.meta.get(self.config.answer_key)
            if not isinstance(pattern, str):
                raise ValueError(f"task has no pattern in meta[{self.config.answer_key!r}]: {task!r}")
            return float(re.fullmatch(pattern, completion.strip()) is not None)
        value = self._custom(task, completion)  # type: ignore[misc]
        if not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
            raise UserError(
                Problem(
                    f"reward function {kind!r} returned {value!r} for prompt {task.prompt!r}; expected a number in [0, 1]",
                    key="dataset.reward",
                )
            )
        return float(value)

    def reward_metrics(self) -> dict[str, float]:
        """The reward object's counters since this dataset was made (``math_unparsed``,
        ``math_scored``, ... for the math rewards; a class reward's own ``metrics()``); {} otherwise."""
        metrics = getattr(self._custom, "metrics", None)  # a user's reward class may keep counters
        return dict(metrics()) if callable(metrics) else {}


@hookimpl
def skyrl_register_datasets(register: Any) -> None:
    register(
        "jsonl",
        Jsonl,
        config=JsonlConfig,
        description="Prompts from a JSON-lines file; reward 'exact', 'regex', 'math', 'format', 'math_format' or a Python function",
    )
