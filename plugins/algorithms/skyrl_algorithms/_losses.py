"""The policy loss in torch (no hooks here): PPO-clip, dual-clip, GSPO's sequence
ratio, KL estimators, the off-policy corrections (truncated and masked importance
sampling at token or sequence level, IcePop, decoupled PPO) and the loss
aggregations.

:func:`policy_loss` returns one micro-batch's *share* of the step loss: every
normaliser is a whole-step quantity (``global_tokens``, ``global_seqs``,
``max_response_len``), so the shares of all micro-batches (and ranks) add up to
the loss of the whole step, and so do their gradients. A sequence must lie
whole inside one micro-batch (its token mean and its GSPO ratio are computed
there).

Metrics are means over this micro-batch's loss tokens: the step's value is their
average weighted by each micro-batch's loss-token count (``mask.sum()``).
``pg_loss`` and ``kl_loss`` follow the same rule: they are the micro-batch's share
times ``global_tokens / mask.sum()``, so the weighted average is the step's
policy (KL) loss.
"""

from __future__ import annotations

from typing import Any

import torch

from skyrl_toolkit.kl import kl_estimate

LOG_RATIO_LIMIT = 20.0  # log-ratios are clamped to [-20, 20] before exp (inf-safe)
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
OFF_POLICY_MODES = ("none", "tis", "mis", "icepop")
OFF_POLICY_LEVELS = ("token", "sequence", "geometric")


def _per_seq_sum(values: torch.Tensor, seq_ids: torch.Tensor, n_seqs: int) -> torch.Tensor:
    return torch.zeros(n_seqs, dtype=values.dtype, device=values.device).index_add(0, seq_ids, values)


def token_weights(
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    n_seqs: int,
    loss_agg: str,
    *,
    global_tokens: float,
    global_seqs: float,
    max_response_len: int = 0,
) -> torch.Tensor:
    """w [N] such that ``sum(w * token_loss)`` is this micro-batch's share of the
    aggregated step loss (0 outside the mask)."""
    if loss_agg == "token-mean":
        return mask / max(float(global_tokens), 1.0)
    seqs = max(float(global_seqs), 1.0)
    if loss_agg == "seq-mean-token-sum":
        return mask / seqs
    if loss_agg == "seq-mean-token-mean":
        counts = _per_seq_sum(mask, seq_ids, n_seqs).clamp(min=1.0)
        return mask / counts[seq_ids] / seqs
    if loss_agg == "seq-mean-token-sum-norm":
        if max_response_len <= 0:
            raise ValueError("loss_agg 'seq-mean-token-sum-norm' needs LossInputs.max_response_len (max_new_tokens) > 0")
        return mask / (seqs * float(max_response_len))
    raise ValueError(f"unknown loss_agg {loss_agg!r}; expected one of {', '.join(AGG_MODES)}")


