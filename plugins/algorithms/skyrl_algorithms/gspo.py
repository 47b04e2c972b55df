"""gspo: Group Sequence Policy Optimization (Zheng et al., 2025).

GRPO's advantages with a sequence-level importance ratio
``s_i = exp(mean_t(logp - logp_old))`` over the sequence's loss tokens, clipped per
sequence with small ranges (3e-4 below, 4e-4 above, as in the paper), and applied
to every token of the sequence in the GSPO-token form
``s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]``; the loss is averaged over each
sequence's tokens, then over sequences.
"""

from __future__ import annotations

from typing import Any

from skyrl_host import hookimpl
from skyrl_algorithms._algorithm import PolicyGradient, declared_traits
from skyrl_algorithms._config import make_config

GspoConfig = make_config(
    "GspoConfig",
    __name__,
    """Options of ``[algorithm]`` when ``name = "gspo"``.""",
    clip_low=3e-4,
    clip_high=4e-4,
    ratio_level="sequence",
    loss_agg="seq-mean-token-mean",
    baseline="mean",
    scale_by_std=True,
)


class Gspo(PolicyGradient):
    """The algorithm (a :class:`skyrl_host.interfaces.Algorithm`)."""

    config_class = GspoConfig


@hookimpl
def skyrl_register_algorithms(register: Any) -> None:
    register(
        "gspo",
        Gspo,
        config=GspoConfig,
        description="GSPO: sequence-level importance ratio, clipped per sequence (3e-4 / 4e-4)",
        traits=declared_traits,
    )
