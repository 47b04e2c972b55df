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

from skyrl_host.options import OptionError, ge, gt, in_interval, option

LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KlEstimator = Literal["k1", "k2", "k3"]
# k1 as a loss has zero expected gradient on the policy's own samples: not offered for the teacher.
TeacherKlEstimator = Literal["k2", "k3"]
Baseline = Literal["mean", "leave_one_out"]
StdKind = Literal["population", "unbiased"]
RatioLevel = Literal["token", "sequence"]
OffPolicy = Literal["none", "tis", "mis", "icepop"]
OffPolicyLevel = Literal["token", "sequence", "geometric"]


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
        "(0 = off, e.g. 2); the short form of off_policy = 'tis' with off_policy_cap = tis_cap",
        ge(0),
    ),
    # -- off-policy corrections (behaviour policy = the engine, proximal = old_logprobs) --
    "off_policy": Spec(
        OffPolicy,
        "none",
        "weight each token's policy loss by the proximal-over-behaviour ratio rho = exp(logp_old - logp_engine): "
        "'tis' min(rho, off_policy_cap); 'mis' rho, or 0 where rho > off_policy_cap; 'icepop' rho, or 0 where "
        "rho leaves [icepop_alpha, icepop_beta] (token level); 'none' no weight",
    ),
    "off_policy_level": Spec(
        OffPolicyLevel,
        "token",
        "where rho is taken for 'tis' and 'mis': 'token' per token; 'sequence' the product over the sequence's "
        "loss tokens, exp(sum(logp_old - logp_engine)); 'geometric' exp(mean(...)), the length-normalised one",
    ),
    "off_policy_cap": Spec(
        float | None,
        None,
        "the cap C: 'tis' truncates rho at C, 'mis' (and decoupled) masks tokens or sequences with rho > C "
        "(needed by 'tis' and 'mis', e.g. 2)",
        ge(1),
    ),
    "icepop_beta": Spec(
        float | None,
        None,
        "IcePop's upper bound beta: tokens with rho > beta or rho < icepop_alpha get weight 0 "
        "(needed by off_policy = 'icepop', e.g. 5)",
        gt(1),
    ),
    "icepop_alpha": Spec(
        float | None,
        None,
        "IcePop's lower bound alpha (default 1 / icepop_beta; the paper uses 0.5 with beta 5)",
        in_interval(0, 1, low_open=True, high_open=True),
    ),
    "decoupled": Spec(
        bool,
        False,
        "decoupled PPO: the ratio clipped against logp_old (the proximal policy) and each token's loss weighted "
        "by rho = exp(logp_old - logp_engine) (untruncated; with off_policy_cap, tokens with rho > C get 0)",
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
    # -- KL against a [teacher] (on-policy distillation as a loss term) -----
    "teacher_kl_coef": Spec(
        float, 0.0, "weight of a KL term against the [teacher]'s logprobs of the sampled tokens, added to the loss "
        "(0: none; above 0 the job needs a [teacher] table)", ge(0)
    ),
    "teacher_kl_estimator": Spec(
        TeacherKlEstimator, "k2", "the teacher KL's per-token estimator: 'k2' ((logp - teacher)^2 / 2: on the "
        "student's own samples its gradient is reverse KL(student || teacher)'s) or 'k3' (its gradient is forward "
        "KL(teacher || student)'s)"
    ),
    "teacher_kl_topk": Spec(
        int, 0, "k > 0: the teacher KL is over the teacher's k most likely tokens at each position, "
        "sum_j p_teacher(j) (log p_teacher(j) - log p(j)) (forward KL on its top k; teacher_kl_estimator unused); "
        "0: on the sampled token alone", in_interval(0, 1024)
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


def _check_off_policy(cfg: Any) -> None:
    """The cross-field rules of the off-policy options (``__attrs_post_init__``):
    one :class:`OptionError`, at the key to change, for the first rule broken."""
    mode, level, cap = cfg.off_policy, cfg.off_policy_level, cfg.off_policy_cap
    if cfg.tis_cap > 0:
        legacy = mode == "none" and level == "token" and cap is None and not cfg.decoupled
        same = mode == "tis" and level == "token" and cap in (None, cfg.tis_cap) and not cfg.decoupled
        if not (legacy or same):
            found = "decoupled = true" if cfg.decoupled else f"off_policy = {mode!r}"
            if not cfg.decoupled:
                found += f", off_policy_level = {level!r}, off_policy_cap = {cap!r}"
            raise OptionError(
                "tis_cap",
                f"tis_cap = C is off_policy = 'tis' with off_policy_level = 'token' and off_policy_cap = C; "
                f"it conflicts with {found}: set tis_cap or the off_policy options, not both",
            )
        cap = cfg.tis_cap if mode == "tis" else cap
    if cfg.decoupled:
        if mode != "none":
            raise OptionError(
                "decoupled",
                f"decoupled already weights each token by rho = exp(logp_old - logp_engine); off_policy = {mode!r} "
                f"weights it again: set off_policy = 'none' (with off_policy_cap to mask rho > C), or drop decoupled "
                f"(off_policy = 'tis' is the decoupled objective with rho truncated at off_policy_cap)",
            )
        if level != "token":
            raise OptionError("off_policy_level", f"decoupled weights tokens: expected 'token', found {level!r}")
    if mode in ("tis", "mis") and cap is None:
        raise OptionError("off_policy_cap", f"off_policy = {mode!r} needs off_policy_cap, the cap C (e.g. 2)")
    if mode == "icepop":
        if cfg.icepop_beta is None:
            raise OptionError("icepop_beta", "off_policy = 'icepop' needs icepop_beta, the upper bound (e.g. 5)")
        if level != "token":
            raise OptionError(
                "off_policy_level",
                f"IcePop masks tokens: expected 'token', found {level!r} (to mask whole sequences use "
                f"off_policy = 'mis' with off_policy_level = {level!r})",
            )
        if cap is not None:
            raise OptionError("off_policy_cap", "off_policy = 'icepop' takes icepop_beta (and icepop_alpha), not off_policy_cap")
    else:
        for key in ("icepop_beta", "icepop_alpha"):
            if getattr(cfg, key) is not None:
                raise OptionError(key, f"applies to off_policy = 'icepop' only, found off_policy = {mode!r}")
    if mode == "none" and not cfg.decoupled:
        if cap is not None:
            raise OptionError("off_policy_cap", "applies to off_policy = 'tis' or 'mis' (or decoupled), found off_policy = 'none'")
        if level != "token":
            raise OptionError("off_policy_level", "applies to off_policy = 'tis' or 'mis', found off_policy = 'none'")


def make_config(name: str, module: str, doc: str, **defaults: Any) -> type:
    """An attrs config class named ``name`` with every option of :data:`OPTIONS`,
    ``defaults`` overriding the shared defaults."""
    unknown = sorted(set(defaults) - set(OPTIONS))
    if unknown:
        raise TypeError(f"{name}: unknown options {unknown}")
    namespace: dict[str, Any] = {
        "__doc__": doc, "__module__": module, "__qualname__": name, "__annotations__": {},
        "__attrs_post_init__": _check_off_policy,
    }
    for key, spec in OPTIONS.items():
        namespace["__annotations__"][key] = spec.type
        namespace[key] = option(defaults.get(key, spec.default), help=spec.help, validator=spec.validator)
    return attrs.frozen(type(name, (), namespace))