def off_policy_weights(
    inputs: Any,
    mode: str,
    *,
    level: str = "token",
    cap: float | None = None,
    low: float | None = None,
    high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """w [N] (detached, 0 outside the mask) by which each token's policy loss is
    multiplied, and its metrics (means over the micro-batch's loss tokens).

    With ``d_t = logp_old_t - logp_engine_t`` (proximal over behaviour, in log) on
    the loss tokens, the ratio ``rho`` is ``exp(d_t)`` per token (``level =
    "token"``), ``exp(sum_{t in i} d_t)`` for every token of sequence ``i``
    (``"sequence"``: the sequence's likelihood ratio) or ``exp(mean_{t in i} d_t)``
    (``"geometric"``). Then::

        "tis":    w = min(rho, cap)
        "mis":    w = rho if rho <= cap else 0
        "icepop": w = rho if low <= rho <= high else 0         (token level)
        "is":     w = rho                                      (decoupled PPO without a cap)
    """
    logp = inputs.logprobs
    mask = inputs.mask.to(logp.dtype)
    on = mask != 0
    zero = torch.zeros_like(logp)
    old = inputs.old_logprobs.to(logp.dtype).detach()
    engine = inputs.engine_logprobs.to(logp.dtype).detach()
    delta = torch.where(on, old - engine, zero)
    if level == "token":
        log_rho = delta
    elif level in ("sequence", "geometric"):
        seq_ids = inputs.seq_ids.to(device=logp.device, dtype=torch.long)
        per_seq = _per_seq_sum(delta, seq_ids, inputs.n_seqs)
        if level == "geometric":
            per_seq = per_seq / _per_seq_sum(mask, seq_ids, inputs.n_seqs).clamp(min=1.0)
        log_rho = torch.where(on, per_seq[seq_ids], zero)
    else:
        raise ValueError(f"unknown off_policy_level {level!r}; expected one of {', '.join(OFF_POLICY_LEVELS)}")
    rho = torch.exp(log_rho.clamp(max=LOG_RATIO_LIMIT))

    dropped = None  # tokens whose weight the mask set to 0
    truncated = None  # tokens whose ratio the cap cut
    if mode == "tis":
        w = rho.clamp(max=cap)
        truncated = on & (rho > cap)
    elif mode == "mis":
        dropped = on & (rho > cap)
    elif mode == "icepop":
        dropped = on & ((rho < low) | (rho > high))
    elif mode != "is":
        raise ValueError(f"unknown off-policy correction {mode!r}; expected one of {', '.join(OFF_POLICY_MODES)}")
    if mode != "tis":
        w = rho if dropped is None else torch.where(dropped, zero, rho)
    w = torch.where(on, w, zero).detach()

    share = mask / max(float(mask.sum()), 1.0)
    d = delta.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    metrics = {
        "off_policy_weight_mean": (share * w).sum(),
        "off_policy_ratio_mean": (share * torch.where(on, rho, zero)).sum(),
        # k3 estimate of KL(behaviour || proximal) on the behaviour's samples: rho - 1 - log rho, per token
        "off_policy_kl": (share * torch.where(on, torch.exp(d) - 1.0 - d, zero)).sum(),
    }
    if dropped is not None:
        metrics["off_policy_masked_fraction"] = (share * dropped.to(share.dtype)).sum()
    if truncated is not None:
        metrics["off_policy_truncated_fraction"] = (share * truncated.to(share.dtype)).sum()
    return w, {k: v.detach() for k, v in metrics.items()}


def policy_loss(
    inputs: Any,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float = 0.0,
    ratio_level: str = "token",
    loss_agg: str = "token-mean",
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_in_loss: bool = True,
    tis_cap: float = 0.0,
    off_policy: str = "none",
    off_policy_level: str = "token",
    off_policy_cap: float | None = None,
    icepop_beta: float | None = None,
    icepop_alpha: float | None = None,
    decoupled: bool = False,
    teacher_kl_coef: float = 0.0,
    teacher_kl_estimator: str = "k2",
    teacher_kl_topk: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the step loss and its metrics (detached).

    ``inputs`` is a :class:`skyrl_host.interfaces.LossInputs`. Per token ``t`` with
    advantage ``A`` and ratio ``r``::

        pg_t = max(-r A, -clip(r, 1 - clip_low, 1 + clip_high) A)
        pg_t = min(pg_t, c |A|)                 if A < 0 and dual_clip_c = c > 0
        pg_t = pg_t * c_t                       (detached; the off-policy correction, if any)
        loss = sum_t w_t pg_t + kl_coef * sum_t w_t kl_t      (w_t: token_weights of loss_agg)
                              + teacher_kl_coef * sum_t w_t tkl_t

    ``c_t`` comes from :func:`off_policy_weights`: ``off_policy`` with
    ``off_policy_level`` and ``off_policy_cap`` ("tis", "mis"), or ``icepop_beta`` and
    ``icepop_alpha`` (default ``1 / icepop_beta``) ("icepop"); ``decoupled``: ``c_t =
    exp(logp_old - logp_engine)``, 0 where that exceeds ``off_policy_cap`` (if set);
    ``tis_cap = C > 0`` is ``off_policy = "tis"`` at token level with cap ``C`` (and
    also reports ``tis_weight_mean``).

    ``r = exp(logp - logp_old)`` for ``ratio_level="token"``; for ``"sequence"``
    (GSPO-token) ``r = sg[s_i] * exp(logp - sg[logp])`` with ``s_i = exp(mean over
    the loss tokens of sequence i of (logp - logp_old))``: its value is the
    sequence ratio and its gradient is ``s_i * grad logp`` on every token.

    ``tkl_t`` is ``teacher_kl_estimator`` of the policy's logprob against
    ``inputs.teacher_logprobs`` (the [teacher]'s logprob of the same token): "k2"
    ``(logp - teacher)^2 / 2``, whose gradient on the policy's own samples is that of
    KL(policy || teacher); "k3" ``exp(teacher - logp) - (teacher - logp) - 1``, whose
    gradient is that of KL(teacher || policy). With ``teacher_kl_topk`` = k,
    ``tkl_t = sum_j exp(T_j) (T_j - S_j)`` over the teacher's k most likely tokens at the
    position (``inputs.teacher_topk_logprobs`` T, the policy's logprobs of the same ids
    ``inputs.topk_logprobs`` S): the forward KL restricted to the teacher's top k, a
    gradient ``-sum_j p_teacher(j) grad S_j`` with no sampling in it. Reported as
    ``teacher_kl_loss``.
    """
    logp = inputs.logprobs
    mask = inputs.mask.to(logp.dtype)
    on = mask != 0
    seq_ids = inputs.seq_ids.to(device=logp.device, dtype=torch.long)
    adv = torch.where(on, inputs.advantages.to(logp.dtype), torch.zeros_like(logp))
    old = inputs.old_logprobs.to(logp.dtype).detach()
    zero = torch.zeros_like(logp)

    log_ratio = torch.where(on, logp - old, zero)
    if ratio_level == "token":
        ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    elif ratio_level == "sequence":
        counts = _per_seq_sum(mask, seq_ids, inputs.n_seqs).clamp(min=1.0)
        seq_log_ratio = (_per_seq_sum(log_ratio, seq_ids, inputs.n_seqs) / counts).clamp(
            -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT
        )
        live = torch.where(on, logp - logp.detach(), zero)  # value 0, gradient d logp
        ratio = torch.exp(seq_log_ratio.detach()[seq_ids] + live)
    else:
        raise ValueError(f"unknown ratio_level {ratio_level!r}; expected 'token' or 'sequence'")

    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    dual_active = None
    if dual_clip_c > 0:
        bound = -dual_clip_c * adv  # c |A| where A < 0
        negative = adv < 0
        dual_active = negative & (pg > bound)
        pg = torch.where(negative, torch.minimum(pg, bound), pg)
    mode, level, cap, legacy_tis = off_policy, off_policy_level, off_policy_cap, False
    if tis_cap > 0 and not decoupled and mode in ("none", "tis") and level == "token" and cap in (None, tis_cap):
        mode, cap, legacy_tis = "tis", tis_cap, True
    elif tis_cap > 0:
        raise ValueError("tis_cap conflicts with the off_policy options: set one of them")
    if decoupled:
        if mode != "none" or level != "token":
            raise ValueError("decoupled weights tokens by the behaviour ratio itself: off_policy must be 'none'")
        mode = "mis" if cap is not None else "is"
    correction = None
    if mode != "none":
        if mode in ("tis", "mis") and cap is None:
            raise ValueError(f"off_policy {mode!r} needs off_policy_cap")
        if mode == "icepop" and icepop_beta is None:
            raise ValueError("off_policy 'icepop' needs icepop_beta")
        high = icepop_beta
        low = None if high is None else (icepop_alpha if icepop_alpha is not None else 1.0 / high)
        correction, off_metrics = off_policy_weights(inputs, mode, level=level, cap=cap, low=low, high=high)
        pg = pg * correction

    weights = token_weights(
        mask,
        seq_ids,
        inputs.n_seqs,
        loss_agg,
        global_tokens=inputs.global_tokens,
        global_seqs=inputs.global_seqs,
        max_response_len=inputs.max_response_len,
    )
    pg_loss = (weights * pg).sum()
    loss = pg_loss

    local = float(mask.sum())
    share = (mask / max(local, 1.0)).detach()  # metric weights: means over this micro-batch's loss tokens
    to_local = max(float(inputs.global_tokens), 1.0) / max(local, 1.0)  # step share -> token-weighted value
    metrics: dict[str, torch.Tensor] = {
        "pg_loss": pg_loss.detach() * to_local,
        "clip_fraction": (share * clip_active.to(share.dtype)).sum(),
        "ratio_mean": (share * ratio.detach()).sum(),
    }
    if dual_active is not None:
        metrics["dual_clip_fraction"] = (share * dual_active.to(share.dtype)).sum()
    if correction is not None:
        metrics.update(off_metrics)
        if legacy_tis:
            metrics["tis_weight_mean"] = off_metrics["off_policy_weight_mean"]

    ref = inputs.ref_logprobs
    use_kl = kl_in_loss and kl_coef > 0
    if use_kl and ref is None:
        raise ValueError("kl_coef > 0 with the KL in the loss needs LossInputs.ref_logprobs")
    if ref is not None:
        ref = ref.to(logp.dtype).detach()
        # Both sides masked first: no NaN from prompt positions reaches the gradient.
        kl = torch.where(on, kl_estimate(torch.where(on, logp, zero), torch.where(on, ref, zero), kl_estimator), zero)
        metrics["kl"] = (share * kl.detach()).sum()
        if use_kl:
            kl_loss = (weights * kl).sum()
            metrics["kl_loss"] = kl_loss.detach() * to_local
            loss = loss + kl_coef * kl_loss
    if teacher_kl_coef > 0:
        if teacher_kl_topk > 0:
            top_t, top_s = inputs.teacher_topk_logprobs, inputs.topk_logprobs
            if top_t is None or top_s is None:
                raise ValueError("teacher_kl_topk > 0 needs LossInputs.teacher_topk_logprobs and topk_logprobs")
            keep = on[:, None]
            top_t = torch.where(keep, top_t.to(logp.dtype).detach(), 0.0)
            top_s = torch.where(keep, top_s.to(logp.dtype), 0.0)
            tkl = torch.where(on, (torch.exp(top_t) * (top_t - top_s)).sum(-1), zero)
        else:
            teacher = inputs.teacher_logprobs
            if teacher is None:
                raise ValueError("teacher_kl_coef > 0 needs LossInputs.teacher_logprobs (the job's [teacher])")
            teacher = teacher.to(logp.dtype).detach()
            tkl = torch.where(
                on, kl_estimate(torch.where(on, logp, zero), torch.where(on, teacher, zero), teacher_kl_estimator), zero
            )
        teacher_loss = (weights * tkl).sum()
        metrics["teacher_kl_loss"] = teacher_loss.detach() * to_local
        loss = loss + teacher_kl_coef * teacher_loss
    return loss, metrics
