"""temperature: plain sampling from ``softmax(logits / temperature)``.

Truncation is off by default; ``top_k``, ``top_p`` and ``min_p`` may still be set
and then apply in the fixed order (see :mod:`skyrl_samplers._processing`).
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from skyrl_host import hookimpl
from skyrl_samplers._options import (
    sampler_traits,
    build_sampler,
    logprobs_option,
    min_p_option,
    return_support_option,
    temperature_option,
    top_k_option,
    top_p_option,
)


@attrs.frozen
class TemperatureConfig:
    """Options of ``[sampler]`` when ``name = "temperature"``."""

    temperature: float = temperature_option()
    top_k: int = top_k_option()
    top_p: float = top_p_option()
    min_p: float = min_p_option()
    return_support: bool = return_support_option()
    logprobs: Literal["processed", "full"] = logprobs_option()


@hookimpl
def skyrl_register_samplers(register: Any) -> None:
    register(
        "temperature",
        build_sampler,
        config=TemperatureConfig,
        description="Sample from softmax(logits / temperature); no truncation unless top_k/top_p/min_p are set",
        traits=sampler_traits,
    )
