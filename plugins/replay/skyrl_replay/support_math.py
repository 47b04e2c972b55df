"""Logprobs over a sampled token's kept candidate set, without full-vocabulary logits (imports torch).

For scored position ``k`` with final hidden state ``h_k`` [H], kept set ``S_k`` (the
ids the engine's sampler could draw from) and target ``t_k`` in ``S_k``::

    z_kj = (h_k . W_j + b_j) / temperature        for j in S_k
    logprob_k = z_kt - logsumexp_{j in S_k} z_kj
    entropy_k = logsumexp_k - sum_{j in S_k} p_kj z_kj

Only the head rows ``W_j`` of kept ids are read, in chunks of at most ``chunk``
(id, position) pairs: memory is O(sum |S_k|) scalars plus one chunk of rows, never
``[K, vocab]``. The backward is written out (``d logprob_k / d z_kj =
(1[j = t_k] - p_kj) / temperature``) and also works chunk by chunk, so autograd
keeps no gathered rows either.
"""

from __future__ import annotations

from typing import Any

import torch

DEFAULT_CHUNK = 1 << 14  # (id, position) pairs per chunk: 2 x 16384 x H floats of gathered rows


def _pair_logits(hidden, weight, bias, rows, ids, temperature, chunk) -> torch.Tensor:
    z = torch.empty(rows.numel(), dtype=torch.float32, device=hidden.device)
    for a in range(0, rows.numel(), chunk):
        r, i = rows[a : a + chunk], ids[a : a + chunk]
        part = (hidden[r].float() * weight[i].float()).sum(-1)
        if bias is not None:
            part = part + bias[i].float()
        z[a : a + chunk] = part
    return z / temperature if temperature != 1.0 else z


