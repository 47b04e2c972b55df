"""skyrl-algorithms: algorithms (grpo, dapo, dr_grpo, gspo, rloo).

Each feature is one module here with its own ``skyrl`` entry point; they share
one implementation (``_algorithm.PolicyGradient``) and differ in their config
defaults. Shared math lives in ``_advantages`` (numpy) and ``_losses`` (torch),
which share the one KL estimator, ``skyrl_toolkit.kl`` (numpy or torch, one code path),
imported only when an algorithm computes something.

``kl_reward_penalty`` (for ``kl_in_reward``) is importable from here; it loads
numpy on first use.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "kl_reward_penalty":
        from skyrl_algorithms._advantages import kl_reward_penalty

        return kl_reward_penalty
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
