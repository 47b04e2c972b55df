"""Rewards to advantages, group filtering and reward shaping, in numpy (no hooks here).

Everything here works on the per-sequence arrays of a
:class:`skyrl_host.rollout.RolloutBatch`; groups are the sequences sharing a
``group_ids`` value (they need not be contiguous). Arithmetic is float64, results
float32.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from skyrl_toolkit.kl import kl_estimate


def _groups(group_ids: Any) -> tuple[np.ndarray, np.ndarray]:
    """(index of each sequence's group, size of each group)."""
    _, inverse, counts = np.unique(np.asarray(group_ids), return_inverse=True, return_counts=True)
    return inverse.reshape(-1), counts


def group_advantages(
    rewards: Any,
    group_ids: Any,
    *,
    baseline: str = "mean",
    scale_by_std: bool = True,
    std: str = "population",
    eps: float = 1e-6,
) -> np.ndarray:
    """float32 [S]: one advantage per sequence.

    ``baseline="mean"``: ``r_i - mean_g``; ``"leave_one_out"``: ``r_i`` minus the mean of
    the other samples of its group (0 for a group of one, which has no other sample).
    ``scale_by_std``: divide by ``std_g + eps``, ``std_g`` the standard deviation of
    the group's rewards: ``std="population"`` divides the squared deviations by ``n``
    (ddof = 0), ``std="unbiased"`` by ``n - 1`` (ddof = 1, ``torch.std``'s default, what
    TRL and verl use); a group of one has std 0 either way (never NaN).
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or len(r) != len(np.asarray(group_ids)):
        raise ValueError(f"expected one reward per sequence, found shapes {r.shape} and {np.shape(group_ids)}")
    if np.isnan(r).any():
        raise ValueError("rewards contain NaN: score every sequence before computing advantages")
    g, counts = _groups(group_ids)
    sums = np.bincount(g, weights=r, minlength=len(counts))
    mean = sums / counts
    if baseline == "mean":
        adv = r - mean[g]
    elif baseline == "leave_one_out":
        n = counts[g]
        others = np.where(n > 1, (sums[g] - r) / np.maximum(n - 1, 1), r)
        adv = r - others
    else:
        raise ValueError(f"unknown baseline {baseline!r}")
    if std not in ("population", "unbiased"):
        raise ValueError(f"unknown std {std!r}: expected 'population' or 'unbiased'")
    if scale_by_std:
        squares = np.bincount(g, weights=(r - mean[g]) ** 2, minlength=len(counts))
        if std == "population":
            var = squares / counts
        else:  # n - 1; a group of one has no spread (its squares sum to 0): std 0, not 0/0
            var = squares / np.maximum(counts - 1, 1)
        adv = adv / (np.sqrt(var)[g] + eps)
    return adv.astype(np.float32)


def token_advantages(batch: Any, seq_advantages: Any) -> np.ndarray:
    """float32 [T]: each sequence's advantage on its loss tokens, 0 elsewhere."""
    per_token = np.repeat(np.asarray(seq_advantages, dtype=np.float32), batch.seq_lens)
    return (per_token * (batch.loss_mask != 0)).astype(np.float32)


def keep_groups_with_spread(rewards: Any, group_ids: Any) -> np.ndarray:
    """bool [S]: False for every sequence of a group whose rewards are all equal
    (exactly; a group of one always is), True for the others."""
    r = np.asarray(rewards, dtype=np.float64)
    g, counts = _groups(group_ids)
    high = np.full(len(counts), -np.inf)
    low = np.full(len(counts), np.inf)
    np.maximum.at(high, g, r)
    np.minimum.at(low, g, r)
    return (high > low)[g]


def overlong_penalty(response_lens: Any, max_new_tokens: int, buffer: int, factor: float) -> np.ndarray:
    """float32 [S]: DAPO's soft overlong punishment (<= 0).

    With ``Lmax = max_new_tokens`` and ``L = min(buffer, Lmax)``: 0 for a length
    ``l <= Lmax - L``; ``-(l - (Lmax - L)) / L * factor`` for ``Lmax - L < l <= Lmax``;
    ``-factor`` beyond ``Lmax``.
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, found {max_new_tokens}")
    if buffer <= 0:
        raise ValueError(f"the overlong buffer must be > 0, found {buffer}")
    L = min(int(buffer), int(max_new_tokens))
    start = max_new_tokens - L
    lens = np.asarray(response_lens, dtype=np.float64)
    penalty = -np.clip(lens - start, 0, L) / L * factor
    return penalty.astype(np.float32)


def kl_reward_penalty(
    engine_logprobs: Any,
    ref_logprobs: Any,
    mask: Any,
    seq_ids: Any,
    estimator: str,
    n_seqs: int | None = None,
) -> np.ndarray:
    """float32 [S]: each sequence's KL estimate summed over its loss tokens.

    For ``kl_in_reward``: the driver computes the reference logprobs of the
    rollout, then uses ``rewards - kl_coef * kl_reward_penalty(...)`` as the
    rewards for advantages. Per-token arrays (numpy, or CPU tensors without grad)
    of one packed batch; ``n_seqs`` defaults to ``max(seq_ids) + 1``.
    """
    logp = np.asarray(engine_logprobs, dtype=np.float64)
    ref = np.asarray(ref_logprobs, dtype=np.float64)
    m = np.asarray(mask) != 0
    ids = np.asarray(seq_ids, dtype=np.int64)
    if not (logp.shape == ref.shape == m.shape == ids.shape):
        raise ValueError(
            f"expected per-token arrays of one shape, found {logp.shape}, {ref.shape}, {m.shape}, {ids.shape}"
        )
    n = int(ids.max()) + 1 if n_seqs is None and len(ids) else int(n_seqs or 0)
    kl = np.where(m, kl_estimate(np.where(m, logp, 0.0), np.where(m, ref, 0.0), estimator), 0.0)
    return np.bincount(ids, weights=kl, minlength=n).astype(np.float32)