class _SupportLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, rows, ids, is_target, n, temperature, chunk, reduce=None):  # noqa: D401
        # reduce: a vocabulary shard's all-reduce (in place, "max" / "sum") over the ranks
        # holding the other shards, which each hold their own (row, id) pairs
        with torch.no_grad():
            z = _pair_logits(hidden, weight, bias, rows, ids, temperature, chunk)
            top = torch.full((n,), float("-inf"), dtype=torch.float32, device=z.device)
            top.scatter_reduce_(0, rows, z, reduce="amax", include_self=True)
            if reduce is not None:
                reduce(top, "max")
            e = torch.exp(z - top[rows])
            total = torch.zeros(n, dtype=torch.float32, device=z.device).index_add_(0, rows, e)
            target_z = torch.zeros(n, dtype=torch.float32, device=z.device).index_add_(0, rows, z * is_target)
            if reduce is not None:
                reduce(total, "sum")
                reduce(target_z, "sum")
            lse = top + torch.log(total)
            p = e / total[rows]
            mean_z = torch.zeros(n, dtype=torch.float32, device=z.device).index_add_(0, rows, p * z)
            if reduce is not None:
                reduce(mean_z, "sum")
            entropy = lse - mean_z
        ctx.save_for_backward(hidden, weight, rows, ids, is_target, p)
        ctx.has_bias = bias is not None
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return target_z - lse, entropy

    @staticmethod
    def backward(ctx, grad_lp, _grad_entropy):
        hidden, weight, rows, ids, is_target, p = ctx.saved_tensors
        dz = grad_lp.float()[rows] * (is_target - p) / ctx.temperature  # [M]
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        grad_b = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device).index_add_(0, ids, dz)
        chunk = ctx.chunk
        for a in range(0, rows.numel(), chunk):
            r, i, d = rows[a : a + chunk], ids[a : a + chunk], dz[a : a + chunk, None]
            if grad_h is not None:
                grad_h.index_add_(0, r, d * weight[i].float())
            if grad_w is not None:
                grad_w.index_add_(0, i, d * hidden[r].float())
        if grad_h is not None:
            grad_h = grad_h.to(hidden.dtype)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(weight.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


def support_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    offsets: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
    shard: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [K] with grad, entropy [K] without) of ``targets`` [K] over the kept sets
    given in CSR form (``offsets`` [K + 1], ``ids`` [M]), from ``hidden`` [K, H] and the
    output head ``weight`` [V, H] (+ ``bias`` [V]). Computed in float32.

    ``shard`` (a :class:`skyrl_host.interfaces.VocabShard`): ``weight`` holds only the rows
    ``vocab_start ..`` of a vocabulary of ``vocab_size`` (tensor parallelism). Each rank
    scores the kept ids in its rows; the maxima and sums of the log-softmax are all-reduced
    over the ranks (no logits and no head rows are gathered). The gradient of ``hidden``
    is this rank's part: the caller sums it over the ranks (megatron-core's
    ``copy_to_tensor_model_parallel_region`` before the head does).

    Raises ValueError when a target is not in its kept set: the side channel does not
    belong to these tokens (stale or misaligned)."""
    K = int(targets.numel())
    if offsets.numel() != K + 1:
        raise ValueError(f"sample support: {offsets.numel() - 1} kept sets for {K} scored tokens")
    lens = offsets[1:] - offsets[:-1]
    if K and int(lens.min()) < 1:
        raise ValueError("sample support: a scored token has an empty kept set")
    dev = hidden.device
    rows = torch.repeat_interleave(torch.arange(K, device=dev), lens.to(dev))
    ids = ids.to(device=dev, dtype=torch.long)
    vocab = int(shard.vocab_size) if shard is not None else weight.shape[0]
    if ids.numel() and (int(ids.max()) >= vocab or int(ids.min()) < 0):
        raise ValueError(f"sample support: candidate ids outside the vocabulary (0..{vocab - 1})")
    is_target = (ids == targets.to(dev)[rows]).float()
    hits = torch.zeros(K, device=dev).index_add_(0, rows, is_target)
    if K and bool((hits != 1).any()):
        k = int(torch.nonzero(hits != 1)[0, 0])
        raise ValueError(
            f"sample support: scored token {k} (id {int(targets[k])}) is not in its kept set: "
            "the side channel does not match these tokens (stale or misaligned)"
        )
    reduce = None
    if shard is not None:  # this rank's pairs only, ids relative to its rows
        local = ids - int(shard.vocab_start)
        here = (local >= 0) & (local < weight.shape[0])
        rows, ids, is_target, reduce = rows[here], local[here], is_target[here], shard.all_reduce
    with torch.autocast(device_type=dev.type, enabled=False):
        return _SupportLogprob.apply(hidden, weight, bias, rows, ids, is_target, K, float(temperature), int(chunk), reduce)


def masked_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, offsets: torch.Tensor, ids: torch.Tensor, *, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same quantity from full logits [K, V]: ``log_softmax`` over the kept ids only.
    The naive reference, and the path for models whose head output is transformed
    (soft-capping) so the head rows alone do not give the logits."""
    K, V = logits.shape
    dev = logits.device
    lens = (offsets[1:] - offsets[:-1]).to(dev)
    rows = torch.repeat_interleave(torch.arange(K, device=dev), lens)
    keep = torch.zeros((K, V), dtype=torch.bool, device=dev)
    keep[rows, ids.to(device=dev, dtype=torch.long)] = True
    if K and not bool(keep.gather(1, targets[:, None].to(dev)).all()):
        raise ValueError("sample support: a scored token is not in its kept set (stale or misaligned side channel)")
    z = logits.float() / temperature
    z = z.masked_fill(~keep, float("-inf"))
    lp_all = torch.log_softmax(z, dim=-1)
    lp = lp_all.gather(1, targets[:, None].to(dev)).squeeze(1)
    with torch.no_grad():
        p = lp_all.exp()
        entropy = -(p * lp_all.masked_fill(~keep, 0.0)).sum(-1)
    return lp, entropy
