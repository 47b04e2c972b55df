"""greedy: the most likely token (argmax; the lowest id among equal logits).

Its only option is ``return_support``: temperature and truncation cannot change
the argmax. Its temperature is 1.0, so the logprobs it reports (and the trainer
recomputes) are ``log_softmax(logits)`` at the chosen ids; its support is the
chosen token.
"""

from __future__ import annotations

from typing import Any

import attrs

from skyrl_host import hookimpl
from skyrl_host.interfaces import SamplerTraits
from skyrl_samplers._options import return_support_option


@attrs.frozen
class GreedyConfig:
    """Options of ``[sampler]`` when ``name = "greedy"``."""

    return_support: bool = return_support_option()


def build_greedy(config: GreedyConfig | None = None) -> Any:
    """The factory."""
    from skyrl_samplers._processing import GreedySampler  # torch is imported here, not at discovery

    return GreedySampler(return_support=config.return_support if config is not None else False)


@hookimpl
def skyrl_register_samplers(register: Any) -> None:
    register(
        "greedy",
        build_greedy,
        config=GreedyConfig,
        description="Always the most likely token (argmax, lowest id on ties); logprobs at temperature 1",
        traits=lambda c: SamplerTraits(support=bool(c.return_support), greedy=True,
                                       switches={"support": "return_support"}),
    )
