"""top_p: nucleus sampling, the smallest set of tokens whose probability reaches
``top_p`` (default 0.95).

``temperature``, ``top_k`` and ``min_p`` may be set too; the order is fixed:
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
class TopPConfig:
    """Options of ``[sampler]`` when ``name = "top_p"``."""

    temperature: float = temperature_option()
    top_k: int = top_k_option()
    top_p: float = top_p_option(0.95)
    min_p: float = min_p_option()
    return_support: bool = return_support_option()
    logprobs: Literal["processed", "full"] = logprobs_option()


@hookimpl
def skyrl_register_samplers(register: Any) -> None:
    register(
        "top_p",
        build_sampler,
        config=TopPConfig,
        description="Nucleus sampling: the fewest tokens whose probability reaches top_p (default 0.95)",
        traits=sampler_traits,
    )
