"""rloo: REINFORCE Leave-One-Out (Kool et al., 2019; Ahmadian et al., 2024).

Each sample's baseline is the mean reward of the *other* samples of its group,
``A_i = r_i - (sum_g - r_i) / (n_g - 1)`` (0 for a group of one), with no std
scaling; the loss is PPO-clip (0.2 / 0.2) averaged over every loss token of the
step (``token-mean``).
"""

from __future__ import annotations

from typing import Any

from skyrl_host import hookimpl
from skyrl_algorithms._algorithm import PolicyGradient, declared_traits
from skyrl_algorithms._config import make_config

RlooConfig = make_config(
    "RlooConfig",
    __name__,
    """Options of ``[algorithm]`` when ``name = "rloo"``.""",
    clip_low=0.2,
    clip_high=0.2,
    loss_agg="token-mean",
    baseline="leave_one_out",
    scale_by_std=False,
)


class Rloo(PolicyGradient):
    """The algorithm (a :class:`skyrl_host.interfaces.Algorithm`)."""

    config_class = RlooConfig


@hookimpl
def skyrl_register_algorithms(register: Any) -> None:
    register(
        "rloo",
        Rloo,
        config=RlooConfig,
        description="RLOO: leave-one-out baseline (no std), PPO-clip, token-mean loss",
        traits=declared_traits,
    )
