"""The RolloutBatch an engine call returns (the embedded engine's, the vllm engine's), from
the arrays its decoding filled.

:func:`assemble_batch` lays prompts and responses out as one batch (prompt ``i``'s
``n`` samples together, in order); :func:`routes_channel` and :func:`support_csr`
build its ``routed_experts`` (and, alike, ``indexer_topk``) and ``sample_support`` side channels
(:func:`wants_support`: whether a sampler asks for the latter);
:func:`turn_segment` cuts a continued conversation down to its new turn.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from skyrl_host.contracts import has
from skyrl_host.interfaces import SupportSampling
from skyrl_host.rollout import CSR, RolloutBatch


def wants_support(sampler: Any) -> bool:
    """Whether ``sampler`` asks for support sets (the SupportSampling capability with
    ``return_support`` set); a sampler that sets the flag without the method is a bug."""
    if has(sampler, SupportSampling):
        return bool(sampler.return_support)
    if getattr(sampler, "return_support", False):  # the flag without sample_with_support
        raise ValueError("the sampler has return_support set but no sample_with_support(logits, generator)")
    return False


def assemble_batch(
    prompts: list[list[int]],
    n: int,
    resp: np.ndarray,
    resp_lp: np.ndarray,
    resp_len: np.ndarray,
    stopped: np.ndarray,
    group_offset: int,
    version: int,
) -> RolloutBatch:
    """The batch of ``len(prompts) * n`` sequences: prompt ``i`` then row ``i * n + j`` of
    the responses (``resp`` / ``resp_lp`` ``[sequences, max_new]``, the first ``resp_len``
    entries of each row valid; ``stopped``: ended by a stop token, else truncated), group
    ``group_offset + i``, weight version ``version``, rewards NaN."""
    total, max_new = resp.shape
    plen = np.repeat(np.asarray([len(p) for p in prompts], dtype=np.int64), n)
    width = int(plen.max()) if total else 0
    grid = np.zeros((total, width + max_new), dtype=np.int32)
    lp_grid = np.zeros((total, width + max_new), dtype=np.float32)
    prompt_grid = np.zeros((len(prompts), width), dtype=np.int32)
    for i, p in enumerate(prompts):
        prompt_grid[i, : len(p)] = p
    grid[:, :width] = np.repeat(prompt_grid, n, axis=0)
    rows = np.arange(total)[:, None]
    resp_cols = plen[:, None] + np.arange(max_new)[None, :]
    grid[rows, resp_cols] = resp
    lp_grid[rows, resp_cols] = resp_lp
    cols = np.arange(width + max_new)[None, :]
    seq_len = plen + resp_len
    valid = cols < seq_len[:, None]
    is_resp = valid & (cols >= plen[:, None])
    cu = np.zeros(total + 1, dtype=np.int64)
    np.cumsum(seq_len, out=cu[1:])
    batch = RolloutBatch(
        tokens=grid[valid],
        cu_seqlens=cu,
        prompt_lens=plen.astype(np.int32),
        logprobs=np.where(is_resp, lp_grid, 0.0).astype(np.float32)[valid],
        loss_mask=is_resp[valid].astype(np.uint8),
        group_ids=group_offset + np.repeat(np.arange(len(prompts), dtype=np.int64), n),
        versions=np.full(total, version, dtype=np.int64),
        truncated=~stopped,
        rewards=np.full(total, np.nan, dtype=np.float32),
    )
    batch.validate()
    return batch


def routes_channel(batch: RolloutBatch, prompt_routes: list[np.ndarray], resp_routes: np.ndarray, n: int) -> np.ndarray:
    """The ``routed_experts`` side channel [T, L, k]: each sequence's prompt routes, then
    its response tokens' routes (the last response token's row is 0: never fed back).
    The ``indexer_topk`` channel is laid out the same way (its never-fed rows are -1)."""
    parts = []
    for s in range(batch.n_sequences):
        parts.append(prompt_routes[s // n])
        parts.append(resp_routes[s, : int(batch.response_lens[s])])
    if not parts:
        return np.zeros((0, *resp_routes.shape[2:]), dtype=resp_routes.dtype)
    return np.concatenate(parts)


def support_csr(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> CSR:
    """One CSR from the recorded steps (rows step-major, keyed ``sequence * max_new + t``):
    rows reordered sequence by sequence, token by token, i.e. the batch's generated tokens."""
    keys = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
    lens = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
    values = np.concatenate([p[2] for p in parts]) if parts else np.zeros(0, np.int32)
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    return CSR(offsets, values.astype(np.int32, copy=False)).take(np.argsort(keys, kind="stable"))


def turn_segment(full: RolloutBatch, history: RolloutBatch) -> RolloutBatch:
    """The segment of the new turn (see ``EmbeddedEngine.continue_turn``): from ``full``
    (each conversation of ``history`` generated whole: its history, new turn and
    response), each sequence without its history but the history's last token, with
    the history's group ids (``full``'s are set to them too)."""
    full.group_ids = np.asarray(history.group_ids, dtype=np.int64).copy()
    # Drop each conversation's history but its last token: the segment.
    start = history.seq_lens - 1
    keep = np.concatenate(
        [np.arange(full.cu_seqlens[i] + start[i], full.cu_seqlens[i + 1]) for i in range(full.n_sequences)]
    ) if full.n_sequences else np.zeros(0, np.int64)
    seg_lens = full.seq_lens - start
    cu = np.zeros(full.n_sequences + 1, dtype=np.int64)
    np.cumsum(seg_lens, out=cu[1:])
    side = {k: (v if isinstance(v, CSR) else v[keep]) for k, v in full.side_channels.items()}
    segment = RolloutBatch(
        tokens=full.tokens[keep],
        cu_seqlens=cu,
        prompt_lens=(full.prompt_lens - start).astype(np.int32),
        logprobs=full.logprobs[keep],
        loss_mask=full.loss_mask[keep],
        group_ids=full.group_ids,
        versions=full.versions,
        truncated=full.truncated,
        rewards=full.rewards,
        side_channels=side,
    )
    segment.validate()
    return segment
