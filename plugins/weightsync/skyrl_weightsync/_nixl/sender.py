"""One trainer rank's half of ``nixl``: :class:`NixlSender` serves this rank's shards from
buffers registered once, under a seqlock header, and its ``endpoint()`` tells receivers
where everything is (imports torch; NIXL when the sender starts)."""

from __future__ import annotations

import math
import time
import types
from typing import Any, Iterable

import torch

from skyrl_host.statefile import dumps_state

from .agent import NixlError, Poller, agent_name, make_agent, memory_of
from .shards import ALIGN, align_up, placement_of, storage_key

FORMAT = 1  # of the endpoint() a receiver reads
HEADER_BYTES = 16  # int64 [sequence (odd while a publish writes), version]
_WIRE = types.MappingProxyType({"bfloat16": torch.bfloat16, "float32": torch.float32})


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class NixlSender:
    """One trainer rank's half: ``publish(version, named_tensors)``, then ``endpoint()``."""

    def __init__(self, *, rank: int = 0, world: int = 1, dtype: str = "bfloat16", backend: str = "UCX",
                 progress_thread: bool = False):
        if dtype not in _WIRE:
            raise ValueError(f"dtype must be one of {sorted(_WIRE)}, not {dtype!r}")
        self.rank, self.world, self.dtype = int(rank), int(world), dtype
        self.agent_name = agent_name(f"trainer{self.rank}")
        self.agent = make_agent(self.agent_name, backend, progress_thread=progress_thread, polled=not progress_thread)
        self._poller = None if progress_thread else Poller(self.agent)
        if self._poller is not None:
            self._poller.start()
        self.version: int | None = None
        # Per input position: (name, global shape, global offset, wire dtype, piece index; None: not served here)
        self._plan: list[tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype, int | None]] | None = None
        self._views: list[torch.Tensor] = []  # per piece: its place in a registered buffer (wire dtype, local shape)
        self._buffers: list[torch.Tensor] = []
        self._registered: list[Any] = []
        self._header = torch.zeros(2, dtype=torch.int64)
        self._endpoint: bytes | None = None
        self._layout: dict[str, Any] = {}

    # The first publish fixes the layout and allocates and registers the buffers.
    def _build(self, items: list[tuple[str, Any]]) -> None:
        wire = _WIRE[self.dtype]
        plan, tensors, pieces, aliases = [], [], [], {}
        seen: dict[tuple, str] = {}
        sizes: dict[torch.device, int] = {}
        piece_src: list[tuple[torch.device, int, torch.dtype, tuple[int, ...]]] = []
        for name, t in items:
            shape, offset, local, serve = placement_of(name, t)
            # Weights in a master dtype go in the wire dtype; a precision's quantized payloads
            # and scales (``<weight>@<format>``) as they are.
            master = local.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
            dtype = wire if master and "@" not in name else local.dtype
            tensors.append({"name": name, "dtype": _dtype_name(dtype), "shape": shape})
            key = storage_key(local) + (shape, offset)
            if key in seen:  # a second name for the same tensor (tied weights): served once
                aliases[name] = seen[key]
                plan.append((name, shape, offset, dtype, None))
                continue
            seen[key] = name
            if not serve:
                plan.append((name, shape, offset, dtype, None))
                continue
            at = sizes.get(local.device, 0)
            nbytes = math.prod(local.shape) * torch.empty((), dtype=dtype).element_size()
            sizes[local.device] = at + align_up(nbytes)
            piece_src.append((local.device, at, dtype, tuple(local.shape)))
            plan.append((name, shape, offset, dtype, len(pieces)))
            pieces.append({"name": name, "offset": offset, "shape": tuple(local.shape), "at": at, "nbytes": nbytes})
        devices = list(sizes)
        self._buffers = [torch.zeros(max(sizes[d], ALIGN), dtype=torch.uint8, device=d) for d in devices]
        for piece, (device, at, dtype, lshape) in zip(pieces, piece_src):
            b = devices.index(device)
            piece["buffer"] = b
            self._views.append(self._buffers[b][at : at + piece["nbytes"]].view(dtype).view(lshape))
        self._registered = [self.agent.register_memory(self._header)]
        self._registered += [self.agent.register_memory(b) for b in self._buffers]
        buffers = []
        for b in self._buffers:
            mem, dev = memory_of(b)
            buffers.append({"addr": b.data_ptr(), "nbytes": b.numel(), "dev": dev, "mem": mem})
        self._plan = plan
        self._layout = {"tensors": tensors, "pieces": pieces, "aliases": aliases, "buffers": buffers}

    def publish(self, version: int, named_tensors: Iterable[tuple[str, Any]]) -> dict[str, float]:
        """Serve ``version``: copy this rank's part of ``named_tensors`` (plain tensors, whole;
        DTensors, this rank's shard) into the registered buffers. The same names, shapes and
        placements every time (the layout is fixed by the first publish)."""
        t0 = time.perf_counter()
        if self._plan is None:
            items = list(named_tensors)
            self._build(items)
            named_tensors = items
        assert self._plan is not None
        self._header[0] += 1  # odd: being written; receivers refuse to read
        self._header[1] = int(version)
        served = n = 0
        for name, t in named_tensors:
            if n >= len(self._plan):
                raise NixlError(f"version {version}: tensor {name!r} was not in the first publish (the layout is fixed "
                                "at the first publish; make a new sender for another model)")
            want, shape, offset, dtype, piece = self._plan[n]
            n += 1
            if piece is None and name == want and tuple(t.shape) == shape:
                continue  # served by another rank, or an alias
            got_shape, got_offset, local, _ = placement_of(name, t)
            if (name, got_shape, got_offset) != (want, shape, offset):
                raise NixlError(f"version {version}: tensor #{n - 1} is {name!r} {got_shape} at {got_offset}, the "
                                f"first publish had {want!r} {shape} at {offset} (the layout is fixed at the first "
                                "publish)")
            if piece is not None:
                self._views[piece].copy_(local)
                served += self._views[piece].numel() * self._views[piece].element_size()
        if n != len(self._plan):
            raise NixlError(f"version {version}: {n} tensors, the first publish had {len(self._plan)}")
        for b in self._buffers:
            if b.is_cuda:
                torch.cuda.synchronize(b.device)
        self._header[0] += 1  # even: complete
        self.version = int(version)
        return {"sync_version": float(version), "sync_served_bytes": float(served),
                "sync_publish_s": time.perf_counter() - t0}

    def endpoint(self) -> bytes:
        """What receivers need to read from this rank (the bytes of a state file,
        :func:`skyrl_host.statefile.dumps_state`: no pickle; valid after the first publish)."""
        if self._plan is None:
            raise NixlError("endpoint() before the first publish: the layout and the buffers come with it")
        if self._endpoint is None:
            self._endpoint = dumps_state({
                "format": FORMAT, "agent": self.agent_name, "metadata": self.agent.get_agent_metadata(),
                "rank": self.rank, "world": self.world, "dtype": self.dtype,
                "header": {"addr": self._header.data_ptr(), "nbytes": HEADER_BYTES, "dev": 0, "mem": "DRAM"},
                **self._layout,
            })
        return self._endpoint

    def close(self) -> None:
        if self._poller is not None:
            self._poller.stop()
            self._poller = None
        for reg in self._registered:
            try:
                self.agent.deregister_memory(reg)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        self._registered = []
