"""min_p: sample among the tokens at least ``min_p`` (default 0.05) times as
likely as the most likely one.

``temperature``, ``top_k`` and ``top_p`` may be set too; the order is fixed:
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
class MinPConfig:
    """Options of ``[sampler]`` when ``name = "min_p"``."""

    temperature: float = temperature_option()
    top_k: int = top_k_option()
    top_p: float = top_p_option()
    min_p: float = min_p_option(0.05)
    return_support: bool = return_support_option()
    logprobs: Literal["processed", "full"] = logprobs_option()


@hookimpl
def skyrl_register_samplers(register: Any) -> None:
    register(
        "min_p",
        build_sampler,
        config=MinPConfig,
        description="Sample among tokens at least min_p (default 0.05) times as likely as the top one",
        traits=sampler_traits,
    )
