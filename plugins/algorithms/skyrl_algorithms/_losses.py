"""The policy loss in torch (no hooks here): PPO-clip, dual-clip, GSPO's sequence
ratio, KL estimators, truncated importance sampling and the loss aggregations.

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

from skyrl_host.kl import kl_estimate

LOG_RATIO_LIMIT = 20.0  # log-ratios are clamped to [-20, 20] before exp (inf-safe)
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the step loss and its metrics (detached).

    ``inputs`` is a :class:`skyrl_host.interfaces.LossInputs`. Per token ``t`` with
    advantage ``A`` and ratio ``r``::

        pg_t = max(-r A, -clip(r, 1 - clip_low, 1 + clip_high) A)
        pg_t = min(pg_t, c |A|)                 if A < 0 and dual_clip_c = c > 0
        pg_t = pg_t * min(exp(logp_old - logp_engine), tis_cap)   (detached; tis_cap > 0)
        loss = sum_t w_t pg_t + kl_coef * sum_t w_t kl_t      (w_t: token_weights of loss_agg)

    ``r = exp(logp - logp_old)`` for ``ratio_level="token"``; for ``"sequence"``
    (GSPO-token) ``r = sg[s_i] * exp(logp - sg[logp])`` with ``s_i = exp(mean over
    the loss tokens of sequence i of (logp - logp_old))``: its value is the
    sequence ratio and its gradient is ``s_i * grad logp`` on every token.
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
    tis = None
    if tis_cap > 0:
        engine = inputs.engine_logprobs.to(logp.dtype)
        tis = torch.exp(torch.where(on, old - engine, zero).clamp(max=LOG_RATIO_LIMIT)).clamp(max=tis_cap).detach()
        pg = pg * tis

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
    if tis is not None:
        metrics["tis_weight_mean"] = (share * tis).sum()

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
    return loss, metrics
