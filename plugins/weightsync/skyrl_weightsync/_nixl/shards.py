"""The geometry of the ``nixl`` transport: the box of a global tensor that a rank's shard
covers (plain tensors whole; ``DTensor`` shards by their placements), the row slice an
engine rank needs, and a box as contiguous byte runs between two row-major boxes, merged
where adjacent (imports numpy; torch only for ``DTensor``, already loaded by then)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .agent import NixlError

if TYPE_CHECKING:
    import torch

ALIGN = 16  # bytes; every piece and staged tensor starts on a multiple (views of any dtype are aligned)


def align_up(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def placement_of(name: str, t: Any) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor, bool]:
    """(global shape, global offset of this rank's box, local tensor, whether this rank serves it)."""
    # A DTensor exists only once its module is loaded (importing it costs seconds).
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    if dtensor_module is None or not isinstance(t, dtensor_module.DTensor):
        return tuple(t.shape), (0,) * t.dim(), t, True
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, tuple(t.placements)
    for p in placements:
        if p.is_partial():
            raise NixlError(f"tensor {name!r}: a Partial DTensor (a pending reduction) cannot be served; "
                            "reduce it first")
        if type(p).__name__ == "_StridedShard":
            raise NixlError(f"tensor {name!r}: strided shards ({p}) are not supported; only Shard(d) and Replicate")
    local = t.to_local()
    local_shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    if tuple(local.shape) != tuple(local_shape):
        raise NixlError(f"tensor {name!r}: local shard has shape {tuple(local.shape)}, its placements "
                        f"{placements} say {tuple(local_shape)}")
    coord = mesh.get_coordinate()
    serve = coord is not None and all(c == 0 for c, p in zip(coord, placements) if p.is_replicate())
    return tuple(t.shape), tuple(int(o) for o in offset), local, serve


def storage_key(local: torch.Tensor) -> tuple:
    """What makes two local tensors the same memory (tied weights): device, storage, view."""
    return (local.device, local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape),
            tuple(local.stride()), local.dtype)


def row_slice(rows: int, k: int, n: int) -> tuple[int, int]:
    """The k-th of n row slices, as ``torch.tensor_split`` cuts them."""
    q, r = divmod(rows, n)
    start = k * q + min(k, r)
    return start, start + q + (1 if k < r else 0)


def box_runs(lo: Sequence[int], hi: Sequence[int], src_lo: Sequence[int], src_shape: Sequence[int],
             dst_lo: Sequence[int], dst_shape: Sequence[int], itemsize: int) -> np.ndarray:
    """The box [lo, hi) as contiguous byte runs ``(offset in src, offset in dst, length)``,
    where src and dst are row-major boxes at ``src_lo``/``dst_lo`` of shapes ``*_shape``."""
    nd = len(lo)
    if nd == 0:
        return np.array([[0, 0, itemsize]], dtype=np.int64)
    ext = [h - l for l, h in zip(lo, hi)]
    if any(e <= 0 for e in ext):
        return np.zeros((0, 3), dtype=np.int64)
    # Merge trailing dims that the box covers entirely in both layouts.
    j, run = nd - 1, ext[nd - 1]
    while j > 0 and ext[j] == src_shape[j] == dst_shape[j]:
        j -= 1
        run *= ext[j]

    def strides(shape: Sequence[int]) -> np.ndarray:
        s = np.ones(nd, dtype=np.int64)
        for d in range(nd - 2, -1, -1):
            s[d] = s[d + 1] * shape[d + 1]
        return s

    s_src, s_dst = strides(src_shape), strides(dst_shape)
    if j == 0:
        starts = np.array(lo, dtype=np.int64)[None, :]
    else:  # one run per index of the outer dims [0, j)
        grids = np.meshgrid(*[np.arange(lo[d], hi[d], dtype=np.int64) for d in range(j)], indexing="ij")
        outer = np.stack([g.reshape(-1) for g in grids], axis=1)
        starts = np.concatenate([outer, np.broadcast_to(np.array(lo[j:], dtype=np.int64), (len(outer), nd - j))], 1)
    src = ((starts - np.array(src_lo)) * s_src).sum(1) * itemsize
    dst = ((starts - np.array(dst_lo)) * s_dst).sum(1) * itemsize
    return np.stack([src, dst, np.full(len(src), run * itemsize, dtype=np.int64)], axis=1)


def merge_runs(runs: np.ndarray) -> np.ndarray:
    """Join runs adjacent in both source and destination (sorted by destination)."""
    if len(runs) < 2:
        return runs
    runs = runs[np.argsort(runs[:, 1], kind="stable")]
    out = [list(runs[0])]
    for s, d, n in runs[1:]:
        last = out[-1]
        if last[0] + last[2] == s and last[1] + last[2] == d:
            last[2] += n
        else:
            out.append([s, d, n])
    return np.array(out, dtype=np.int64)
