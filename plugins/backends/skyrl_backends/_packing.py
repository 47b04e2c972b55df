"""Packing: a RolloutBatch laid out as the torch backend's mini-batches of packed micro-batches.

The sequences are split into ``mini_batches`` groups (one optimizer update each) and
every group into packed micro-batches: whole sequences, in order, while their tokens
fit ``micro_batch_tokens``. Each micro-batch is laid out in rows of at most
``pack_length`` tokens (whole sequences, in order; a longer sequence gets its own
row), ``[n_rows, R]`` with ``R`` the longest row, positions restarting at 0 for every
sequence and for the pad tail of a shorter row (transformers then builds a
block-diagonal causal mask from the positions when no attention mask and no cache is
passed, so attention costs ``R^2`` per row, not ``n^2``).

Models with recurrent layers (Mamba, linear attention) ignore position ids: they get
one sequence per row (:func:`has_recurrent_layers`).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

PAD_ID = 0  # the token in the pad tails of packed rows (never attended to by a real token, logits never used)


class MicroBatch:
    """One packed micro-batch: rows of whole sequences and its loss tokens.

    ``keep`` are the flat positions (into ``ids.reshape(-1)``) whose logits predict
    the loss tokens (``t - 1`` for a loss token at ``t``, always in the same row);
    every per-token tensor has one entry per loss token."""

    def __init__(self, *, ids, pos, keep, targets, adv, engine_lp, seq_ids, n_seqs: int, n_tokens: int, n_sequences: int):
        self.ids = ids  # long [n_rows, R]
        self.pos = pos  # long [n_rows, R]
        self.keep = keep  # long [K], flat indices into n_rows * R
        self.targets = targets  # long [K]
        self.adv = adv  # float32 [K]
        self.engine_lp = engine_lp  # float32 [K]
        self.seq_ids = seq_ids  # long [K], 0..n_seqs-1 over the sequences with loss tokens
        self.n_seqs = n_seqs
        self.n_tokens = n_tokens  # all real tokens of the micro-batch (pad tails not counted)
        self.n_sequences = n_sequences  # all sequences of the micro-batch
        self.old: Any = None  # pre-update logprobs [K], from the no-grad pass
        self.ref: Any = None  # reference logprobs [K]
        self.batch_idx: Any = None  # numpy int64 [K]: each loss token's index in the RolloutBatch
        self.slot_tokens: Any = None  # numpy int64 [n_rows * R]: the batch token at each slot (-1: padding)
        self.batch: Any = None  # the RolloutBatch it comes from

    @property
    def n_loss(self) -> int:
        return int(self.targets.numel())

    @property
    def dummy(self) -> bool:
        return self.n_sequences == 0


def pack_groups(seq_lens: np.ndarray, seqs: Iterable[int], budget: int) -> list[list[int]]:
    """Whole sequences, in order, grouped while their total length fits ``budget``;
    a sequence longer than the budget goes alone."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for s in seqs:
        n = int(seq_lens[s])
        if current and used + n > budget:
            groups.append(current)
            current, used = [], 0
        current.append(int(s))
        used += n
    if current:
        groups.append(current)
    return groups


_RECURRENT_LAYER_TYPES = ("mamba", "linear_attention", "linear", "ssm", "deltanet")


def has_recurrent_layers(config: Any) -> bool:
    """True for models with layers that carry state along the sequence (Mamba,
    linear attention): they ignore position ids, so sequences packed into one row
    would leak state into each other."""
    for attr in ("layers_block_type", "layer_types", "hybrid_override_pattern"):
        kinds = getattr(config, attr, None)
        if kinds is None:
            continue
        text = " ".join(kinds) if not isinstance(kinds, str) else kinds
        text = text.lower()
        if any(k in text for k in _RECURRENT_LAYER_TYPES) or (attr == "hybrid_override_pattern" and "M" in kinds):
            return True
    return False


