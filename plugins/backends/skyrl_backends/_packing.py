"""Packing: a RolloutBatch laid out as the torch backend's mini-batches of packed micro-batches.

The sequences are split into ``mini_batches`` groups (one optimizer update each) and
every group into packed micro-batches: whole sequences, in order, while their tokens
fit ``micro_batch_tokens``. Each micro-batch is laid out in rows of at most
``pack_length`` tokens (whole sequences, in order; a longer sequence gets its own
row), ``[n_rows, R]`` with ``R`` the longest row, positions restarting at 0 for every
sequence and for the pad tail of a shorter row (transformers then builds a
block-diagonal causal mask from the positions when no attention mask and no cache is
passed, so attention costs ``R^2`` per row, not ``n^2``).

A micro-batch holding a sequence longer than ``pack_length`` would be padded to it in
every row. When the model allows it (:func:`segment_attention_supported`: sdpa
attention, no sliding window, no recurrent layers), such a micro-batch is laid out
instead as **one flat row** of its real tokens, no padding, its sequences grouped by
length, and attention runs per sequence (:class:`Segments`, :func:`segment_sdpa`:
one causal ``scaled_dot_product_attention`` per group of equal-length sequences), so
attention costs the sum of the squared sequence lengths, not ``n_rows x R^2``, and no
``[R, R]`` mask is built.

Models with recurrent layers (Mamba, linear attention) ignore position ids: they get
one sequence per row (:func:`has_recurrent_layers`).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

PAD_ID = 0  # the token in the pad tails of packed rows (never attended to by a real token, logits never used)
SEGMENTS_KEY = "skyrl_segments"  # the keyword that carries a flat row's Segments to the attention function


class Segments:
    """The sequences of one flat row ``[1, N]``. ``groups`` are ``(offset, count,
    length)``: ``count`` sequences of ``length`` tokens each, end to end from flat index
    ``offset``. ``trees`` (after the groups) are ``(offset, prefix, lengths)``: a prefix
    of ``prefix`` tokens that several sequences share (their prompt, computed once),
    then each sequence's own tokens after it (``lengths``), end to end; a sequence's
    tokens attend to the prefix and, causally, to its own. Groups and trees cover the
    row in order."""

    def __init__(self, groups: list[tuple[int, int, int]], trees: list[tuple[int, int, tuple[int, ...]]] = ()):
        self.groups = groups
        self.trees = list(trees)
        self._masks: dict[Any, list[torch.Tensor]] = {}

    def tree_masks(self, device: torch.device) -> list[torch.Tensor]:
        """Each tree's attention mask, bool ``[n, n]`` (True: attend), made once per device."""
        if device not in self._masks:
            masks = []
            for _, prefix, lengths in self.trees:
                n = prefix + sum(lengths)
                m = torch.zeros(n, n, dtype=torch.bool)
                m[:prefix, :prefix] = torch.ones(prefix, prefix, dtype=torch.bool).tril_()
                start = prefix
                for length in lengths:
                    m[start : start + length, :prefix] = True
                    m[start : start + length, start : start + length] = torch.ones(length, length, dtype=torch.bool).tril_()
                    start += length
                masks.append(m.to(device))
            self._masks[device] = masks
        return self._masks[device]


