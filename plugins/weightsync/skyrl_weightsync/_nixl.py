"""The ``nixl`` transport's halves (imports torch and NIXL).

**Sender** (one per trainer rank). At the first ``publish`` it works out what this rank
serves: a plain tensor is served whole; a ``DTensor`` serves the box its local shard
covers in the global tensor (``compute_local_shape_and_global_offset``: ``Shard(d)`` on
any mesh dimension, uneven shards included), and a value replicated over a mesh
dimension only from the rank at coordinate 0 there, so no byte is served twice; two
names for one tensor (tied weights) are served once. It allocates one flat buffer per
device for those pieces, in the wire dtype, and registers it with its NIXL agent
(``DRAM`` for CPU memory, ``VRAM`` for CUDA memory: the tensor's device decides), plus a
16-byte header ``[sequence, version]`` in DRAM. Every publish is a seqlock: the sequence
turns odd, the pieces are copied into the same buffers, the version is written, the
sequence turns even. Nothing is gathered, no collective is called.

``endpoint()`` (after the first publish) is what a receiver needs, as picklable bytes:
the agent's name and NIXL metadata (connection info and the registered regions), the
header's and the buffers' addresses, and the layout: every tensor's name, wire dtype
and global shape, and each piece's box (global offset, local shape) and place in the
buffer.

**Receiver** (one per engine rank; ``shard=(k, n)``: the k-th of n row slices of every
tensor of 2 or more dimensions, the way ``torch.tensor_split`` cuts dim 0; 1-D and 0-D
tensors whole). ``connect(endpoints)`` intersects the boxes it needs with the boxes the
trainer ranks serve, turns each intersection into contiguous byte runs (one per piece
when slices are along rows, one per row otherwise; adjacent runs merged) and prepares,
once per connect, one NIXL READ request per (peer, buffer) holding all of its runs,
into one registered staging buffer on ``device``. ``sync(engine, target)`` reads every
peer's header, checks the target version (sequence even), posts all the data reads at
once, waits, reads the headers again and checks that they did not move, and only then
calls ``engine.update_weights`` with views of the staging buffer (so nothing the engine
holds changes on a failure). Errors are :class:`NixlError` and name the version and
the peer (agent name and trainer rank) or the tensor.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import pickle
import socket
import sys
import threading
import time
import uuid
import weakref
from typing import Any, Iterable, Sequence

import numpy as np
import torch

FORMAT = 1
_WIRE = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_ALIGN = 16  # bytes; every piece and staged tensor starts on a multiple (views of any dtype are aligned)
_HEADER_BYTES = 16  # int64 [sequence (odd while a publish writes), version]


class NixlError(RuntimeError):
    """A sync or publish that failed; the engine keeps its last version."""


def nixl_api() -> Any:
    """NIXL's Python API module: ``nixl._api`` or, failing that, ``nixl_cu12._api`` (the wheel's name)."""
    try:
        from nixl import _api  # type: ignore[import-not-found]
    except ImportError:
        try:
            from nixl_cu12 import _api  # type: ignore[import-not-found]
        except ImportError:
            from skyrl_host.errors import UserError
            from skyrl_weightsync.nixl import INSTALL_HINT

            raise UserError(f"the nixl transport needs NIXL, which is not installed: {INSTALL_HINT}") from None
    _quiet(logging.getLogger("nixl"))
    return _api


def _quiet(logger: logging.Logger) -> None:
    # NIXL logs every agent's creation at INFO on stdout; stdout belongs to the program
    # (the benchmarks print JSON there). NIXL_LOG_LEVEL still wins.
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logger.setLevel(logging.WARNING)
    for h in logger.handlers:
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout:
            h.setStream(sys.stderr)


def make_agent(name: str, backend: str = "UCX", *, progress_thread: bool = False, polled: bool = False) -> Any:
    """A NIXL agent with one backend; ``polled``: a :class:`_Poller` thread will call it too
    (then NIXL locks its state on every call)."""
    api = nixl_api()
    sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if polled else None
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[backend],
                                                       sync_mode=sync))
    if backend not in agent.backends:
        raise NixlError(f"NIXL backend {backend!r} is not available here (NIXL has: {agent.get_plugin_list()})")
    return agent


def _agent_name(role: str) -> str:
    return f"skyrl-nixl-{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class _Poller(threading.Thread):
    """Drives a serving agent's progress every ``interval`` seconds. A peer's READ needs
    the serving side to answer now and then (connection set-up; on TCP every read is
    emulated with messages); NIXL's own progress thread does it by spinning, half a core
    even when idle, on every trainer rank."""

    def __init__(self, agent: Any, interval: float = 1e-3):
        super().__init__(name=f"nixl-progress-{agent.name}", daemon=True)
        self.agent, self.interval, self.stopped = agent, interval, threading.Event()
        _POLLERS.add(self)

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.agent.get_new_notifs()  # progresses the backend's workers
            except Exception:  # noqa: BLE001 - an agent being torn down
                return

    def stop(self) -> None:
        self.stopped.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join()


_POLLERS: "weakref.WeakSet[_Poller]" = weakref.WeakSet()


@atexit.register
def _stop_pollers() -> None:
    # Before the interpreter finalizes: a daemon thread still inside NIXL then would be
    # unwound through C++ frames, and the process aborts ("terminate called ...").
    for poller in list(_POLLERS):
        poller.stop()


def _mem(t: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor's memory."""
    return ("VRAM", t.get_device()) if t.is_cuda else ("DRAM", 0)


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- the sender ------------------------------------------------------------------


