"""The loss functions the Tinker API names, computed per token from the trainer's logprobs.

Each datum brings ``loss_fn_inputs`` (``target_tokens`` and the loss's own arrays, one
value per input token) and the request a ``loss_fn_config``; :func:`loss_terms` gives
the per-token loss whose sum is the datum's loss (its gradient flows into the adapters).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from skyrl_server._errors import BadRequest

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo")
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
LOSS_INPUTS = {"cross_entropy": ("target_tokens", "weights"), "importance_sampling": _RL_INPUTS, "ppo": _RL_INPUTS,
               "cispo": _RL_INPUTS}
# loss_fn_config keys and their defaults (the SDK's documented ones): bounds of the clipped ratio.
LOSS_CONFIG = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
               "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}}


def loss_config(loss_fn: str, config: Mapping[str, float]) -> dict[str, float]:
    """``config`` checked against ``loss_fn``'s keys, with the defaults filled in."""
    if loss_fn not in LOSSES:
        raise BadRequest(f"loss_fn {loss_fn!r} is not served yet; served: {list(LOSSES)}")
    known = LOSS_CONFIG.get(loss_fn, {})
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise BadRequest(f"loss_fn_config: {loss_fn!r} takes {sorted(known) or 'no keys'}, found {unknown}")
    config = {**known, **config}
    if known and not config["clip_low_threshold"] <= config["clip_high_threshold"]:
        raise BadRequest("loss_fn_config: clip_low_threshold must not exceed clip_high_threshold")
    return config


def loss_terms(name: str, logprobs: Any, inputs: Mapping[str, np.ndarray], config: Mapping[str, float], device: Any) -> Any:
    """The per-token loss (float32 [N]) of ``name``: the SDK's definitions.

    - ``cross_entropy``: ``-weights * logprobs``;
    - ``importance_sampling``: ``-ratio * advantages``, ``ratio = exp(logprobs - sampling_logprobs)``;
    - ``ppo``: ``-min(ratio * advantages, clip(ratio, low, high) * advantages)``;
    - ``cispo``: ``-sg(clip(ratio, low, high)) * logprobs * advantages`` (sg: no gradient)."""
    import torch

    def tensor(key: str) -> Any:
        return torch.as_tensor(np.array(inputs[key], dtype=np.float32), device=device)

    if name == "cross_entropy":
        return -tensor("weights") * logprobs
    ratio = torch.exp(logprobs - tensor("logprobs"))
    adv = tensor("advantages")
    if name == "importance_sampling":
        return -ratio * adv
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    if name == "ppo":
        return -torch.minimum(ratio * adv, clipped * adv)
    return -clipped.detach() * logprobs * adv

