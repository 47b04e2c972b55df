"""greedy: the most likely token (argmax; the lowest id among equal logits).

Takes no options: temperature and truncation cannot change the argmax. Its
temperature is 1.0, so the logprobs it reports (and the trainer recomputes) are
``log_softmax(logits)`` at the chosen ids; its support is the chosen token.
"""

from __future__ import annotations

from typing import Any

from skyrl_host import hookimpl


def build_greedy(config: Any = None) -> Any:
    """The factory (``config`` is None: greedy takes no options)."""
    from skyrl_samplers._processing import GreedySampler  # torch is imported here, not at discovery

    return GreedySampler()


@hookimpl
def skyrl_register_samplers(register: Any) -> None:
    register(
        "greedy",
        build_greedy,
        description="Always the most likely token (argmax, lowest id on ties); logprobs at temperature 1",
    )