def segment_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                 dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature over a flat row: ``query [1, Hq, N, D]``,
    ``key``/``value`` ``[1, Hkv, N, D]``, ``kwargs[SEGMENTS_KEY]`` its :class:`Segments`.
    Each group of ``count`` equal-length sequences is one causal SDPA call on
    ``[count, H, length, D]`` views (no mask); each tree (a shared prefix and the
    sequences after it) one SDPA call with its mask. Returns ``[1, N, Hq, D]``."""
    segments: Segments = kwargs[SEGMENTS_KEY]
    gqa = query.shape[1] != key.shape[1]
    dtype = query.dtype
    if query.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        # The CPU's bf16 attention kernels (forward and backward) took 2.8x the float32 ones' time
        # on a micro-batch of 32 sequences of 40-110 tokens (9 heads x 64); attention in float32 is
        # also the more exact (benchmarks/attention_dtype.py).
        query, key, value = query.float(), key.float(), value.float()
    sizes = [count * length for _, count, length in segments.groups]
    sizes += [prefix + sum(lengths) for _, prefix, lengths in segments.trees]
    # One split of each flat row (its backward: one cat), not a slice per group: the backward
    # of ``x[0, :, a:b]`` is a zero tensor of x's whole size with the slice's gradient added
    # in, so a slice per group cost a full-size fill and add per group and tensor.
    q, k, v = (x[0].split(sizes, dim=1) for x in (query, key, value))
    outs = []
    for (_, count, length), *qkv in zip(segments.groups, q, k, v):
        qg, kg, vg = (x.unflatten(1, (count, length)).transpose(0, 1) for x in qkv)  # [H, n, D] -> [count, H, L, D]
        o = torch.nn.functional.scaled_dot_product_attention(
            qg, kg, vg, dropout_p=dropout, scale=scaling, is_causal=length > 1, enable_gqa=gqa,
        )
        outs.append(o.transpose(1, 2).reshape(count * length, o.shape[1], o.shape[-1]))  # [count, H, L, D] -> [count * L, H, D]
    first = len(segments.groups)
    for mask, qt, kt, vt in zip(segments.tree_masks(query.device), q[first:], k[first:], v[first:]):
        o = torch.nn.functional.scaled_dot_product_attention(
            qt[None], kt[None], vt[None], attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa,
        )
        outs.append(o[0].transpose(0, 1))  # [1, H, n, D] -> [n, H, D]
    return torch.cat(outs).unsqueeze(0).to(dtype), None


def install_segment_attention() -> None:
    """Route transformers' ``"sdpa"`` attention through :func:`segment_sdpa` for calls
    that carry :class:`Segments` (the ``SEGMENTS_KEY`` keyword); every other call goes
    on unchanged (:func:`skyrl_toolkit.attention.route_sdpa`). Idempotent."""
    from skyrl_toolkit.attention import route_sdpa

    def takes(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> bool:
        return kwargs.get(SEGMENTS_KEY) is not None

    def handler(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        return segment_sdpa(module, query, key, value, attention_mask, dropout=kwargs.get("dropout", 0.0),
                            scaling=kwargs.get("scaling"), **{SEGMENTS_KEY: kwargs[SEGMENTS_KEY]})

    route_sdpa("segments", takes, handler)


SEGMENT_MODES = ("prepared", "built")
"""How a flat row reaches the model, in order of preference: ``"prepared"`` hands it an
empty prepared-mask mapping (no mask is built at all); ``"built"``, for forwards that take
no mapping, lets transformers build the block-diagonal mask from the positions (an
``[N, N]`` boolean, cheap beside the row's activations), which the per-sequence
attention does not read."""


def segment_attention_supported(model: Any, device: torch.device) -> str | bool:
    """How ``model`` can run flat rows with per-sequence attention (a mode of
    :data:`SEGMENT_MODES`), or False: sdpa attention, no sliding-window or recurrent
    layers, and the flat row's logits equal the padded rows' on a probe of three
    sequences (installs the attention routing first)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa" or has_recurrent_layers(config):
        return False
    for cfg in (config, getattr(config, "get_text_config", lambda: None)()):
        if cfg is None:
            continue
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) is not False:
            return False
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
            return False
    install_segment_attention()
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = int(getattr(embeddings, "num_embeddings", 8))
    lens = np.array([5, 3, 5])
    ids = (np.arange(int(lens.sum())) * 7 + 3) % vocab
    local = np.flatnonzero(np.concatenate([np.arange(n) for n in lens]) > 0)  # every token with a context
    z = np.zeros(len(local))
    rows = micro_batch(ids, lens, local, z, z, z, 1, 3, pack_length=1, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            want = model(input_ids=rows.ids, position_ids=rows.pos, use_cache=False).logits
            want = want.reshape(-1, want.shape[-1])[rows.keep]
            scale = float(want.abs().max()) + 1.0
            for mode in SEGMENT_MODES:
                flat = micro_batch(ids, lens, local, z, z, z, 1, 3, pack_length=1, device=device, segment_attention=mode)
                try:
                    got = model(input_ids=flat.ids, position_ids=flat.pos, use_cache=False, **flat.model_kwargs).logits
                except Exception:  # noqa: BLE001 - a forward that takes no prepared masks: try the next mode
                    continue
                got = got.reshape(-1, got.shape[-1])[flat.keep]
                if got.shape == want.shape and bool((got.float() - want.float()).abs().max() <= 1e-4 * scale):
                    return mode
    except Exception:  # noqa: BLE001 - the padded rows themselves fail: leave the layout alone
        return False
    finally:
        model.train(was_training)
    return False


def shared_prompts_supported(model: Any, device: torch.device, mode: str) -> bool:
    """Whether ``model``, on flat rows of ``mode``, gives the same logits with a shared
    prompt (:func:`layout_flat` ``trees``) as with every sequence on its own: a probe of
    three sequences after one 3-token prompt."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = int(getattr(embeddings, "num_embeddings", 8))
    prompt = [3 % vocab, 10 % vocab, 17 % vocab]
    seqs = [prompt + [(24 + 7 * i + j) % vocab for j in range(n)] for i, n in enumerate((2, 3, 1))]
    lens = np.array([len(x) for x in seqs])
    ids = np.concatenate(seqs)
    local = np.flatnonzero(np.concatenate([np.arange(n) for n in lens]) > 0)
    z = np.zeros(len(local))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = []
            for trees in ((), [([0, 1, 2], len(prompt))]):
                mb = micro_batch(ids, lens, local, z, z, z, 1, 3, pack_length=1, device=device,
                                 segment_attention=mode, trees=trees)
                out = model(input_ids=mb.ids, position_ids=mb.pos, use_cache=False, **mb.model_kwargs).logits
                logits.append(out.reshape(-1, out.shape[-1])[mb.keep].float())
    except Exception:  # noqa: BLE001 - a forward that fails on the shared layout: keep prompts apart
        return False
    finally:
        model.train(was_training)
    alone, shared = logits
    return shared.shape == alone.shape and bool((shared - alone).abs().max() <= 1e-4 * (float(alone.abs().max()) + 1.0))


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
        self.model_kwargs: dict = {}  # extra keywords of the model's forward (a flat row: masks and Segments)
        self.old: Any = None  # pre-update logprobs [K], from the no-grad pass
        self.ref: Any = None  # reference logprobs [K]
        self.teacher: Any = None  # the [teacher]'s logprobs [K] (its side channel's share)
        self.batch_idx: Any = None  # numpy int64 [K]: each loss token's index in the RolloutBatch
        self.slot_tokens: Any = None  # numpy int64 [n_rows * R]: the batch token at each slot (-1: padding)
        self.batch: Any = None  # the RolloutBatch it comes from

    @property
    def n_loss(self) -> int:
        return int(self.targets.numel())

    @property
    def dummy(self) -> bool:
        return self.n_sequences == 0


def pack_groups(seq_lens: np.ndarray, seqs: Iterable[int], budget: int,
                saved: dict[int, int] | None = None) -> list[list[int]]:
    """Whole sequences, in order, grouped while their total length fits ``budget``;
    a sequence longer than the budget goes alone. ``saved[s]``: the tokens sequence
    ``s`` does not add when it follows the sequence before it in the same group (a
    shared prompt)."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for s in seqs:
        n = int(seq_lens[s])
        if current and saved:  # (current[-1] is the sequence before s)
            n -= saved.get(int(s), 0)
        if current and used + n > budget:
            groups.append(current)
            current, used = [], 0
            n = int(seq_lens[s])
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


def layout_flat(seq_lens: np.ndarray, trees: list[tuple[list[int], int]] = ()) -> tuple[np.ndarray, np.ndarray, Segments]:
    """Lay out sequences (lengths ``seq_lens``, in order) end to end in one row, grouped
    by length (shortest first, ties in order), for per-sequence attention.

    ``trees``: ``(members, prefix)``: sequences (indices into ``seq_lens``) whose first
    ``prefix`` tokens are the same; they go after the groups, the prefix once, then each
    member's other tokens (:class:`Segments` ``trees``).

    Returns ``(where, positions, segments)`` as :func:`layout_rows` does (``where`` [n]:
    the flat index of each token, the sequences' tokens end to end, a shared prefix's
    tokens at the same indices for every member; ``positions`` [N], N the row's length)
    and the row's :class:`Segments`."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    cu = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    within = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], lens)
    in_tree = np.zeros(len(lens), dtype=bool)
    for members, _ in trees:
        in_tree[members] = True
    alone = np.flatnonzero(~in_tree)
    order = alone[np.argsort(lens[alone], kind="stable")]
    start = np.zeros(len(lens), dtype=np.int64)  # flat index of each sequence's first token
    start[order] = np.concatenate([[0], np.cumsum(lens[order])[:-1]]) if len(order) else start[order]
    where = np.repeat(start, lens) + within
    groups: list[tuple[int, int, int]] = []
    offset = 0
    values, counts = np.unique(lens[order], return_counts=True)
    for length, count in zip(values.tolist(), counts.tolist()):
        groups.append((offset, count, length))
        offset += count * length
    tree_segments = []
    for members, prefix in trees:
        tail = offset + prefix  # where the first member's own tokens start
        own = []
        for m in members:
            seq = slice(int(cu[m]), int(cu[m + 1]))
            w = within[seq]
            where[seq] = np.where(w < prefix, offset + w, tail + w - prefix)
            own.append(int(lens[m]) - prefix)
            tail += own[-1]
        tree_segments.append((offset, prefix, tuple(own)))
        offset = tail
    positions = np.empty(offset, dtype=np.int64)
    positions[where] = within
    return where, positions, Segments(groups, tree_segments)


def shared_prompts(tokens: np.ndarray, cu: np.ndarray, prompt_lens: np.ndarray, trains: np.ndarray,
                   seqs: list[int]) -> list[tuple[list[int], int]]:
    """Runs of consecutive sequences of ``seqs`` (batch indices) with the same prompt:
    equal ``prompt_lens``, the same prompt tokens, no loss token inside it, at least one
    token after it. Returns ``(members, prompt length)`` with members as indices into
    ``seqs``, for :func:`layout_flat`'s ``trees``."""
    trees: list[tuple[list[int], int]] = []
    run: list[int] = []
    key: Any = None
    for i, s in enumerate(seqs):
        p = int(prompt_lens[s])
        a, b = int(cu[s]), int(cu[s + 1])
        ok = 0 < p < b - a and not trains[a : a + p].any()
        this = (p, tokens[a : a + p].tobytes()) if ok else None
        if this is not None and this == key:
            run.append(i)
            continue
        if len(run) > 1:
            trees.append((run, key[0]))
        run, key = ([i], this) if this is not None else ([], None)
    if len(run) > 1:
        trees.append((run, key[0]))
    return trees


def plan_mini_batches(
    batch: Any, advantages: np.ndarray, *, mini_batches: int, micro_batch_tokens: int, pack_length: int,
    device: torch.device, segment_attention: str | bool = False, flat_always: bool = False,
    share_prompts: bool = False,
) -> list[list[MicroBatch]]:
    """The mini-batches of ``batch`` (this rank's share), each a list of packed
    micro-batches on ``device``. ``segment_attention``: a micro-batch with a sequence
    longer than ``pack_length`` (with ``flat_always``: every micro-batch) becomes one
    flat row with per-sequence attention; with ``share_prompts`` the consecutive samples
    of one prompt in such a row share the prompt's tokens (:func:`shared_prompts`)."""
    lens = batch.seq_lens
    positions = batch.positions()
    trains = (np.asarray(batch.loss_mask) != 0) & (positions > 0)  # a sequence's first token has no context
    cu = batch.cu_seqlens
    tokens = np.asarray(batch.tokens)
    minis = np.array_split(np.arange(batch.n_sequences), mini_batches)
    plan = []
    for seqs in minis:
        micros = []
        saved = None
        if share_prompts and segment_attention and flat_always:  # every micro-batch flat: count a shared prompt once
            order = [int(s) for s in seqs]
            saved = {order[i]: prefix for members, prefix in shared_prompts(tokens, cu, batch.prompt_lens, trains, order)
                     for i in members[1:]}
        for group in pack_groups(lens, seqs, micro_batch_tokens, saved):
            idx = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in group])
            local = np.flatnonzero(trains[idx])
            owner = np.repeat(np.arange(len(group)), lens[group])[local]
            _, seq_ids = np.unique(owner, return_inverse=True)
            flat = segment_attention if flat_always or int(lens[group].max()) > pack_length else False
            trees = shared_prompts(tokens, cu, batch.prompt_lens, trains, group) if flat and share_prompts else ()
            micro = micro_batch(tokens[idx], lens[group], local, advantages[idx[local]],
                                np.asarray(batch.logprobs)[idx[local]], seq_ids,
                                int(len(np.unique(owner))), len(group), pack_length=pack_length, device=device,
                                token_index=idx, segment_attention=flat, trees=trees)
            micro.batch_idx = idx[local]
            micro.batch = batch
            micros.append(micro)
        plan.append(micros)
    return plan


