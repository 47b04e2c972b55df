"""grpo: Group Relative Policy Optimization (Shao et al., 2024, DeepSeekMath).

Advantages are group-normalised rewards, ``(r - mean_g) / (std_g + eps)`` with the
population std of the prompt's group (``std = "unbiased"``: the ``n - 1`` std TRL and
verl use); the loss is PPO-clip (0.2 / 0.2) averaged
over each sequence's tokens, then over sequences (``seq-mean-token-mean``).
"""

from __future__ import annotations

from typing import Any

from skyrl_host import hookimpl
from skyrl_algorithms._algorithm import PolicyGradient, declared_traits
from skyrl_algorithms._config import make_config

GrpoConfig = make_config(
    "GrpoConfig",
    __name__,
    """Options of ``[algorithm]`` when ``name = "grpo"``.""",
    clip_low=0.2,
    clip_high=0.2,
    loss_agg="seq-mean-token-mean",
    baseline="mean",
    scale_by_std=True,
)


class Grpo(PolicyGradient):
    """The algorithm (a :class:`skyrl_host.interfaces.Algorithm`)."""

    config_class = GrpoConfig


@hookimpl
def skyrl_register_algorithms(register: Any) -> None:
    register(
        "grpo",
        Grpo,
        config=GrpoConfig,
        description="GRPO: group-normalised advantages, PPO-clip, per-sequence token mean",
        traits=declared_traits,
    )
