"""dapo: Decoupled clip and Dynamic sAmpling Policy Optimization (Yu et al., 2025).

GRPO's advantages with four changes: clip-higher (clip_low 0.2, clip_high 0.28),
dynamic sampling (groups whose rewards are all equal are dropped and the batch is
refilled), token-level loss aggregation (``token-mean``) and overlong reward
shaping (a linear penalty over the last ``overlong_buffer`` tokens before
``max_new_tokens``).
"""

from __future__ import annotations

from typing import Any

from skyrl_host import hookimpl
from skyrl_algorithms._algorithm import PolicyGradient, declared_traits
from skyrl_algorithms._config import make_config

DapoConfig = make_config(
    "DapoConfig",
    __name__,
    """Options of ``[algorithm]`` when ``name = "dapo"``.""",
    clip_low=0.2,
    clip_high=0.28,
    loss_agg="token-mean",
    baseline="mean",
    scale_by_std=True,
    overlong_shaping=True,
    dynamic_sampling=True,
)


class Dapo(PolicyGradient):
    """The algorithm (a :class:`skyrl_host.interfaces.Algorithm`)."""

    config_class = DapoConfig


@hookimpl
def skyrl_register_algorithms(register: Any) -> None:
    register(
        "dapo",
        Dapo,
        config=DapoConfig,
        description="DAPO: clip-higher, dynamic sampling, token-mean loss, overlong reward shaping",
        traits=declared_traits,
    )
