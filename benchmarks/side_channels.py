"""Side channels across a process boundary: RolloutBatch's packed arrays vs pickle-5, Ray's object store and per-token JSON.

    python benchmarks/side_channels.py [--preset kimi-k2] [--sequences 8] [--seq-len 4096]
        [--layers L] [--top-k K] [--experts E] [--vocab V] [--support-median 30]
        [--support-sigma 1.5] [--support-max 4096] [--naive-sequences 1] [--repeats 15]
        [--engine-prompts 32] [--engine-n 8] [--engine-max-new 32] [--threads 1] [--no-engine] [--quick]

Two parts, one JSON object on stdout.

1. **Synthetic batch at a full-size model's scale** (numpy, plus torch on the meta device to
   read the preset): ``--sequences`` x ``--seq-len`` tokens (default 8 x 4096 = 32,768;
   prompts 1/8-1/4 of each sequence, the rest generated) with the two side channels an MoE
   RL job carries, sized by ``--preset`` the way ``skyrl models show`` builds it (the
   family's config on the meta device, its ``routers``: one per MoE layer, dense layers
   excluded): ``kimi-k2`` (default) has 61 layers, the first dense, so 60 routers, top-8 of
   384 experts, vocabulary 163,840; ``qwen3-235b-a22b`` 94 routers, top-8 of 128, 151,936.
   ``--layers`` / ``--top-k`` / ``--experts`` / ``--vocab`` override (``--preset none``:
   48, 8, 256, 151,936).

   - ``routed_experts``, ``[tokens, MoE layers, top_k]``: ``top_k`` distinct experts per
     token and layer, uint8 up to 256 experts, uint16 above (Kimi K2: 960 bytes a token);
   - ``sample_support``, CSR with one row per generated token: sorted distinct ids of the
     vocabulary, set sizes like top-p 0.9's kept sets (log-normal, median
     ``--support-median`` 30, sigma 1.5, rounded, clipped to [1, ``--support-max`` 4096]:
     mean ~90; support_replay.py's sets).

   The batch goes to another process four ways, each checked once (unmeasured) to rebuild
   the batch exactly (CRC32 of every array):

   - *packed* (ours): encode = ``to_arrays()`` + ``pickle.dumps(protocol=5,
     buffer_callback=...)`` (arrays out of band: no copy); transfer = the pickle header
     and every raw buffer gathered into ``sendmsg`` calls over a Unix socket pair and
     scattered by ``recvmsg_into`` straight into a preallocated arena of a spawned
     receiver (64-byte aligned slots); decode = ``pickle.loads(header, buffers=<views of
     the arena>)`` (no copy, which the receiver checks) + ``RolloutBatch.from_arrays``
     (with its ``validate``);
   - *pickle5* (baseline): the same ``to_arrays()`` pickled with protocol 5 and
     out-of-band buffers, sent the way ``multiprocessing`` offers: a ``Pipe()``,
     ``send_bytes`` of the header and of every buffer, ``recv_bytes`` of each in a
     spawned process (a new bytes object each), ``pickle.loads(head, buffers=...)`` +
     ``from_arrays``;
   - *ray* (baseline): ``ray.put`` of the same ``to_arrays()`` dict (encode: Ray's
     pickle 5, the buffers copied once into the node's shared-memory object store), the
     ``ObjectRef`` passed to a Ray actor that ``ray.get``s it (read-only views of the
     store: no copy, checked) and calls ``from_arrays`` (decode = both); transfer = the
     actor call's round trip minus that decode. This is the path the ``ray`` launcher
     takes (``ray.put(dict(batch.to_arrays()))``). Ray's start (``ray_start_s``) is not
     counted;
   - *naive* (baseline): the batch as per-token Python lists (``routed_experts`` nested
     ``[token][layer][k]``, ``sample_support`` a list of lists, the other arrays flat
     lists); encode = ``json.dumps`` + UTF-8; the packed path's socket and arena; decode
     = UTF-8 + ``json.loads`` + numpy rebuilt (``np.asarray`` of the nested lists, the CSR
     from the row lengths and ``np.fromiter`` over the rows) + ``RolloutBatch(...)``.
     Building the lists from numpy is *not* counted (a naive engine would hold them
     already): the baseline is favoured. It is far too slow for the whole batch, so it
     runs on the first ``--naive-sequences`` sequences (``batch.select``) and is compared
     **per token**; its full-batch seconds and bytes are extrapolated and labelled so.
     The packed path also runs on that slice (``naive_same_slice`` ratios).

   Transfer time = from the first byte sent to the receiver's reply, minus the receiver's
   decode time (the reply is ~100 bytes).

2. **One RL step's generation on a tiny MoE**: the ``kimi`` family's ``tiny-kimi``
   (DeepSeek-V3: 2 MoE layers of 8 experts, top-2, vocab 13) on the embedded engine,
   ``--engine-prompts`` digit prompts x ``--engine-n`` samples, top-p 0.9, at most
   ``--engine-max-new`` new tokens. Interleaved per round: ``generate`` with routing
   capture and support sets, with either alone, and with neither (same seed), then
   the batch with both, just generated, sent to the receiver packed (with and without
   its side channels) and naive. Reported: the transports' time as a fraction of the
   generate time (a step also trains, so their share of the whole step is smaller),
   and what capture costs generate.

Every ratio is the median of per-round ratios (baseline / packed: > 1 = packed faster),
runs interleaved (A B C D ..., then ... D C B A), ``--repeats`` rounds after the
warm-up. ``other_cores_per_round`` is how many cores other processes used meanwhile
(``/proc/stat`` minus this process and all its descendants: the receivers and Ray's
daemons and workers): the machine is shared, absolute seconds move, ratios much less.
The engine runs with ``--threads 1`` by default: the tiny model gains little from 2
threads, and 2 threads slow down several-fold whenever another process takes a core of
a 2-core machine.

JSON keys: ``synthetic.bytes`` (on the wire, per token and per side channel),
``synthetic.packed`` / ``pickle5`` / ``ray`` / ``packed_same_slice`` / ``naive`` (median
seconds per stage, microseconds per token; ``naive.extrapolated_full_batch_s``),
``synthetic.ratio_vs_packed`` (per stage and in total, per baseline),
``ratio_vs_packed_total_per_round``, ``zero_copy_decode``, ``ray_decode_read_only_views``;
``engine.generate_s``, ``engine.ratio_generate_vs_plain`` (the cost of capture),
``engine.fraction_of_generate``. ``--quick`` (4 x 128 tokens, 4 layers, 2 rounds, 4 x 2
engine sequences; ~15 s, most of it importing torch and starting Ray) is the smoke test;
``--no-engine`` skips part 2.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import multiprocessing
import os
import pathlib
import pickle
import platform
import socket
import statistics
import struct
import sys
import time
import zlib
from typing import Any, Callable

import numpy as np

from skyrl_host.rollout import CSR, RolloutBatch

PACKED, NAIVE, STOP = 1, 2, 3
ALIGN = 64
SOCKET_BUFFER = 4 << 20  # SO_SNDBUF / SO_RCVBUF asked for (the kernel may cap it)
DENSE = (
    "cu_seqlens", "tokens", "logprobs", "loss_mask", "prompt_lens", "group_ids", "versions", "truncated", "rewards",
)
DTYPES = {
    "cu_seqlens": np.int64, "tokens": np.int32, "logprobs": np.float32, "loss_mask": np.uint8,
    "prompt_lens": np.int32, "group_ids": np.int64, "versions": np.int64, "truncated": np.bool_,
    "rewards": np.float32,
}


# -- the wire ------------------------------------------------------------------


IOV_MAX = 512  # buffers per sendmsg / recvmsg_into call (Linux allows 1024)


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` less their first ``n`` bytes (after a partial send or receive)."""
    i = 0
    while i < len(views) and n >= views[i].nbytes:
        n -= views[i].nbytes
        i += 1
    views = views[i:]
    if n:
        views[0] = views[0][n:]
    return views


