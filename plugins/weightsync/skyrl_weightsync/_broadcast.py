"""The ``broadcast`` transport's halves (imports torch).

The trainer's rank (``src``) and the engine processes share a ``torch.distributed``
group that the launcher created (NCCL when every member is on CUDA, gloo otherwise). For each version:

1. ``broadcast_object_list`` of a small header: the version, the layout of the tensors
   (names, dtypes, shapes) when it changed since the last version, the total bytes;
2. the tensors' bytes, end to end, in flat buckets of ``bucket_bytes`` (preallocated
   once and reused: one collective per bucket, never one per parameter); a tensor may
   span buckets;
3. each receiver scatters the buckets into its own per-tensor buffers and, only once
   every bucket has arrived, hands the engine the complete set
   (``engine.update_weights``): a broken group (a dead peer) raises before anything is
   applied, and the engine keeps its last version.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

import torch
import torch.distributed as dist

_WIRE = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _segments(sizes: list[int], bucket: int) -> list[list[tuple[int, int, int, int]]]:
    """Per bucket: (tensor index, offset in the tensor, offset in the bucket, length)."""
    out: list[list[tuple[int, int, int, int]]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        done = 0
        while done < n:
            if used == bucket:
                out.append([])
                used = 0
            take = min(n - done, bucket - used)
            out[-1].append((i, done, used, take))
            done += take
            used += take
    return [b for b in out if b]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


class BroadcastSender:
    def __init__(self, *, group: Any = None, src: int = 0, bucket_bytes: int = 64 << 20, dtype: str = "bfloat16",
                 device: Any = None):
        """``device``: where the buckets live (None: the first tensor's device)."""
        self.group, self.src, self.bucket_bytes, self.dtype = group, src, int(bucket_bytes), dtype
        self.device = torch.device(device) if device is not None else None
        self._layout: list[tuple[str, str, tuple[int, ...]]] | None = None
        self._bucket: torch.Tensor | None = None

    def publish(self, version: int, named_tensors: Iterable[tuple[str, Any]]) -> dict[str, float]:
        t0 = time.perf_counter()
        tensors, layout = [], []
        for name, t in named_tensors:
            t = t.detach()
            # Weights in a master dtype go in the wire dtype; a precision's quantized
            # payloads and scales (``<weight>@<format>``) as they are.
            if t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) and "@" not in name:
                t = t.to(_WIRE[self.dtype])
            tensors.append(_as_bytes(t))
            layout.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
        header = {"version": int(version), "layout": layout if layout != self._layout else None,
                  "total": sum(int(b.numel()) for b in tensors)}
        dist.broadcast_object_list([header], src=self.src, group=self.group)
        self._layout = layout
        device = self.device or (tensors[0].device if tensors else torch.device("cpu"))
        if self._bucket is None or self._bucket.device != device:
            self._bucket = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device)
        calls = 0
        for seg in _segments([int(b.numel()) for b in tensors], self.bucket_bytes):
            end = 0
            for i, off, at, n in seg:
                self._bucket[at : at + n].copy_(tensors[i][off : off + n])
                end = at + n
            dist.broadcast(self._bucket[:end], src=self.src, group=self.group)
            calls += 1
        return {"sync_version": float(version), "sync_bytes": float(header["total"]), "sync_collectives": float(calls),
                "sync_publish_s": time.perf_counter() - t0}


class BroadcastReceiver:
    """One receiving member of the weight group: ``fetch`` takes the next version's
    broadcast into buffers of its own, ``apply`` hands the complete set to the engine;
    ``sync`` does both. ``group``: a process group, or ``(address, rank, world,
    backend)`` of one to join now (a receiver built inside an engine's worker from a
    recipe: :func:`skyrl_toolkit.groups.weight_group`)."""

    def __init__(self, *, group: Any = None, src: int = 0, bucket_bytes: int = 64 << 20, device: Any = "cpu",
                 timeout_s: float = 300.0):
        self.joined = isinstance(group, (tuple, list))
        if self.joined:
            from skyrl_toolkit.groups import comm_device, weight_group

            address, rank, world, backend = group
            group = weight_group(address, int(rank), int(world), timeout_s, backend)
            device = comm_device(str(device), backend)
        self.group, self.src, self.bucket_bytes = group, src, int(bucket_bytes)
        self.device = torch.device(device)
        self.version: int | None = None
        self._layout: list[tuple[str, str, tuple[int, ...]]] | None = None
        self._bufs: list[torch.Tensor] = []
        self._bucket: torch.Tensor | None = None
        self._pending: tuple[list[tuple[str, torch.Tensor]], int, int] | None = None  # fetched, not applied

    def fetch(self, target: int | None = None) -> int:
        """Receive the next version (blocks until the sender publishes it) into this
        receiver's buffers; nothing reaches the engine. ``target``: the version expected
        (a different one raises, and is not applied). Returns the version."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        header = box[0]
        layout = header["layout"] if header["layout"] is not None else self._layout
        if layout is None:
            raise RuntimeError(f"version {header['version']}: no tensor layout (this receiver joined after the first version)")
        sizes = [int(torch.Size(shape).numel()) * torch.empty(0, dtype=getattr(torch, dt)).element_size()
                 for _, dt, shape in layout]
        if header["layout"] is not None or len(self._bufs) != len(sizes):
            bufs = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
        else:
            # Reused: the engine copies what update_weights hands it into its own parameters,
            # so a half-received version here never reaches the engine.
            bufs = self._bufs
        if self._bucket is None:
            self._bucket = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device)
        for seg in _segments(sizes, self.bucket_bytes):
            end = seg[-1][2] + seg[-1][3]
            dist.broadcast(self._bucket[:end], src=self.src, group=self.group)
            for i, off, at, n in seg:
                bufs[i][off : off + n].copy_(self._bucket[at : at + n])
        self._layout, self._bufs = layout, bufs
        version = int(header["version"])
        if target is not None and version != int(target):
            raise RuntimeError(f"version {target}: the sender broadcast version {version}; nothing was applied")
        named = [(name, b.view(getattr(torch, dt)).reshape(shape)) for (name, dt, shape), b in zip(layout, bufs)]
        self._pending = (named, version, int(header["total"]))
        return version

    def apply(self, engine: Any) -> dict[str, float]:
        """Hand the engine the version :meth:`fetch` received, complete."""
        if self._pending is None:
            raise RuntimeError("apply before a fetch: no version was received")
        named, version, total = self._pending
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        engine.update_weights(named, version)  # complete: only now does the engine change
        self._pending, self.version = None, version
        return {"sync_version": float(version), "sync_bytes": float(total), "sync_apply_s": time.perf_counter() - t0}

    def sync(self, engine: Any, target: int | None = None) -> dict[str, float]:
        """Receive the next version (blocks until the sender publishes) and apply it."""
        t0 = time.perf_counter()
        self.fetch(target)
        stats = self.apply(engine)
        stats["sync_apply_s"] = time.perf_counter() - t0
        return stats

    def close(self) -> None:
        """Leave a group this receiver joined itself."""
        if self.joined and self.group is not None:
            from skyrl_toolkit.groups import destroy_group

            destroy_group(self.group)
        self.group = None
