"""``kind = "reward_check"``: audit a dataset's prompts and reward function.

Before spending compute on RL, check that the task is well posed: every batch is
reproducible from the seed, every reward lies in [0, 1], reference answers earn
the full reward, and wrong answers (an empty completion, another prompt's
answer) do not. Reports these per step; fails when a check does not hold.
"""

from __future__ import annotations

import statistics
from typing import Any

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import gt, option
from skyrl_host.errors import JobFailed
from skyrl_host.interfaces import Dataset

MAX_EXAMPLES = 3


@attrs.frozen
class RewardCheckConfig:
    batch_size: int = option(64, help="prompts drawn from the dataset per step", validator=gt(0))
    max_shuffled_reward: float = option(
        0.999, help="fail when another prompt's reference answer earns at least this mean reward", validator=gt(0)
    )


class RewardCheck:
    def __init__(self, run: Any):
        self._run = run
        self._config: RewardCheckConfig = run.spec.kind_config

    def run(self) -> None:
        run, cfg = self._run, self._config
        dataset = run.plugin("dataset").create(seed=run.spec.job.seed)
        if not isinstance(dataset, Dataset):
            raise TypeError(f"dataset {run.plugin('dataset').name!r} does not implement the Dataset protocol")
        run.headline = ["reward_reference_mean", "reward_shuffled_mean", "reward_empty_mean"]
        problems: list[str] = []
        shuffled_means: list[float] = []
        for step in range(1, run.total_steps + 1):
            tasks = list(dataset.batch(step, cfg.batch_size))
            if len(tasks) != cfg.batch_size:
                problems.append(f"step {step}: batch has {len(tasks)} tasks, asked for {cfg.batch_size}")
            if list(dataset.batch(step, cfg.batch_size)) != tasks:
                problems.append(f"step {step}: the same step gave a different batch (not reproducible)")
            answered = [t for t in tasks if t.answer is not None]
            reference = [dataset.reward(t, t.answer) for t in answered]
            empty = [dataset.reward(t, "") for t in tasks]
            rotated = answered[1:] + answered[:1]
            shuffled = [dataset.reward(t, o.answer) for t, o in zip(answered, rotated) if o.answer != t.answer]
            for t, r in zip(answered, reference):
                if r != 1.0:
                    problems.append(f"step {step}: reference answer {t.answer!r} to {t.prompt!r} earned {r}")
            for r in reference + empty + shuffled:
                if not 0.0 <= r <= 1.0:
                    problems.append(f"step {step}: reward {r} outside [0, 1]")
            metrics = {
                "reward_reference_mean": statistics.fmean(reference) if reference else float("nan"),
                "reward_empty_mean": statistics.fmean(empty) if empty else float("nan"),
                "reward_shuffled_mean": statistics.fmean(shuffled) if shuffled else float("nan"),
                "answered_fraction": len(answered) / max(len(tasks), 1),
                "distinct_prompt_fraction": len({t.prompt for t in tasks}) / max(len(tasks), 1),
                "prompt_chars_mean": statistics.fmean(len(t.prompt) for t in tasks) if tasks else 0.0,
            }
            if shuffled:
                shuffled_means.append(metrics["reward_shuffled_mean"])
            run.report(step, metrics)
        if shuffled_means and statistics.fmean(shuffled_means) >= cfg.max_shuffled_reward:
            problems.append(
                f"wrong answers earn mean reward {statistics.fmean(shuffled_means):.3f}: the reward does not tell answers apart"
            )
        if problems:
            more = f" (and {len(problems) - MAX_EXAMPLES} more)" if len(problems) > MAX_EXAMPLES else ""
            raise JobFailed("reward check failed: " + "; ".join(problems[:MAX_EXAMPLES]) + more)


@hookimpl
def skyrl_register_jobs(register: Any) -> None:
    register(
        "reward_check",
        RewardCheck,
        config=RewardCheckConfig,
        description="Audit a dataset: reproducible batches, rewards in [0, 1], references earn 1",
        slots={"dataset": None},
    )