def send_all(sock: socket.socket, buffers: list[Any]) -> int:
    """Gather-send: every buffer in as few ``sendmsg`` calls as the kernel allows,
    nothing copied in user space. Returns the bytes sent."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
    total = sum(v.nbytes for v in views)
    while views:
        views = _advance(views, sock.sendmsg(views[:IOV_MAX]))
    return total


def recv_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Scatter-receive into ``views`` (preallocated memory), in as few calls as arrive."""
    views = [v for v in views if v.nbytes]
    while views:
        n = sock.recvmsg_into(views[:IOV_MAX])[0]
        if n == 0:
            raise EOFError("the other process closed the socket")
        views = _advance(views, n)


def recv_small(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_all(sock, [memoryview(buf)])
    return bytes(buf)


def send_frames(sock: socket.socket, kind: int, frames: list[Any], check: bool = False) -> int:
    """One message: a header (its length, then kind, check flag, frame count and sizes)
    followed by the frames as they are, all in one gather-send. Returns the bytes sent."""
    views = [memoryview(f).cast("B") for f in frames]
    head = struct.pack(f"<IIB{len(views)}Q", kind, len(views), int(check), *(v.nbytes for v in views))
    return send_all(sock, [struct.pack("<I", len(head)) + head, *views])


# -- the two encodings ---------------------------------------------------------


def encode_packed(batch: RolloutBatch) -> list[Any]:
    """[pickle header, raw buffer, ...]: the arrays travel out of band, uncopied."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(dict(batch.to_arrays()), protocol=5, buffer_callback=buffers.append)
    return [head] + [b.raw() for b in buffers]


def decode_packed(frames: list[memoryview]) -> RolloutBatch:
    return RolloutBatch.from_arrays(pickle.loads(frames[0], buffers=frames[1:]))


def naive_lists(batch: RolloutBatch) -> dict[str, Any]:
    """The batch as a naive engine would hold it: Python lists, side channels per token."""
    out: dict[str, Any] = {name: getattr(batch, name).tolist() for name in DENSE}
    side: dict[str, Any] = {}
    for name, ch in batch.side_channels.items():
        if isinstance(ch, CSR):
            values, offsets = ch.values.tolist(), ch.offsets.tolist()
            side[name] = {"csr": [values[offsets[i] : offsets[i + 1]] for i in range(ch.n_rows)]}
        else:
            side[name] = {"dense": ch.tolist(), "dtype": ch.dtype.str, "row_shape": list(ch.shape[1:])}
    out["side_channels"] = side
    return out


def encode_naive(lists: dict[str, Any]) -> list[Any]:
    return [json.dumps(lists).encode("utf-8")]


def decode_naive(frames: list[memoryview]) -> RolloutBatch:
    obj = json.loads(str(frames[0], "utf-8"))
    side: dict[str, Any] = {}
    for name, ch in obj.pop("side_channels").items():
        if "csr" in ch:
            rows = ch["csr"]
            offsets = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum([len(r) for r in rows], out=offsets[1:])
            values = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int32, count=int(offsets[-1]))
            side[name] = CSR(offsets, values)
        else:
            arr = np.asarray(ch["dense"], dtype=np.dtype(ch["dtype"]))
            side[name] = arr.reshape((len(ch["dense"]), *ch["row_shape"]))
    batch = RolloutBatch(**{k: np.asarray(obj[k], dtype=DTYPES[k]) for k in DENSE}, side_channels=side)
    batch.validate()
    return batch


def digest(batch: RolloutBatch) -> dict[str, list[Any]]:
    """Name -> [dtype, shape, CRC32] of every array of the batch."""
    return {
        k: [v.dtype.str, list(v.shape), zlib.crc32(np.ascontiguousarray(v).view(np.uint8).reshape(-1))]
        for k, v in batch.to_arrays().items()
    }


# -- the receiver process ------------------------------------------------------


def receiver(sock: socket.socket, arena_bytes: int) -> None:
    """Receive messages into one preallocated arena (grown, untimed, if a message
    does not fit), decode them, reply with the decode time (and checks when asked)."""
    arena = np.ones(max(arena_bytes, ALIGN), dtype=np.uint8)  # pages touched now, not during a transfer
    while True:
        (hlen,) = struct.unpack("<I", recv_small(sock, 4))
        head = recv_small(sock, hlen)
        kind, count, check = struct.unpack_from("<IIB", head)
        if kind == STOP:
            return
        sizes = struct.unpack_from(f"<{count}Q", head, 9)
        slots, pos = [], 0
        for n in sizes:  # each frame in its own 64-byte aligned slot of the arena
            slots.append((pos, n))
            pos += -(-n // ALIGN) * ALIGN
        if pos > arena.nbytes:
            arena = np.ones(pos, dtype=np.uint8)
        mv = memoryview(arena)
        frames = [mv[p : p + n] for p, n in slots]
        recv_all(sock, frames)
        t0 = time.perf_counter()
        batch = decode_packed(frames) if kind == PACKED else decode_naive(frames)
        decode_s = time.perf_counter() - t0
        reply: dict[str, Any] = {"decode_s": decode_s}
        if check:
            lo, hi = arena.ctypes.data, arena.ctypes.data + arena.nbytes
            arrays = batch.to_arrays()
            reply["digest"] = digest(batch)
            reply["in_arena"] = {k: bool(lo <= v.ctypes.data < hi or v.nbytes == 0) for k, v in arrays.items()}
        data = json.dumps(reply).encode()
        send_all(sock, [struct.pack("<I", len(data)) + data])


class Receiver:
    def __init__(self, arena_bytes: int):
        ctx = multiprocessing.get_context("spawn")  # a clean child: no torch threads inherited
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for s in (self.sock, theirs):
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                s.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        self.proc = ctx.Process(target=receiver, args=(theirs, arena_bytes), daemon=True)
        self.proc.start()
        theirs.close()

    def roundtrip(self, kind: int, encode: Callable[[], list[Any]], check: bool = False) -> dict[str, Any]:
        """Encode (here), send, let the receiver decode; the three times and the bytes."""
        t0 = time.perf_counter()
        frames = encode()
        t1 = time.perf_counter()
        wire = send_frames(self.sock, kind, frames, check)
        first = self.sock.recv(4096)  # the reply: its length, then JSON (usually in one piece)
        t2 = time.perf_counter()
        while len(first) < 4:
            first += recv_small(self.sock, 4 - len(first))
        (n,) = struct.unpack_from("<I", first)
        body = first[4:]
        reply = json.loads(body + (recv_small(self.sock, n - len(body)) if n > len(body) else b""))
        decode_s = reply.pop("decode_s")
        return {"encode": t1 - t0, "transfer": t2 - t1 - decode_s, "decode": decode_s, "bytes": wire, **reply}

    def close(self) -> None:
        send_frames(self.sock, STOP, [])
        self.proc.join(10)
        self.sock.close()


def pipe_receiver(conn: Any) -> None:
    """The pickle-5 baseline's receiver: what a user writes with ``multiprocessing``: a
    control message (buffer count, check flag), the pickle header, then every out-of-band
    buffer as its own ``recv_bytes`` (each a new bytes object); decode = ``pickle.loads(head,
    buffers=...)`` + ``RolloutBatch.from_arrays``; replies with the decode time."""
    while True:
        count, check = struct.unpack("<iB", conn.recv_bytes())
        if count < 0:
            return
        head = conn.recv_bytes()
        buffers = [conn.recv_bytes() for _ in range(count)]
        t0 = time.perf_counter()
        batch = RolloutBatch.from_arrays(pickle.loads(head, buffers=buffers))
        reply: dict[str, Any] = {"decode_s": time.perf_counter() - t0}
        if check:
            reply["digest"] = digest(batch)
        conn.send_bytes(json.dumps(reply).encode())


class PipeReceiver:
    """pickle protocol 5 with out-of-band buffers over a ``multiprocessing.Pipe`` (a Unix
    socket pair), ``send_bytes`` / ``recv_bytes``, to a spawned process."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=pipe_receiver, args=(theirs,), daemon=True)
        self.proc.start()
        theirs.close()

    def roundtrip(self, batch: RolloutBatch, check: bool = False) -> dict[str, Any]:
        t0 = time.perf_counter()
        buffers: list[pickle.PickleBuffer] = []
        head = pickle.dumps(dict(batch.to_arrays()), protocol=5, buffer_callback=buffers.append)
        raws = [b.raw() for b in buffers]
        t1 = time.perf_counter()
        self.conn.send_bytes(struct.pack("<iB", len(raws), int(check)))
        self.conn.send_bytes(head)
        for r in raws:
            self.conn.send_bytes(r)
        reply = json.loads(self.conn.recv_bytes())
        t2 = time.perf_counter()
        decode_s = reply.pop("decode_s")
        wire = 5 + len(head) + sum(r.nbytes for r in raws) + 4 * (2 + len(raws))
        return {"encode": t1 - t0, "transfer": t2 - t1 - decode_s, "decode": decode_s, "bytes": wire, **reply}

    def close(self) -> None:
        self.conn.send_bytes(struct.pack("<iB", -1, 0))
        self.proc.join(10)
        self.conn.close()


class RayReceiver:
    """Ray's object store: ``ray.put`` of the same arrays in this process (encode: pickle 5,
    the buffers copied once into the node's shared-memory store), the ``ObjectRef`` handed
    to an actor (another process), which ``ray.get``s it (numpy arrays come back as
    read-only views of the store: no copy) and rebuilds the batch (decode = ``ray.get`` +
    ``RolloutBatch.from_arrays``); transfer = the actor call's round trip minus its decode."""

    def __init__(self, store_bytes: int) -> None:
        import ray

        self.ray = ray
        ray.init(num_cpus=1, object_store_memory=store_bytes, include_dashboard=False,
                 log_to_driver=False, logging_level="ERROR", configure_logging=False)

        @ray.remote(num_cpus=1)
        class Consumer:
            def pid(self) -> int:
                return os.getpid()

            def consume(self, refs: list[Any], check: bool) -> dict[str, Any]:
                import ray as ray_

                t0 = time.perf_counter()
                arrays = ray_.get(refs[0])
                t1 = time.perf_counter()
                batch = RolloutBatch.from_arrays(arrays)
                reply: dict[str, Any] = {"decode_s": time.perf_counter() - t0, "get_s": t1 - t0}
                if check:
                    reply["digest"] = digest(batch)
                    reply["read_only_views"] = all(not v.flags.writeable or v.nbytes == 0 for v in arrays.values())
                return reply

        self.actor = Consumer.remote()
        self.actor_pid = ray.get(self.actor.pid.remote())

    def roundtrip(self, batch: RolloutBatch, check: bool = False) -> dict[str, Any]:
        t0 = time.perf_counter()
        ref = self.ray.put(dict(batch.to_arrays()))
        t1 = time.perf_counter()
        reply = self.ray.get(self.actor.consume.remote([ref], check))  # [ref]: the actor gets it itself
        t2 = time.perf_counter()
        del ref
        decode_s = reply.pop("decode_s")
        wire = sum(a.nbytes for a in batch.to_arrays().values())  # the buffers written to the store
        return {"encode": t1 - t0, "transfer": t2 - t1 - decode_s, "decode": decode_s, "bytes": wire, **reply}

    def close(self) -> None:
        self.ray.shutdown()


# -- measurement helpers ---------------------------------------------------------


class CpuMeter:
    """Cores other processes (and steal time) took, from /proc/stat minus the CPU time of
    this process and all its descendants (the receivers, Ray's daemons and workers); None
    where /proc/stat cannot be read."""

    tick = os.sysconf("SC_CLK_TCK")

    def __init__(self, child_pid: int | None = None):
        self.child = child_pid  # kept for callers; every descendant counts anyway

    def _own(self) -> float:
        t = os.times()
        own = t.user + t.system
        parent, cpu = {}, {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                parent[int(d)] = int(fields[1])
                cpu[int(d)] = (int(fields[11]) + int(fields[12])) / self.tick
            except (OSError, IndexError, ValueError):
                pass
        me = os.getpid()
        for pid in cpu:
            q, seen = parent.get(pid), 0
            while q and q != me and seen < 64:
                q, seen = parent.get(q), seen + 1
            if q == me and pid != me:
                own += cpu[pid]
        return own

    def sample(self) -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
        except OSError:
            return None
        return (sum(v) - v[3] - v[4]) / self.tick, self._own(), time.perf_counter()

    @staticmethod
    def others(a: Any, b: Any) -> float | None:
        if a is None or b is None or b[2] <= a[2]:
            return None
        return round(max(0.0, ((b[0] - a[0]) - (b[1] - a[1])) / (b[2] - a[2])), 2)


T_START = time.perf_counter()


def log(msg: str) -> None:
    """Progress on stderr (stdout carries the JSON only)."""
    print(f"[side_channels {time.perf_counter() - T_START:6.1f}s] {msg}", file=sys.stderr, flush=True)


def med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


STAGES = ("encode", "transfer", "decode")


def stage_summary(runs: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {f"{s}_s": sig(med([r[s] for r in runs])) for s in STAGES}
    out["total_s"] = sig(med([sum(r[s] for s in STAGES) for r in runs]))
    out["us_per_token"] = {s: sig(med([r[s] for r in runs]) / tokens * 1e6) for s in STAGES}
    out["us_per_token"]["total"] = sig(out["total_s"] / tokens * 1e6)
    return out


def ratio_summary(a: list[dict[str, Any]], b: list[dict[str, Any]], ta: int, tb: int) -> dict[str, float]:
    """Medians of the per-round ratios of per-token times, a / b."""
    out = {}
    for s in STAGES + ("total",):
        def cost(r: dict[str, Any], t: int) -> float:
            return (sum(r[x] for x in STAGES) if s == "total" else r[s]) / t

        out[s] = sig(med([cost(x, ta) / cost(y, tb) for x, y in zip(a, b)]), 3)
    return out


def git_state() -> dict[str, Any]:
    import subprocess

    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        def git(*cmd: str) -> str:
            return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, check=True).stdout

        commit = git("rev-parse", "--short", "HEAD").strip()
        modified = git("status", "--porcelain", "--untracked-files=no").split()[1::2]
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {"commit": commit, "modified_files": modified}


# -- part 1: the synthetic batch -----------------------------------------------


def synthetic_batch(args: argparse.Namespace, rng: np.random.Generator) -> RolloutBatch:
    S, L = args.sequences, args.seq_len
    T = S * L
    prompt_lens = rng.integers(max(1, L // 8), max(2, L // 4 + 1), S).astype(np.int32)
    cu = np.arange(S + 1, dtype=np.int64) * L
    within = np.arange(T, dtype=np.int64) - np.repeat(cu[:-1], L)
    loss_mask = (within >= np.repeat(prompt_lens, L)).astype(np.uint8)
    n_gen = int(loss_mask.sum())
    logprobs = np.where(loss_mask == 1, -rng.exponential(1.0, T), 0.0).astype(np.float32)

    # routed_experts: top_k distinct experts per (token, layer): base + increasing offsets, mod E.
    E, K, layers = args.experts, args.top_k, args.layers
    dtype = np.uint8 if E <= 256 else np.uint16
    routed = np.empty((T, layers, K), dtype=dtype)
    max_gap = max(1, (E - 1) // max(1, K - 1))
    for t0 in range(0, T, 16384):
        t1 = min(T, t0 + 16384)
        gaps = rng.integers(1, max_gap + 1, (t1 - t0, layers, K), dtype=np.int32)
        gaps[..., 0] = 0
        base = rng.integers(0, E, (t1 - t0, layers, 1), dtype=np.int32)
        routed[t0:t1] = (base + np.cumsum(gaps, axis=-1)) % E

    # sample_support: one row per generated token of top-p 0.9-like kept-set sizes (log-normal,
    # median `--support-median`, sigma `--support-sigma`, rounded, clipped to [1, --support-max];
    # support_replay.py's sets), sorted distinct ids: one id drawn in each of `len` equal strata
    # of the vocabulary.
    V = args.vocab
    mu = np.log(args.support_median)
    lens = np.clip(np.rint(np.exp(rng.normal(mu, args.support_sigma, n_gen))), 1, min(args.support_max, V))
    lens = lens.astype(np.int64)
    offsets = np.zeros(n_gen + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    values = np.empty(int(offsets[-1]), dtype=np.int32)
    for r0 in range(0, n_gen, 32768):  # in chunks of rows, to bound the int64 temporaries
        r1 = min(n_gen, r0 + 32768)
        a, b = int(offsets[r0]), int(offsets[r1])
        rl = np.repeat(lens[r0:r1], lens[r0:r1])
        j = np.arange(b - a, dtype=np.int64) - np.repeat(offsets[r0:r1] - a, lens[r0:r1])
        values[a:b] = j * V // rl + (rng.random(b - a) * (V // rl)).astype(np.int64)

    batch = RolloutBatch(
        tokens=rng.integers(0, V, T, dtype=np.int32),
        cu_seqlens=cu,
        prompt_lens=prompt_lens,
        logprobs=logprobs,
        loss_mask=loss_mask,
        group_ids=np.arange(S, dtype=np.int64) // 8,
        versions=np.zeros(S, dtype=np.int64),
        truncated=rng.random(S) < 0.1,
        rewards=rng.random(S).astype(np.float32),
        side_channels={"routed_experts": routed, "sample_support": CSR(offsets, values)},
    )
    batch.validate()
    return batch


def check_roundtrip(rx: Receiver, kind: int, encode: Callable[[], list[Any]], batch: RolloutBatch, what: str) -> bool:
    """One unmeasured round trip: the receiver's rebuild must equal ``batch``; True when
    every decoded array lies in the receive arena (no copy)."""
    r = rx.roundtrip(kind, encode, check=True)
    if r["digest"] != digest(batch):
        raise SystemExit(f"side_channels.py: the {what} path did not rebuild the batch exactly")
    return all(r["in_arena"].values())


BASELINES = ("pickle5", "ray", "naive")


def part_synthetic(args: argparse.Namespace, rx: Receiver, batch: RolloutBatch) -> dict[str, Any]:
    T = batch.n_tokens
    small = batch.select(np.arange(min(args.naive_sequences, batch.n_sequences)))
    Ts = small.n_tokens
    t0 = time.perf_counter()
    lists = naive_lists(small)
    tolist_s = time.perf_counter() - t0

    pipe = PipeReceiver()
    ray_rx = None
    try:
        log("synthetic: starting Ray")
        t0 = time.perf_counter()
        store = max(256 << 20, 4 * sum(a.nbytes for a in batch.to_arrays().values()))
        ray_rx = RayReceiver(store)
        ray_start_s = time.perf_counter() - t0
        log(f"synthetic: Ray up in {ray_start_s:.1f} s")
        runs: dict[str, Callable[[], dict[str, Any]]] = {
            "packed": lambda: rx.roundtrip(PACKED, lambda: encode_packed(batch)),
            "pickle5": lambda: pipe.roundtrip(batch),
            "ray": lambda: ray_rx.roundtrip(batch),
            "naive_slice": lambda: rx.roundtrip(NAIVE, lambda: encode_naive(lists)),
            "packed_slice": lambda: rx.roundtrip(PACKED, lambda: encode_packed(small)),
        }
        # Warm-up and checks (not measured): every path rebuilds the batch exactly.
        zero_copy = check_roundtrip(rx, PACKED, lambda: encode_packed(batch), batch, "packed")
        zero_copy_slice = check_roundtrip(rx, PACKED, lambda: encode_packed(small), small, "packed (slice)")
        naive_in_arena = check_roundtrip(rx, NAIVE, lambda: encode_naive(lists), small, "naive")
        want = digest(batch)
        if pipe.roundtrip(batch, check=True)["digest"] != want:
            raise SystemExit("side_channels.py: the pickle-5 path did not rebuild the batch exactly")
        r = ray_rx.roundtrip(batch, check=True)
        if r["digest"] != want:
            raise SystemExit("side_channels.py: the Ray path did not rebuild the batch exactly")
        ray_views = r["read_only_views"]
        for _ in range(2):  # more warm-up: Ray's first calls and the pipe's first big reads
            for f in runs.values():
                f()

        log(f"synthetic: checked; {args.repeats} rounds")
        meter = CpuMeter()
        res: dict[str, list[dict[str, Any]]] = {k: [] for k in runs}
        others = []
        for i in range(args.repeats):
            a = meter.sample()
            for name in list(runs) if i % 2 == 0 else list(reversed(runs)):  # A B C ..., then ... C B A
                res[name].append(runs[name]())
            others.append(meter.others(a, meter.sample()))
    finally:
        pipe.close()
        if ray_rx is not None:
            ray_rx.close()

    packed_bytes = res["packed"][0]["bytes"]
    naive_bytes = res["naive_slice"][0]["bytes"]
    slice_packed_bytes = res["packed_slice"][0]["bytes"]
    routed = batch.side_channels["routed_experts"]
    support = batch.side_channels["sample_support"]
    naive_channel_bytes = {
        k: len(json.dumps(v).encode()) for k, v in lists["side_channels"].items()
    }
    packed_channel_bytes = {
        "routed_experts": int(routed.nbytes),
        "sample_support": int(support.offsets.nbytes + support.values.nbytes),
    }
    naive = stage_summary(res["naive_slice"], Ts)
    naive["extrapolated_full_batch_s"] = {
        s: sig(naive["us_per_token"][s] * T / 1e6) for s in STAGES + ("total",)
    }
    naive["tolist_s_not_counted"] = sig(tolist_s)
    summaries = {}
    for name in ("packed", "pickle5", "ray"):
        summ = stage_summary(res[name], T)
        summ["throughput_GB_per_s"] = sig(res[name][0]["bytes"] / summ["total_s"] / 1e9, 3)
        summ["total_s_range"] = [sig(min(sum(r[x] for x in STAGES) for r in res[name])),
                                 sig(max(sum(r[x] for x in STAGES) for r in res[name]))]
        summaries[name] = summ
    summaries["packed"]["transfer_GB_per_s"] = sig(packed_bytes / summaries["packed"]["transfer_s"] / 1e9, 3)
    summaries["ray"]["ray_get_s"] = sig(med([r["get_s"] for r in res["ray"]]))
    return {
        "batch": {
            "sequences": batch.n_sequences,
            "tokens": T,
            "generated_tokens": int(support.n_rows),
            "routed_experts": {"shape": list(routed.shape), "dtype": routed.dtype.name},
            "sample_support": {
                "rows": int(support.n_rows),
                "ids": int(len(support.values)),
                "ids_per_row_mean": sig(len(support.values) / max(1, support.n_rows), 3),
                "ids_per_row_median": float(np.median(np.diff(support.offsets))),
                "vocab": args.vocab,
            },
        },
        "naive_measured_on": {
            "sequences": small.n_sequences,
            "tokens": Ts,
            "note": "naive path timed on this slice only; full-batch naive figures are per-token extrapolations",
        },
        "bytes": {
            "packed": packed_bytes,
            "pickle5": res["pickle5"][0]["bytes"],
            "ray_buffers": res["ray"][0]["bytes"],
            "packed_side_channels": packed_channel_bytes,
            "packed_per_token": sig(packed_bytes / T),
            "naive_per_token": sig(naive_bytes / Ts),
            "naive_full_batch_extrapolated": int(naive_bytes / Ts * T),
            "naive_side_channels_per_token": {k: sig(v / Ts) for k, v in naive_channel_bytes.items()},
            "packed_side_channels_per_token": {k: sig(v / T) for k, v in packed_channel_bytes.items()},
            "ratio_naive_vs_packed_per_token": sig((naive_bytes / Ts) / (packed_bytes / T), 3),
            "ratio_naive_vs_packed_same_slice": sig(naive_bytes / slice_packed_bytes, 3),
        },
        "packed": summaries["packed"],
        "pickle5": summaries["pickle5"],
        "ray": summaries["ray"],
        "ray_start_s": sig(ray_start_s, 3),
        "packed_same_slice": stage_summary(res["packed_slice"], Ts),
        "naive": naive,
        "ratio_vs_packed": {
            "pickle5": ratio_summary(res["pickle5"], res["packed"], T, T),
            "ray": ratio_summary(res["ray"], res["packed"], T, T),
            "naive": ratio_summary(res["naive_slice"], res["packed"], Ts, T),
            "naive_same_slice": ratio_summary(res["naive_slice"], res["packed_slice"], Ts, Ts),
        },
        "ratio_vs_packed_total_per_round": {
            k: [sig(sum(a[x] for x in STAGES) / sum(b[x] for x in STAGES), 3) for a, b in zip(res[k], res["packed"])]
            for k in ("pickle5", "ray")
        },
        "ratio_note": "baseline / packed: medians of per-round ratios of seconds per token (naive on the slice, "
        "the others on the whole batch; naive_same_slice: packed on the slice too); > 1 = packed faster",
        "zero_copy_decode": zero_copy and zero_copy_slice,
        "ray_decode_read_only_views": ray_views,
        "naive_decode_copies": not naive_in_arena,
        "roundtrip_checked": True,
        "other_cores_per_round": others,
    }


# -- part 2: a tiny MoE's generation -------------------------------------------


def part_engine(args: argparse.Namespace, rx: Receiver) -> dict[str, Any]:
    import torch
    import transformers

    from skyrl_engines.embedded import Embedded, EmbeddedConfig
    from skyrl_models.kimi import KimiConfig, make_family
    from skyrl_samplers.processing import build_sampler
    from skyrl_samplers.top_p import TopPConfig

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    log("engine: torch imported")
    loaded = make_family(KimiConfig(preset="tiny-kimi")).load(alphabet="0123456789", seed=0)
    capture = Embedded(EmbeddedConfig(return_routed_experts=True, threads=args.threads))
    capture.start(loaded)
    plain = Embedded(EmbeddedConfig(threads=args.threads))
    plain.start(loaded)
    with_support = build_sampler(TopPConfig(top_p=0.9, return_support=True))
    without = build_sampler(TopPConfig(top_p=0.9))
    rng = np.random.default_rng(1)
    texts = ["".join(map(str, rng.integers(0, 10, int(rng.integers(4, 13))))) for _ in range(args.engine_prompts)]
    prompts = [list(loaded.tokenizer.encode(t, add_special_tokens=False)) for t in texts]

    def gen(engine: Any, sampler: Any, seed: int) -> tuple[RolloutBatch, float]:
        t0 = time.perf_counter()
        b = engine.generate(prompts, n=args.engine_n, sampler=sampler, max_new_tokens=args.engine_max_new, seed=seed)
        return b, time.perf_counter() - t0

    def bare(b: RolloutBatch) -> RolloutBatch:
        return RolloutBatch(**{k: getattr(b, k) for k in DENSE})

    # Warm-up and checks.
    log("engine: model loaded, engines started")
    batch, _ = gen(capture, with_support, 10**6)
    gen(capture, without, 10**6)
    gen(plain, with_support, 10**6)
    gen(plain, without, 10**6)
    zero_copy = check_roundtrip(rx, PACKED, lambda: encode_packed(batch), batch, "packed (engine batch)")
    check_roundtrip(rx, PACKED, lambda: encode_packed(bare(batch)), bare(batch), "packed (no side channels)")
    lists = naive_lists(batch)
    check_roundtrip(rx, NAIVE, lambda: encode_naive(lists), batch, "naive (engine batch)")

    log(f"engine: warmed up and checked; {args.repeats} rounds")
    meter = CpuMeter(rx.proc.pid)
    gens = {  # name: (engine, sampler)
        "capture_and_support": (capture, with_support),
        "capture_only": (capture, without),
        "support_only": (plain, with_support),
        "plain": (plain, without),
    }
    rec: dict[str, list[Any]] = {k: [] for k in ("packed", "packed_bare", "naive")}
    gen_s: dict[str, list[float]] = {k: [] for k in gens}
    gen_count: dict[str, list[int]] = {k: [] for k in gens}
    tokens, others = [], []
    for i in range(args.repeats):
        a = meter.sample()
        for kind in list(gens) if i % 2 == 0 else list(reversed(gens)):
            b, dt = gen(*gens[kind], i)
            gen_s[kind].append(dt)
            gen_count[kind].append(int(b.loss_mask.sum()))
            if kind == "capture_and_support":
                batch = b
        lists = naive_lists(batch)
        sends = {
            "packed": lambda: rx.roundtrip(PACKED, lambda: encode_packed(batch)),
            "packed_bare": lambda: rx.roundtrip(PACKED, lambda: encode_packed(bare(batch))),
            "naive": lambda: rx.roundtrip(NAIVE, lambda: encode_naive(lists)),
        }
        for name in list(sends) if i % 2 == 0 else list(reversed(sends)):
            rec[name].append(sends[name]())
        tokens.append(batch.n_tokens)
        others.append(meter.others(a, meter.sample()))

    def total(r: dict[str, Any]) -> float:
        return sum(r[s] for s in STAGES)

    gc = gen_s["capture_and_support"]
    routed = batch.side_channels["routed_experts"]
    support = batch.side_channels["sample_support"]
    return {
        "model": "kimi preset tiny-kimi (DeepSeek-V3: hidden 64, 3 layers, 2 MoE layers x 8 experts, top-2, vocab 13)",
        "prompts": args.engine_prompts,
        "n": args.engine_n,
        "max_new_tokens": args.engine_max_new,
        "sampler": "top_p 0.9",
        "tokens_per_batch_median": med(tokens),
        "generated_tokens_per_batch_median": {k: med(v) for k, v in gen_count.items()},
        "side_channels_last_batch": {
            "routed_experts": {"shape": list(routed.shape), "dtype": routed.dtype.name},
            "sample_support_ids_per_row_mean": sig(len(support.values) / max(1, support.n_rows), 3),
        },
        "bytes": {
            "packed": rec["packed"][-1]["bytes"],
            "packed_without_side_channels": rec["packed_bare"][-1]["bytes"],
            "naive": rec["naive"][-1]["bytes"],
        },
        "generate_s": {k: sig(med(v)) for k, v in gen_s.items()},
        "ratio_generate_vs_plain": {
            k: sig(med([x / y for x, y in zip(v, gen_s["plain"])]), 3) for k, v in gen_s.items() if k != "plain"
        },
        "packed": stage_summary(rec["packed"], int(med(tokens))),
        "packed_without_side_channels_total_s": sig(med([total(r) for r in rec["packed_bare"]])),
        "naive": stage_summary(rec["naive"], int(med(tokens))),
        "fraction_of_generate": {
            "packed": sig(med([total(r) / g for r, g in zip(rec["packed"], gc)]), 3),
            "packed_side_channels_only": sig(
                med([(total(r) - total(b)) / g for r, b, g in zip(rec["packed"], rec["packed_bare"], gc)]), 3
            ),
            "naive": sig(med([total(r) / g for r, g in zip(rec["naive"], gc)]), 3),
        },
        "fraction_note": "encode+transfer+decode of the whole batch (its side channels included) over the time of the "
        "generate call with capture + support that produced it; side_channels_only = with minus without them",
        "ratio_naive_vs_packed_total": sig(med([total(n) / total(p) for n, p in zip(rec["naive"], rec["packed"])]), 3),
        "zero_copy_decode": zero_copy,
        "other_cores_per_round": others,
    }


def preset_shape(name: str) -> dict[str, Any]:
    """A model preset's router shape, as ``skyrl models show NAME`` builds it: the family's
    transformers config on the meta device (no weights) and the family's own ``routers``
    (what routing capture records: one entry per MoE layer, dense layers excluded)."""
    import importlib

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from skyrl_models.commands import DEFAULT_ALPHABET, all_presets, hf_config

    transformers.logging.set_verbosity_error()
    presets = {p["name"]: p for p in all_presets()}
    if name not in presets:
        raise KeyError(name)
    fam = presets[name]["family"]
    cfg = hf_config(fam, name, presets[name]["weights"], DEFAULT_ALPHABET)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    mod = importlib.import_module(f"skyrl_models.{fam}")
    options_cls = getattr(mod, {"qwen": "QwenConfig", "glm": "GlmConfig", "kimi": "KimiConfig",
                                "nemotron": "NemotronConfig"}[fam])
    tiny = next(p["name"] for p in all_presets() if p["family"] == fam and p["weights"])
    routers = mod.make_family(options_cls(preset=tiny)).routers(model)  # routers() reads the model given
    if not routers:
        raise ValueError(f"preset {name!r} has no MoE router")
    return {
        "preset": name, "family": fam, "num_layers": cfg.num_hidden_layers, "moe_layers": len(routers),
        "top_k": max(r.top_k for r in routers), "experts": max(r.n_experts for r in routers),
        "vocab": cfg.vocab_size,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kimi-k2",
                    help="model preset whose routers size routed_experts (MoE layers x top-k of its experts) and "
                    "whose vocabulary sizes the support ids; 'none': --layers/--top-k/--experts/--vocab")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (prompt 1/8-1/4 of it)")
    ap.add_argument("--layers", type=int, help="MoE layers (default: the preset's; 48 with --preset none)")
    ap.add_argument("--top-k", type=int, help="experts per token (default: the preset's; 8)")
    ap.add_argument("--experts", type=int, help="routed experts (default: the preset's; 256)")
    ap.add_argument("--vocab", type=int, help="vocabulary (default: the preset's; 151936)")
    ap.add_argument("--support-median", type=float, default=30.0, help="median ids per support set (log-normal)")
    ap.add_argument("--support-sigma", type=float, default=1.5, help="sigma of the log-normal set sizes")
    ap.add_argument("--support-max", type=int, default=4096, help="largest support set")
    ap.add_argument("--naive-sequences", type=int, default=1, help="sequences the naive path is timed on")
    ap.add_argument("--repeats", type=int, default=15, help="measured rounds, after the warm-up")
    ap.add_argument("--engine-prompts", type=int, default=32)
    ap.add_argument("--engine-n", type=int, default=8)
    ap.add_argument("--engine-max-new", type=int, default=32)
    ap.add_argument(
        "--threads", type=int, default=1,
        help="torch threads of the engine part (1: the tiny model gains little from 2, and 2 threads slow down "
        "several-fold whenever another process takes a core of this 2-core machine)",
    )
    ap.add_argument("--no-engine", action="store_true", help="skip the tiny-MoE part")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a tiny run (smoke test): small batch, 2 rounds")
    args = ap.parse_args()
    shape: dict[str, Any] | None = None
    if args.preset != "none":
        try:
            shape = preset_shape(args.preset)
        except KeyError:
            ap.error(f"unknown model preset {args.preset!r} (see 'skyrl models list'), or --preset none")
        except ValueError as e:
            ap.error(str(e))
    defaults = shape or {"moe_layers": 48, "top_k": 8, "experts": 256, "vocab": 151936}
    args.layers = defaults["moe_layers"] if args.layers is None else args.layers
    args.top_k = defaults["top_k"] if args.top_k is None else args.top_k
    args.experts = defaults["experts"] if args.experts is None else args.experts
    args.vocab = defaults["vocab"] if args.vocab is None else args.vocab
    if args.quick:
        args.sequences, args.seq_len, args.layers = 4, 128, 4
        args.naive_sequences, args.repeats = 1, 2
        args.engine_prompts, args.engine_n, args.engine_max_new = 4, 2, 8
    if min(args.sequences, args.seq_len, args.layers, args.top_k, args.repeats, args.naive_sequences) < 1:
        ap.error("sizes, --naive-sequences and --repeats must be >= 1")
    if args.top_k > args.experts or args.experts > 65536:
        ap.error("need top_k <= experts <= 65536")
    if not (args.support_median >= 1 and args.support_sigma >= 0 and 1 <= args.support_max <= args.vocab):
        ap.error("need --support-median >= 1, --support-sigma >= 0, 1 <= --support-max <= vocab")

    git = git_state()
    t_start = time.perf_counter()
    batch = synthetic_batch(args, np.random.default_rng(args.seed))
    build_s = time.perf_counter() - t_start
    log(f"synthetic batch built ({batch.n_tokens} tokens)")
    arena = sum(-(-a.nbytes // ALIGN) * ALIGN for a in batch.to_arrays().values()) + (1 << 20)
    rx = Receiver(arena)
    try:
        synthetic = part_synthetic(args, rx, batch)
        del batch
        log("synthetic: done")
        engine = None if args.no_engine else part_engine(args, rx)
    finally:
        rx.close()

    versions = {"python": platform.python_version(), "numpy": np.__version__}
    if "torch" in sys.modules:
        versions["torch"] = sys.modules["torch"].__version__
        versions["transformers"] = sys.modules["transformers"].__version__
    out = {
        "benchmark": "side_channels",
        "date": datetime.date.today().isoformat(),
        "quick": args.quick,
        "config": {
            "sequences": args.sequences, "seq_len": args.seq_len, "layers": args.layers, "top_k": args.top_k,
            "experts": args.experts, "vocab": args.vocab, "preset": shape,
            "support_sizes": f"lognormal median {args.support_median:g} sigma {args.support_sigma:g}, "
            f"clipped [1, {args.support_max}]", "naive_sequences": args.naive_sequences,
            "repeats": args.repeats, "threads": args.threads, "seed": args.seed,
        },
        "transport": {
            "packed": "Unix socket pair to a spawned receiver process; sendmsg / recvmsg_into a preallocated arena",
            "pickle5": "multiprocessing.Pipe to a spawned process; pickle 5 out-of-band buffers, send_bytes/recv_bytes",
            "ray": "ray.put here, ray.get in a Ray actor (the node's shared-memory object store)",
            "naive": "per-token JSON lists over the packed path's socket",
        },
        "synthetic": synthetic,
        "engine": engine,
        "build_batch_s": round(build_s, 2),
        "wall_s": round(time.perf_counter() - t_start, 1),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "versions": versions,
        "git": git,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