def micro_batch(ids, seq_lens, local, adv, engine_lp, seq_ids, n_seqs, n_sequences, *, pack_length: int,
                device: torch.device, token_index=None, segment_attention: str | bool = False,
                trees: list[tuple[list[int], int]] = ()) -> MicroBatch:
    """``ids``: the group's tokens end to end; ``seq_lens``: its sequences'
    lengths; ``local``: the indices (into ``ids``) of its loss tokens (never a
    sequence's first token). ``segment_attention``: one flat row (:func:`layout_flat`,
    with ``trees``: shared prompts) instead of padded rows."""
    d = device
    segments = None
    if segment_attention:  # True / "prepared" or "built" (see segment_attention_supported)
        where, positions, segments = layout_flat(seq_lens, trees)
        n_rows, R = 1, len(positions)
    else:
        where, positions, n_rows, R = layout_rows(seq_lens, pack_length)
    flat = np.full(n_rows * R, PAD_ID, dtype=np.int64)
    flat[where] = ids

    def long(x: Any) -> torch.Tensor:
        return torch.as_tensor(np.asarray(x, dtype=np.int64), device=d)

    def f32(x: Any) -> torch.Tensor:
        return torch.as_tensor(np.asarray(x, dtype=np.float32), device=d)

    micro = MicroBatch(
        ids=long(flat).reshape(n_rows, R), pos=long(positions).reshape(n_rows, R), keep=long(where[local - 1]),
        targets=long(ids[local]),
        adv=f32(adv), engine_lp=f32(engine_lp), seq_ids=long(seq_ids).reshape(-1),
        n_seqs=n_seqs, n_tokens=len(ids), n_sequences=n_sequences,
    )
    if segments is not None:
        micro.model_kwargs = {SEGMENTS_KEY: segments}
        if segment_attention != "built":
            # A prepared (empty) mask for every layer type: transformers builds no [N, N] mask.
            micro.model_kwargs["attention_mask"] = {"full_attention": None}
        # "built": the model's forward takes no prepared masks (transformers 5.24's MoE models), so it
        # builds the block-diagonal mask from the positions, which the per-sequence attention ignores.
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
