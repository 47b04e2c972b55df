"""The options every stochastic sampler accepts, and the factory they share.

Light on purpose (no torch): the entry-point modules import this at discovery.
"""

from __future__ import annotations

from typing import Any

from skyrl_host.options import ge, gt, in_interval, option


def temperature_option(default: float = 1.0) -> Any:
    return option(default, help="divide the logits by this before anything else", validator=gt(0))


def top_k_option(default: int = 0) -> Any:
    return option(default, help="keep the k most likely tokens (0: off)", validator=ge(0))


def top_p_option(default: float = 1.0) -> Any:
    return option(
        default,
        help="keep the smallest set of most likely tokens whose probability reaches top_p (1.0: off)",
        validator=in_interval(0, 1, low_open=True),
    )


def min_p_option(default: float = 0.0) -> Any:
    return option(
        default,
        help="keep tokens at least min_p times as likely as the most likely one (0: off)",
        validator=in_interval(0, 1, high_open=True),
    )


def return_support_option() -> Any:
    return option(
        False,
        help="the engine records the candidate ids kept for each generated token (side channel 'sample_support')",
    )


def logprobs_option() -> Any:
    return option(
        "processed",
        help="the logprob the engine reports for each sampled token: 'processed' = of the distribution it was "
        "drawn from (after temperature and truncation: the behaviour policy), 'full' = log_softmax(logits / "
        "temperature) over the whole vocabulary",
    )


def build_sampler(config: Any) -> Any:
    """The factory of every stochastic sampler name: the config's four options
    applied in the fixed order (temperature, top-k, top-p, min-p)."""
    from skyrl_samplers._processing import TruncatedSampler  # torch is imported here, not at discovery

    return TruncatedSampler(
        temperature=config.temperature, top_k=config.top_k, top_p=config.top_p, min_p=config.min_p,
        return_support=config.return_support, logprobs=config.logprobs,
    )


def sampler_traits(config: Any) -> Any:
    """The :class:`~skyrl_host.interfaces.SamplerTraits` of every stochastic sampler."""
    from skyrl_host.interfaces import SamplerTraits

    return SamplerTraits(
        support=config.return_support, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
        min_p=config.min_p, logprobs=config.logprobs, switches={"support": "return_support"},
    )
