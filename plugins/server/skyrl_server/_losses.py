"""The loss functions the Tinker API names, computed per token from the trainer's logprobs.

Each datum brings ``loss_fn_inputs`` (``target_tokens`` and the loss's own arrays, one
value per input token) and the request a ``loss_fn_config``; :func:`loss_terms` gives
the per-token loss whose sum is the datum's loss (its gradient flows into the adapters).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from skyrl_server._errors import BadRequest

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
LOSS_INPUTS = {"cross_entropy": ("target_tokens", "weights"), "importance_sampling": _RL_INPUTS, "ppo": _RL_INPUTS,
               "cispo": _RL_INPUTS, "dro": _RL_INPUTS}
# loss_fn_config keys and their defaults: the SDK's documented bounds of the clipped ratio, and
# DRO's quadratic-penalty weight (the SDK's docs show beta = 0.05 as the example; it is ours by default).
LOSS_CONFIG = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
               "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
               "dro": {"beta": 0.05}}
# The algorithm plugin whose policy loss computes ``ppo`` (its clipped surrogate is the same objective).
PPO_ALGORITHM = "grpo"


def loss_config(loss_fn: str, config: Mapping[str, float]) -> dict[str, float]:
    """``config`` checked against ``loss_fn``'s keys, with the defaults filled in."""
    if loss_fn not in LOSSES:
        raise BadRequest(f"loss_fn {loss_fn!r} is not served yet; served: {list(LOSSES)}")
    known = LOSS_CONFIG.get(loss_fn, {})
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise BadRequest(f"loss_fn_config: {loss_fn!r} takes {sorted(known) or 'no keys'}, found {unknown}")
    config = {**known, **config}
    if "clip_low_threshold" in known and not config["clip_low_threshold"] <= config["clip_high_threshold"]:
        raise BadRequest("loss_fn_config: clip_low_threshold must not exceed clip_high_threshold")
    if "beta" in known and not config["beta"] >= 0:
        raise BadRequest(f"loss_fn_config: beta must be >= 0, found {config['beta']}")
    return config


def loss_terms(name: str, logprobs: Any, inputs: Mapping[str, np.ndarray], config: Mapping[str, float], device: Any,
               host: Any = None) -> tuple[Any, Any]:
    """The per-token loss (float32 [N]) of ``name`` (the SDK's definitions) and the
    scalar to differentiate (their sum), with ``ratio = exp(logprobs - sampling logprobs)``:

    - ``cross_entropy``: ``-weights * logprobs``;
    - ``importance_sampling``: ``-ratio * advantages``;
    - ``ppo``: ``-min(ratio * advantages, clip(ratio, low, high) * advantages)``;
    - ``cispo``: ``-sg(clip(ratio, low, high)) * logprobs * advantages`` (sg: no gradient);
    - ``dro``: ``-(logprobs * advantages - beta / 2 * (logprobs - sampling logprobs) ** 2)``.

    With the plugin ``host``, ``ppo``'s scalar comes from the ``grpo`` algorithm
    plugin's policy loss (clip range ``1 - low``, ``high - 1``, summed over tokens), the
    same loss ``skyrl run`` trains with, whenever the thresholds fit its options."""
    import torch

    def tensor(key: str) -> Any:
        return torch.as_tensor(np.array(inputs[key], dtype=np.float32), device=device)

    if name == "cross_entropy":
        elementwise = -tensor("weights") * logprobs
        return elementwise, elementwise.sum()
    sampled = tensor("logprobs")
    adv = tensor("advantages")
    if name == "dro":
        elementwise = -(logprobs * adv - 0.5 * config["beta"] * (logprobs - sampled) ** 2)
        return elementwise, elementwise.sum()
    ratio = torch.exp(logprobs - sampled)
    if name == "importance_sampling":
        elementwise = -ratio * adv
        return elementwise, elementwise.sum()
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    if name == "cispo":
        elementwise = -clipped.detach() * logprobs * adv
        return elementwise, elementwise.sum()
    elementwise = -torch.minimum(ratio * adv, clipped * adv)
    algorithm = _ppo_algorithm(host, config)
    if algorithm is None:
        return elementwise, elementwise.sum()
    from skyrl_host.interfaces import LossInputs

    n = int(logprobs.shape[0])
    ones = torch.ones(n, dtype=torch.float32, device=device)
    loss, _metrics = algorithm.loss(LossInputs(
        logprobs=logprobs, old_logprobs=sampled, engine_logprobs=sampled, advantages=adv, mask=ones,
        seq_ids=torch.zeros(n, dtype=torch.long, device=device), n_seqs=1, global_tokens=1.0, global_seqs=1.0))
    return elementwise, loss  # "token-mean" over one token's worth of normaliser: the sum over tokens


def _ppo_algorithm(host: Any, config: Mapping[str, float]) -> Any:
    """The ``grpo`` plugin's algorithm with ``ppo``'s clip range, or None when there is
    no host or the thresholds are outside what its options take (clip ranges in [0, 1))."""
    if host is None:
        return None
    low, high = 1.0 - config["clip_low_threshold"], config["clip_high_threshold"] - 1.0
    if not (0.0 <= low < 1.0 and 0.0 <= high < 1.0):
        return None
    reg = host.get("algorithms", PPO_ALGORITHM)
    return reg.create(reg.config(clip_low=low, clip_high=high, loss_agg="token-mean", kl_coef=0.0, tis_cap=0.0,
                                 dual_clip_c=0.0, ratio_level="token"))
