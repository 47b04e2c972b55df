"""``dataset``: the job's dataset scores each completion with its own ``reward`` (the
rl job's default part: a job file without ``[reward]`` is scored exactly as before)."""

from __future__ import annotations

from typing import Any, Sequence

import attrs

from skyrl_host import hookimpl
from skyrl_host.interfaces import Task
from skyrl_host.options import option


@attrs.frozen
class DatasetRewardConfig:
    weight: float = option(1.0, help="this part's share of the job's reward")


class DatasetReward:
    def __init__(self, config: DatasetRewardConfig, dataset: Any) -> None:
        self.weight = config.weight
        self.dataset = dataset

    def score(self, tasks: Sequence[Task], completions: Sequence[str]) -> list[float]:
        return [float(self.dataset.reward(t, c)) for t, c in zip(tasks, completions)]


def _make(config: DatasetRewardConfig | None = None, *, dataset: Any) -> DatasetReward:
    return DatasetReward(config or DatasetRewardConfig(), dataset)


@hookimpl
def skyrl_register_rewards(register: Any) -> None:
    register("dataset", _make, config=DatasetRewardConfig,
             description="The dataset's own reward (its rule: exact, math-verify, GSM8K, ...); the rl job's default")