def _placement_of(name: str, t: Any) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor, bool]:
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


def _storage_key(local: torch.Tensor) -> tuple:
    return (local.device, local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape),
            tuple(local.stride()), local.dtype)


class NixlSender:
    """One trainer rank's half: ``publish(version, named_tensors)``, then ``endpoint()``."""

    def __init__(self, *, rank: int = 0, world: int = 1, dtype: str = "bfloat16", backend: str = "UCX",
                 progress_thread: bool = False):
        if dtype not in _WIRE:
            raise ValueError(f"dtype must be one of {sorted(_WIRE)}, not {dtype!r}")
        self.rank, self.world, self.dtype = int(rank), int(world), dtype
        self.agent_name = _agent_name(f"trainer{self.rank}")
        self.agent = make_agent(self.agent_name, backend, progress_thread=progress_thread, polled=not progress_thread)
        self._poller = None if progress_thread else _Poller(self.agent)
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
            shape, offset, local, serve = _placement_of(name, t)
            # Weights in a master dtype go in the wire dtype; a precision's quantized payloads
            # and scales (``<weight>@<format>``) as they are.
            master = local.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
            dtype = wire if master and "@" not in name else local.dtype
            tensors.append({"name": name, "dtype": _dtype_name(dtype), "shape": shape})
            key = _storage_key(local) + (shape, offset)
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
            sizes[local.device] = at + _up(nbytes)
            piece_src.append((local.device, at, dtype, tuple(local.shape)))
            plan.append((name, shape, offset, dtype, len(pieces)))
            pieces.append({"name": name, "offset": offset, "shape": tuple(local.shape), "at": at, "nbytes": nbytes})
        devices = list(sizes)
        self._buffers = [torch.zeros(max(sizes[d], _ALIGN), dtype=torch.uint8, device=d) for d in devices]
        for piece, (device, at, dtype, lshape) in zip(pieces, piece_src):
            b = devices.index(device)
            piece["buffer"] = b
            self._views.append(self._buffers[b][at : at + piece["nbytes"]].view(dtype).view(lshape))
        self._registered = [self.agent.register_memory(self._header)]
        self._registered += [self.agent.register_memory(b) for b in self._buffers]
        buffers = []
        for b in self._buffers:
            mem, dev = _mem(b)
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
            got_shape, got_offset, local, _ = _placement_of(name, t)
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
        """What receivers need to read from this rank (picklable bytes; valid after the first publish)."""
        if self._plan is None:
            raise NixlError("endpoint() before the first publish: the layout and the buffers come with it")
        if self._endpoint is None:
            self._endpoint = pickle.dumps({
                "format": FORMAT, "agent": self.agent_name, "metadata": self.agent.get_agent_metadata(),
                "rank": self.rank, "world": self.world, "dtype": self.dtype,
                "header": {"addr": self._header.data_ptr(), "nbytes": _HEADER_BYTES, "dev": 0, "mem": "DRAM"},
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


# -- the receiver ----------------------------------------------------------------


def _rows(rows: int, k: int, n: int) -> tuple[int, int]:
    """The k-th of n row slices, as ``torch.tensor_split`` cuts them."""
    q, r = divmod(rows, n)
    start = k * q + min(k, r)
    return start, start + q + (1 if k < r else 0)


def _runs(lo: Sequence[int], hi: Sequence[int], src_lo: Sequence[int], src_shape: Sequence[int],
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


def _merge(runs: np.ndarray) -> np.ndarray:
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


class _Peer:
    """One trainer rank as the receiver sees it."""

    def __init__(self, ep: dict[str, Any]):
        self.ep = ep
        self.agent: str = ep["agent"]
        self.rank: int = ep["rank"]
        self.reads: list[tuple[Any, int]] = []  # (prepared READ request, bytes) per buffer with something to read
        self.header_reads: list[Any] = []  # READs of the header into slot 0 (before) and slot 1 (after)
        self.handles: list[Any] = []  # prepared descriptor lists, released on reconnect

    def __str__(self) -> str:
        return f"peer {self.agent} (trainer rank {self.rank})"


class NixlReceiver:
    """One engine rank's half: ``connect(endpoints)``, then ``sync(engine, target=version)``."""

    def __init__(self, *, shard: tuple[int, int] = (0, 1), device: Any = "cpu", backend: str = "UCX",
                 timeout_s: float = 60.0):
        k, n = (int(x) for x in shard)
        if not 0 <= k < n:
            raise ValueError(f"shard must be (k, n) with 0 <= k < n, not {shard!r}")
        self.shard = (k, n)
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self.agent_name = _agent_name(f"engine{k}of{n}")
        self.agent = make_agent(self.agent_name, backend)  # no thread: sync() drives its transfers itself
        self.version: int | None = None
        self._peers: list[_Peer] = []
        self._named: list[tuple[str, torch.Tensor]] = []
        self._registered: list[Any] = []
        self._staging: torch.Tensor | None = None
        self._headers = torch.zeros((0, 2, 2), dtype=torch.int64)
        self.bytes_per_sync = 0
        self.descriptors = 0

    # -- connect ---------------------------------------------------------------

    def connect(self, endpoints: Sequence[bytes | dict[str, Any]]) -> None:
        """Take every trainer rank's ``endpoint()`` and prepare the reads this engine rank
        needs (again: after a trainer restarted, or to change peers)."""
        self._disconnect()
        eps = [pickle.loads(e) if isinstance(e, (bytes, bytearray)) else dict(e) for e in endpoints]
        if not eps:
            raise NixlError("connect: no endpoints")
        for ep in eps:
            if ep.get("format") != FORMAT:
                raise NixlError(f"connect: endpoint of {ep.get('agent')!r} has format {ep.get('format')!r}, "
                                f"this receiver reads format {FORMAT}")
        eps.sort(key=lambda ep: ep["rank"])
        if len({ep["dtype"] for ep in eps}) != 1:
            raise NixlError("connect: the trainer ranks publish different wire dtypes: "
                            + ", ".join(f"rank {ep['rank']}: {ep['dtype']}" for ep in eps))
        peers = [_Peer(ep) for ep in eps]

        # Every tensor's dtype and global shape; every rank that names it must agree.
        info: dict[str, tuple[str, tuple[int, ...]]] = {}
        aliases: dict[str, str] = {}
        for p in peers:
            for t in p.ep["tensors"]:
                got = (t["dtype"], tuple(t["shape"]))
                if info.setdefault(t["name"], got) != got:
                    raise NixlError(f"connect: tensor {t['name']!r} is {got} on {p}, {info[t['name']]} elsewhere")
            for a, b in p.ep["aliases"].items():
                aliases.setdefault(a, b)
        # Pieces per tensor; the same box served by several ranks (plain tensors on every
        # data-parallel rank) is read from one of them, spread over the ranks.
        pieces: dict[str, list[tuple[_Peer, dict[str, Any]]]] = {}
        for p in peers:
            for piece in p.ep["pieces"]:
                pieces.setdefault(piece["name"], []).append((p, piece))
        k, n = self.shard
        plan: list[tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype, int]] = []
        at = 0
        for name, (dtype_name, shape) in info.items():
            if name in aliases and aliases[name] != name:
                continue
            lo = [0] * len(shape)
            hi = list(shape)
            if len(shape) >= 2 and n > 1:
                lo[0], hi[0] = _rows(shape[0], k, n)
            box = tuple(h - l for l, h in zip(lo, hi))
            plan.append((name, tuple(lo), box, _dtype(dtype_name), at))
            at += _up(math.prod(box) * torch.empty((), dtype=_dtype(dtype_name)).element_size())
        for a, b in aliases.items():
            if b not in info or b in aliases and aliases[b] != b:
                raise NixlError(f"connect: tensor {a!r} is served as {b!r}, which no trainer rank serves")
        staging = torch.zeros(max(at, _ALIGN), dtype=torch.uint8, device=self.device)

        # Byte runs per (peer, buffer).
        runs: dict[tuple[int, int], list[np.ndarray]] = {}
        for ti, (name, lo, box, dtype, dst_at) in enumerate(plan):
            hi = [l + b for l, b in zip(lo, box)]
            itemsize = torch.empty((), dtype=dtype).element_size()
            boxes: dict[tuple, list[tuple[_Peer, dict[str, Any]]]] = {}
            for p, piece in pieces.get(name, []):
                boxes.setdefault((tuple(piece["offset"]), tuple(piece["shape"])), []).append((p, piece))
            covered = 0
            for i, cands in enumerate(boxes.values()):
                p, piece = cands[(ti + i) % len(cands)]
                plo, pshape = piece["offset"], piece["shape"]
                ilo = [max(a, b) for a, b in zip(lo, plo)]
                ihi = [min(a, b + s) for a, b, s in zip(hi, plo, pshape)]
                r = _runs(ilo, ihi, plo, pshape, lo, box, itemsize)
                if len(r):
                    covered += math.prod(h - l for l, h in zip(ilo, ihi))
                    r[:, 0] += piece["at"]
                    r[:, 1] += dst_at
                    runs.setdefault((peers.index(p), piece["buffer"]), []).append(r)
            need = math.prod(box)
            if covered != need:
                raise NixlError(f"connect: tensor {name!r}: the trainer ranks serve {covered} of the {need} elements "
                                f"this engine rank needs (rows {lo[0] if lo else 0}..{hi[0] if hi else 0} of "
                                f"{info[name][1]}): a rank is missing or the shards overlap")

        # Register the staging buffer and a slot pair per peer for the headers; load the peers.
        headers = torch.zeros((len(peers), 2, 2), dtype=torch.int64)
        self._registered = [self.agent.register_memory(staging), self.agent.register_memory(headers)]
        local_mem, local_dev = _mem(staging)
        total = ndesc = 0
        try:
            for pi, p in enumerate(peers):
                loaded = self.agent.add_remote_agent(p.ep["metadata"])
                loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
                if loaded != p.agent:
                    raise NixlError(f"connect: the metadata of {p} is of agent {loaded!r}")
                h = p.ep["header"]
                remote = self.agent.prep_xfer_dlist(p.agent, [(h["addr"], h["nbytes"], h["dev"])], h["mem"])
                base = headers[pi].data_ptr()
                local = self.agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", [(base, _HEADER_BYTES, 0), (base + _HEADER_BYTES, _HEADER_BYTES, 0)], "DRAM")
                p.handles += [remote, local]
                p.header_reads = [self.agent.make_prepped_xfer("READ", local, [slot], remote, [0]) for slot in (0, 1)]
                for b, buf in enumerate(p.ep["buffers"]):
                    if (pi, b) not in runs:
                        continue
                    r = _merge(np.concatenate(runs[(pi, b)]))
                    src = [(buf["addr"] + int(s), int(m), buf["dev"]) for s, _, m in r]
                    dst = [(staging.data_ptr() + int(d), int(m), local_dev) for _, d, m in r]
                    rh = self.agent.prep_xfer_dlist(p.agent, src, buf["mem"])
                    lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", dst, local_mem)
                    idx = list(range(len(r)))
                    p.handles += [rh, lh]
                    nbytes = int(r[:, 2].sum())
                    p.reads.append((self.agent.make_prepped_xfer("READ", lh, idx, rh, idx), nbytes))
                    total += nbytes
                    ndesc += len(r)
        except Exception:
            self._peers = peers
            self._disconnect()
            raise
        named = []
        for name, lo, box, dtype, dst_at in plan:
            nbytes = math.prod(box) * torch.empty((), dtype=dtype).element_size()
            named.append((name, staging[dst_at : dst_at + nbytes].view(dtype).view(box)))
        views = dict(named)
        named += [(a, views[b]) for a, b in aliases.items() if a != b]
        self._peers, self._staging, self._headers, self._named = peers, staging, headers, named
        self.bytes_per_sync, self.descriptors = total, ndesc

    def _disconnect(self) -> None:
        for p in self._peers:
            for x in p.header_reads + [r for r, _ in p.reads] + p.handles:
                try:
                    x.release()
                except Exception:  # noqa: BLE001 - a request of a dead peer may refuse; it is dropped anyway
                    pass
            try:
                self.agent.remove_remote_agent(p.agent)
            except Exception:  # noqa: BLE001
                pass
        for reg in self._registered:
            try:
                self.agent.deregister_memory(reg)
            except Exception:  # noqa: BLE001
                pass
        self._peers, self._registered, self._named, self._staging = [], [], [], None

    close = _disconnect

    # -- sync ------------------------------------------------------------------

    def _run(self, requests: list[tuple[_Peer, Any]], version: Any, what: str) -> None:
        """Post all ``requests`` at once and wait for all; a failure names the peer."""
        failed: list[str] = []
        pending: list[tuple[_Peer, Any]] = []
        for p, req in requests:
            try:
                state = self.agent.transfer(req)
            except Exception as exc:  # noqa: BLE001 - NIXL raises e.g. nixlRemoteDisconnectError for a dead peer
                failed.append(f"{p}: {type(exc).__name__}: {exc}")
                continue
            if state == "ERR":
                failed.append(f"{p}: the transfer failed to start")
            elif state != "DONE":
                pending.append((p, req))
        deadline = time.monotonic() + self.timeout_s
        spins = 0
        while pending:
            still = []
            for p, req in pending:
                try:
                    state = self.agent.check_xfer_state(req)
                except Exception as exc:  # noqa: BLE001
                    failed.append(f"{p}: {type(exc).__name__}: {exc}")
                    continue
                if state == "ERR":
                    failed.append(f"{p}: the transfer failed")
                elif state != "DONE":
                    still.append((p, req))
            pending = still
            if pending and time.monotonic() > deadline:
                failed += [f"{p}: no answer in {self.timeout_s:g} s" for p, _ in pending]
                break
            spins += 1
            if pending and spins > 1000:
                time.sleep(50e-6)  # a long transfer: stop spinning the core the copy may need
        if failed:
            raise NixlError(f"version {version}: reading the {what} failed: " + "; ".join(failed)
                            + "; nothing was applied")

    def sync(self, engine: Any, target: int | None = None) -> dict[str, float]:
        """Read version ``target`` (default: the version every peer serves) and hand it to
        ``engine.update_weights``; raises :class:`NixlError`, the engine unchanged, unless
        every peer served ``target`` unchanged for the whole read."""
        if not self._peers:
            raise NixlError(f"version {target}: sync before connect(endpoints)")
        t0 = time.perf_counter()
        shown = target if target is not None else "(latest)"
        self._run([(p, p.header_reads[0]) for p in self._peers], shown, "version headers")
        before = self._headers[:, 0].tolist()
        version = int(before[0][1]) if target is None else int(target)
        for p, (seq, v) in zip(self._peers, before):
            if seq % 2:
                raise NixlError(f"version {version}: {p} is publishing version {v} (a publish racing the read); "
                                "nothing was applied")
            if v != version:
                raise NixlError(f"version {version}: {p} serves version {v}; nothing was applied")
        t1 = time.perf_counter()
        self._run([(p, req) for p in self._peers for req, _ in p.reads], version, "weights")
        t2 = time.perf_counter()
        self._run([(p, p.header_reads[1]) for p in self._peers], version, "version headers")
        for p, b, (seq, v) in zip(self._peers, before, self._headers[:, 1].tolist()):
            if [seq, v] != b:
                raise NixlError(f"version {version}: {p} started publishing version {v} while version {version} was "
                                "being read (a publish racing the read); nothing was applied")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        engine.update_weights(self._named, version)  # complete and checked: only now does the engine change
        self.version = version
        t3 = time.perf_counter()
        return {"sync_version": float(version), "sync_bytes": float(self.bytes_per_sync),
                "sync_descriptors": float(self.descriptors),
                "sync_transfers": float(sum(len(p.reads) for p in self._peers)),
                "sync_read_s": t2 - t1, "sync_apply_s": t3 - t2, "sync_seconds": t3 - t0}
