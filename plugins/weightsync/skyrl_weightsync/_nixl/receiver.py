"""One engine rank's half of ``nixl``: :class:`NixlReceiver` works out, at ``connect``, the
byte runs it needs from every trainer rank and prepares the batched READs; ``sync`` reads
them between two checks of the peers' headers (imports torch; NIXL when the receiver
starts)."""

from __future__ import annotations

import base64
import math
import time
from typing import Any, Sequence

import numpy as np
import torch

from skyrl_host.statefile import loads_state

from .agent import NixlError, agent_name, make_agent, memory_of
from .sender import FORMAT, HEADER_BYTES
from .shards import ALIGN, align_up, box_runs, merge_runs, row_slice


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


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
        self.agent_name = agent_name(f"engine{k}of{n}")
        self.agent = make_agent(self.agent_name, backend)  # no thread: sync() drives its transfers itself
        self.version: int | None = None
        self._peers: list[_Peer] = []
        self._named: list[tuple[str, torch.Tensor]] = []
        self._registered: list[Any] = []
        self._staging: torch.Tensor | None = None
        self._headers = torch.zeros((0, 2, 2), dtype=torch.int64)
        self.bytes_per_sync = 0
        self.descriptors = 0
        self._fetched: int | None = None  # read by fetch(), not yet applied
        self._fetch_times = (0.0, 0.0, 0.0)

    # -- connect ---------------------------------------------------------------

    def connect(self, endpoints: Sequence[bytes | dict[str, Any]]) -> None:
        """Take every trainer rank's ``endpoint()`` and prepare the reads this engine rank
        needs (again: after a trainer restarted, or to change peers)."""
        self._disconnect()
        try:  # a state file's bytes (no pickle: an endpoint can come from another process)
            eps = [loads_state(e, "a trainer rank's endpoint") if isinstance(e, (bytes, bytearray)) else dict(e)
                   for e in endpoints]
        except ValueError as exc:
            raise NixlError(f"connect: {exc}") from None
        if not all(isinstance(ep, dict) for ep in eps):
            raise NixlError("connect: an endpoint is not a mapping")
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
                lo[0], hi[0] = row_slice(shape[0], k, n)
            box = tuple(h - l for l, h in zip(lo, hi))
            plan.append((name, tuple(lo), box, _dtype(dtype_name), at))
            at += align_up(math.prod(box) * torch.empty((), dtype=_dtype(dtype_name)).element_size())
        for a, b in aliases.items():
            if b not in info or b in aliases and aliases[b] != b:
                raise NixlError(f"connect: tensor {a!r} is served as {b!r}, which no trainer rank serves")
        staging = torch.zeros(max(at, ALIGN), dtype=torch.uint8, device=self.device)

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
                r = box_runs(ilo, ihi, plo, pshape, lo, box, itemsize)
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
        local_mem, local_dev = memory_of(staging)
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
                    "NIXL_INIT_AGENT", [(base, HEADER_BYTES, 0), (base + HEADER_BYTES, HEADER_BYTES, 0)], "DRAM")
                p.handles += [remote, local]
                p.header_reads = [self.agent.make_prepped_xfer("READ", local, [slot], remote, [0]) for slot in (0, 1)]
                for b, buf in enumerate(p.ep["buffers"]):
                    if (pi, b) not in runs:
                        continue
                    r = merge_runs(np.concatenate(runs[(pi, b)]))
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

    def fetch(self, target: int | None = None) -> int:
        """Read version ``target`` (default: the version every peer serves) into this
        receiver's staging buffers, checked; nothing reaches the engine. Raises
        :class:`NixlError` unless every peer served ``target`` unchanged for the whole
        read. Returns the version."""
        if not self._peers:
            raise NixlError(f"version {target}: sync before connect(endpoints)")
        self._fetched = None
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
        self._fetched = version
        self._fetch_times = (t1 - t0, t2 - t1, time.perf_counter() - t0)
        return version

    def apply(self, engine: Any) -> dict[str, float]:
        """Hand the engine the version :meth:`fetch` read, complete."""
        if self._fetched is None:
            raise NixlError("apply before a fetch: no version was read")
        version, self._fetched = self._fetched, None
        t0 = time.perf_counter()
        engine.update_weights(self._named, version)  # complete and checked: only now does the engine change
        self.version = version
        _, read_s, fetch_s = self._fetch_times
        apply_s = time.perf_counter() - t0
        return {"sync_version": float(version), "sync_bytes": float(self.bytes_per_sync),
                "sync_descriptors": float(self.descriptors),
                "sync_transfers": float(sum(len(p.reads) for p in self._peers)),
                "sync_read_s": read_s, "sync_apply_s": apply_s, "sync_seconds": fetch_s + apply_s}

    def sync(self, engine: Any, target: int | None = None) -> dict[str, float]:
        """Read version ``target`` (default: the version every peer serves) and hand it to
        ``engine.update_weights``; raises :class:`NixlError`, the engine unchanged, unless
        every peer served ``target`` unchanged for the whole read."""
        self.fetch(target)
        return self.apply(engine)


def worker_receiver(*, endpoints: Sequence[str], backend: str = "UCX", timeout_s: float = 60.0,
                    device: Any = "cpu") -> NixlReceiver:
    """A receiver built inside an engine's worker from a recipe (WorkerReceiving): the
    whole tensors (the engine's loader shards them), connected to the trainer ranks'
    ``endpoints`` (base64 of their ``endpoint()`` bytes)."""
    receiver = NixlReceiver(device=device, backend=backend, timeout_s=timeout_s)
    receiver.connect([base64.b64decode(e) for e in endpoints])
    return receiver
