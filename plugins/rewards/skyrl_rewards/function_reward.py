"""``function``: your Python function scores completions, alone or beside other parts.

``function = "my_rewards:brevity"`` names ``f(task, completion) -> float`` (or a class
made once, then called). With ``batched = true`` it is called once per step as
``f(tasks, completions) -> list[float]`` instead. Its scores may be any finite numbers
(a penalty can be negative); a result that is not one is an error naming the function."""

from __future__ import annotations

import importlib.util
import math
import numbers
import re
from typing import Any, Sequence

import attrs

from skyrl_host import hookimpl
from skyrl_host.errors import Problem, UserError
from skyrl_host.interfaces import Task
from skyrl_host.options import option
from skyrl_toolkit.functions import load_function

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _check_function(_inst: Any, _attr: Any, value: str) -> None:
    module, sep, name = value.partition(":")
    if not sep or not _DOTTED.fullmatch(module) or not _DOTTED.fullmatch(name):
        raise ValueError(f"expected 'module:function' (dotted Python names), found {value!r}")
    try:
        found = importlib.util.find_spec(module)
    except Exception as exc:  # noqa: BLE001 - a missing parent package, or one that fails to import
        raise ValueError(f"cannot find module {module!r}: {exc}") from None
    if found is None:
        raise ValueError(f"cannot find module {module!r}; is it installed or on sys.path (PYTHONPATH)?")


@attrs.frozen
class FunctionRewardConfig:
    function: str = option(help="'module:function': f(task, completion) -> float (a class is made once)",
                           validator=_check_function)
    batched: bool = option(False, help="call f(tasks, completions) -> list of floats once per batch instead")
    weight: float = option(1.0, help="this part's share of the job's reward")


class FunctionReward:
    def __init__(self, config: FunctionRewardConfig, dataset: Any = None) -> None:
        self.config, self.weight = config, config.weight
        self.fn = load_function(config.function, "reward.function.function")

    def score(self, tasks: Sequence[Task], completions: Sequence[str]) -> list[float]:
        if self.config.batched:
            values = list(self.fn(list(tasks), list(completions)))
            if len(values) != len(completions):
                raise UserError(Problem(f"{self.config.function!r} returned {len(values)} scores for "
                                        f"{len(completions)} completions", key="reward.function.function"))
        else:
            values = [self.fn(t, c) for t, c in zip(tasks, completions)]
        for value in values:
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise UserError(Problem(f"{self.config.function!r} returned {value!r}; expected a finite number",
                                        key="reward.function.function"))
        return [float(v) for v in values]


@hookimpl
def skyrl_register_rewards(register: Any) -> None:
    register("function", FunctionReward, config=FunctionRewardConfig,
             description="Your Python function f(task, completion) -> float (or batched f(tasks, completions))")
