"""support: sample-support replay. Each generated token's logprob is normalised over
the candidate set the engine's sampler kept for it (after top-k / top-p / min-p;
side channel ``sample_support``, filled when ``[sampler] return_support = true``),
as the engine sampled it, instead of over the whole vocabulary.

Computed from the final hidden state and the output-head rows of the kept ids only,
in chunks (:mod:`skyrl_replay.support_math`): full-vocabulary logits are never
materialised, so it needs far less memory than the plain log-softmax. The entropy
metric follows the same sets. Models whose head output is transformed (logit
soft-capping or scaling) take the exact but full-logits path instead.

``[replay] strategies = ["support"]``; options in ``[replay.support]``.
"""

from __future__ import annotations

from typing import Any

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import gt, option

SIDE_CHANNEL = "sample_support"


@attrs.frozen
class SupportConfig:
    """Options of ``[replay.support]``."""

    chunk: int = option(
        16384, help="(candidate id, token) pairs scored at once: bounds the memory of the gathered head rows",
        validator=gt(0),
    )


def create(config: SupportConfig) -> Any:
    from skyrl_replay._impl import SupportReplay

    return SupportReplay(chunk=config.chunk)


def check(spec: Any) -> list[tuple[str, str]]:
    """Job-level checks: the sampler must return its support sets."""
    from skyrl_replay._checks import check_trait

    return check_trait(spec, "sampler", "support", "support", "sample support sets")


@hookimpl
def skyrl_register_replay_strategies(register: Any) -> None:
    register(
        "support",
        create,
        config=SupportConfig,
        description="Sample-support replay: token logprobs normalised over the engine's kept candidate set",
        check=check,
    )
