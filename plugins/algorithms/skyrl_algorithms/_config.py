"""The options every algorithm of this distribution shares (no hooks here).

Every algorithm takes the same keys in ``[algorithm]``; what makes ``grpo`` differ
from ``dapo`` is only its defaults. :func:`make_config` builds one attrs class per
algorithm, with the fields in the order of :data:`OPTIONS` and that algorithm's
defaults, so ``skyrl validate --explain`` lists every key the same way for all.

Imports attrs and the host's config helpers only (discovery stays light).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Literal, Mapping

import attrs

from skyrl_host.options import ge, gt, in_interval, option

LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KlEstimator = Literal["k1", "k2", "k3"]
Baseline = Literal["mean", "leave_one_out"]
StdKind = Literal["population", "unbiased"]
RatioLevel = Literal["token", "sequence"]


def _dual_clip(_inst: Any, _attr: Any, value: float) -> None:
    if value != 0 and not value > 1:
        raise ValueError(f"expected 0 (off) or a value > 1, found {value!r}")


@attrs.frozen
class Spec:
    """One shared option: its type, its default when an algorithm keeps it, help, check."""

    type: Any
    default: Any
    help: str
    validator: Callable[..., None] | None = None


_CLIP = in_interval(0, 1, high_open=True)

OPTIONS: Mapping[str, Spec] = MappingProxyType({  # read-only: the table every algorithm's config is made from
    # -- the policy loss ----------------------------------------------------
    "clip_low": Spec(float, 0.2, "PPO clip range below 1: the ratio is clipped at 1 - clip_low", _CLIP),
    "clip_high": Spec(float, 0.2, "PPO clip range above 1: the ratio is clipped at 1 + clip_high", _CLIP),
    "dual_clip_c": Spec(
        float, 0.0, "dual-clip: a token with A < 0 loses at most c*|A| (0 = off, else > 1, e.g. 3)", _dual_clip
    ),
    "ratio_level": Spec(
        RatioLevel,
        "token",
        "'token': PPO ratio exp(logp - logp_old) per token; 'sequence': GSPO's ratio "
        "exp(mean over the sequence of logp - logp_old), clipped per sequence",
    ),
    "loss_agg": Spec(
        LossAgg,
        "seq-mean-token-mean",
        "how token losses add up to the step loss: 'token-mean', 'seq-mean-token-sum', "
        "'seq-mean-token-mean' or 'seq-mean-token-sum-norm' (over sequences * max_new_tokens)",
    ),
    "tis_cap": Spec(
        float,
        0.0,
        "truncated importance sampling: weight each token's loss by min(exp(logp_old - logp_engine), tis_cap) "
        "(0 = off, e.g. 2)",
        ge(0),
    ),
    # -- advantages ---------------------------------------------------------
    "baseline": Spec(
        Baseline,
        "mean",
        "'mean': subtract the group's mean reward; 'leave_one_out': subtract the mean of the group's other samples",
    ),
    "scale_by_std": Spec(bool, True, "divide advantages by the group's reward std + eps"),
    "std": Spec(
        StdKind,
        "population",
        "which group std scale_by_std divides by: 'population' (ddof 0, divide by n) or 'unbiased' "
        "(ddof 1, divide by n - 1: torch.std's default, as TRL and verl); a group of one has std 0",
    ),
    "eps": Spec(float, 1e-6, "added to the group std before dividing", gt(0)),
    # -- KL against a frozen reference policy -------------------------------
    "kl_coef": Spec(float, 0.0, "weight of the KL penalty against the reference policy (0 = no reference)", ge(0)),
    "kl_estimator": Spec(
        KlEstimator, "k3", "KL estimator: 'k1' (logp - ref), 'k2' (squared / 2) or 'k3' (exp(ref - logp) - (ref - logp) - 1)"
    ),
    "kl_in_reward": Spec(
        bool, False, "subtract kl_coef * the sequence's summed KL from its reward instead of adding it to the loss"
    ),
    # -- reward shaping and filtering ----------------------------------------
    "overlong_shaping": Spec(
        bool, False, "DAPO overlong shaping: penalise responses linearly over the last overlong_buffer tokens"
    ),
    "overlong_buffer": Spec(
        int | None,
        None,
        "tokens before max_new_tokens where the overlong penalty ramps up (default: max_new_tokens // 5, at least 1)",
        gt(0),
    ),
    "overlong_penalty": Spec(float, 1.0, "the overlong penalty at max_new_tokens (and beyond)", ge(0)),
    "dynamic_sampling": Spec(
        bool, False, "DAPO dynamic sampling: drop groups whose rewards are all equal and refill the batch"
    ),
    "max_refill_rounds": Spec(
        int, 10, "with dynamic_sampling: most extra generation rounds per step to refill the batch (0 = none)", ge(0)
    ),
})


def make_config(name: str, module: str, doc: str, **defaults: Any) -> type:
    """An attrs config class named ``name`` with every option of :data:`OPTIONS`,
    ``defaults`` overriding the shared defaults."""
    unknown = sorted(set(defaults) - set(OPTIONS))
    if unknown:
        raise TypeError(f"{name}: unknown options {unknown}")
    namespace: dict[str, Any] = {"__doc__": doc, "__module__": module, "__qualname__": name, "__annotations__": {}}
    for key, spec in OPTIONS.items():
        namespace["__annotations__"][key] = spec.type
        namespace[key] = option(defaults.get(key, spec.default), help=spec.help, validator=spec.validator)
    return attrs.frozen(type(name, (), namespace))