def layout_rows(seq_lens: np.ndarray, pack_length: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Lay out sequences (lengths ``seq_lens``, in order) in rows: whole sequences,
    greedily, while a row's length fits ``pack_length``; a longer sequence gets a row
    of its own. Every row is ``R`` long (the longest row); a shorter row ends in a pad
    tail whose positions restart at 0 (a segment of its own: no real token attends
    to it under the block-diagonal mask).

    Returns ``(where, positions, n_rows, R)``: ``where`` [n] is the flat index (into
    ``n_rows * R``) of each token, the sequences' tokens end to end; ``positions``
    [n_rows * R] is every slot's position id."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    rows = pack_groups(lens, range(len(lens)), pack_length)
    n_rows = len(rows)
    row_of = np.empty(len(lens), dtype=np.int64)
    for r, members in enumerate(rows):
        row_of[members] = r
    used = np.bincount(row_of, weights=lens, minlength=n_rows).astype(np.int64)
    R = int(used.max()) if n_rows else 0
    cu = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    row_start = np.zeros(n_rows, dtype=np.int64)  # offset in the batch of each row's first token
    row_start[1:] = np.cumsum(used)[:-1]
    seq_start = row_of * R + (cu[:-1] - row_start[row_of])  # flat index of each sequence's first token
    within = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], lens)
    where = np.repeat(seq_start, lens) + within
    slot = np.arange(R, dtype=np.int64)[None, :]
    positions = np.maximum(slot - used[:, None], 0).reshape(-1)  # the pad tails: 0, 1, 2, ...
    positions[where] = within
    return where, positions, n_rows, R


def plan_mini_batches(
    batch: Any, advantages: np.ndarray, *, mini_batches: int, micro_batch_tokens: int, pack_length: int,
    device: torch.device,
) -> list[list[MicroBatch]]:
    """The mini-batches of ``batch`` (this rank's share), each a list of packed
    micro-batches on ``device``."""
    lens = batch.seq_lens
    positions = batch.positions()
    trains = (np.asarray(batch.loss_mask) != 0) & (positions > 0)  # a sequence's first token has no context
    cu = batch.cu_seqlens
    tokens = np.asarray(batch.tokens)
    minis = np.array_split(np.arange(batch.n_sequences), mini_batches)
    plan = []
    for seqs in minis:
        micros = []
        for group in pack_groups(lens, seqs, micro_batch_tokens):
            idx = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in group])
            local = np.flatnonzero(trains[idx])
            owner = np.repeat(np.arange(len(group)), lens[group])[local]
            _, seq_ids = np.unique(owner, return_inverse=True)
            micro = micro_batch(tokens[idx], lens[group], local, advantages[idx[local]],
                                np.asarray(batch.logprobs)[idx[local]], seq_ids,
                                int(len(np.unique(owner))), len(group), pack_length=pack_length, device=device,
                                token_index=idx)
            micro.batch_idx = idx[local]
            micro.batch = batch
            micros.append(micro)
        plan.append(micros)
    return plan


def micro_batch(ids, seq_lens, local, adv, engine_lp, seq_ids, n_seqs, n_sequences, *, pack_length: int,
                device: torch.device, token_index=None) -> MicroBatch:
    """``ids``: the group's tokens end to end; ``seq_lens``: its sequences'
    lengths; ``local``: the indices (into ``ids``) of its loss tokens."""
    d = device
    where, positions, n_rows, R = layout_rows(seq_lens, pack_length)
    flat = np.full(n_rows * R, PAD_ID, dtype=np.int64)
    flat[where] = ids

    def long(x: Any) -> torch.Tensor:
        return torch.as_tensor(np.asarray(x, dtype=np.int64), device=d)

    def f32(x: Any) -> torch.Tensor:
        return torch.as_tensor(np.asarray(x, dtype=np.float32), device=d)

    micro = MicroBatch(
        ids=long(flat).reshape(n_rows, R), pos=long(positions).reshape(n_rows, R), keep=long(where[local] - 1),
        targets=long(ids[local]),
        adv=f32(adv), engine_lp=f32(engine_lp), seq_ids=long(seq_ids).reshape(-1),
        n_seqs=n_seqs, n_tokens=len(ids), n_sequences=n_sequences,
    )
    if token_index is not None:
        slots = np.full(n_rows * R, -1, dtype=np.int64)
        slots[where] = token_index
        micro.slot_tokens = slots
    return micro


def empty_micro_batch(*, pack_length: int, device: torch.device) -> MicroBatch:
    """An empty micro-batch (one token, no loss): keeps the ranks' collectives in step."""
    empty = np.zeros(0, dtype=np.int64)
    return micro_batch(np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64), empty,
                       np.zeros(0), np.zeros(0), empty, 0, 0, pack_length=pack_length, device=device)
