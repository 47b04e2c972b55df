"""top_k: sample among the ``top_k`` most likely tokens (default 50).

``temperature``, ``top_p`` and ``min_p`` may be set too; the order is fixed:
temperature -> top-k -> top-p -> min-p -> sample.
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
class TopKConfig:
    """Options of ``[sampler]`` when ``name = "top_k"``."""

    temperature: float = temperature_option()
    top_k: int = top_k_option(50)
    top_p: float = top_p_option()
    min_p: float = min_p_option()
    return_support: bool = return_support_option()
    logprobs: Literal["processed", "full"] = logprobs_option()


@hookimpl
def skyrl_register_samplers(register: Any) -> None:
    register(
        "top_k",
        build_sampler,
        config=TopKConfig,
        description="Sample among the top_k most likely tokens (default 50); composes with top_p and min_p",
        traits=sampler_traits,
    )
