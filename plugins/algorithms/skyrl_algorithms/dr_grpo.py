"""dr_grpo: GRPO done right (Liu et al., 2025, "Understanding R1-Zero-like training").

Removes GRPO's two biases: advantages are ``r - mean_g`` (no division by the
group std) and the loss sums each sequence's tokens and divides by a constant,
``global_seqs * max_new_tokens`` (``seq-mean-token-sum-norm``), instead of by each
sequence's own length.
"""

from __future__ import annotations

from typing import Any

from skyrl_host import hookimpl
from skyrl_algorithms._algorithm import PolicyGradient, declared_traits
from skyrl_algorithms._config import make_config

DrGrpoConfig = make_config(
    "DrGrpoConfig",
    __name__,
    """Options of ``[algorithm]`` when ``name = "dr_grpo"``.""",
    clip_low=0.2,
    clip_high=0.2,
    loss_agg="seq-mean-token-sum-norm",
    baseline="mean",
    scale_by_std=False,
)


class DrGrpo(PolicyGradient):
    """The algorithm (a :class:`skyrl_host.interfaces.Algorithm`)."""

    config_class = DrGrpoConfig


@hookimpl
def skyrl_register_algorithms(register: Any) -> None:
    register(
        "dr_grpo",
        DrGrpo,
        config=DrGrpoConfig,
        description="Dr. GRPO: r - mean advantages (no std), token sums over a constant length",
        traits=declared_traits,
    )
