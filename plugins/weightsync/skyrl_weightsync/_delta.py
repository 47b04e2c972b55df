"""The ``delta`` transport's implementation: XOR deltas of the published bytes,
compressed and checksummed, on any fsspec URL (imports numpy, zstandard, xxhash,
fsspec; torch only to convert tensors).

Layout under the URL::

    LATEST                          the newest complete version: {"epoch": 1, "version": 12}, written last
    e001/v00000012/manifest.json    version 12: base version, and per tensor name, dtype,
                                    shape, sizes, payload file, checksums
    e001/v00000012/t00003.zst       one payload per changed tensor (unchanged: no file)

An **epoch** is one publisher process: a publisher that starts (a new run, or a resumed
one that publishes a version again) opens the next epoch with a keyframe, so version
numbers only need to grow within an epoch and a resumed run never overwrites what
receivers may be reading. Receivers follow ``LATEST`` into a new epoch from its keyframe.

A version is either a **keyframe** (``base`` null: every tensor's bytes, compressed) or
a **delta** on ``base = version - 1``: per changed tensor, the XOR of its new bytes
with the previously published ones. Sparse changes are stored as (gaps between
changed 16-bit words, XOR values); dense ones as the XOR bytes; both zstd-compressed.

Writers write the payloads, then the manifest, then ``LATEST`` (each a single small
object: atomic on object stores; a rename on local disk). A reader that sees ``LATEST =
v`` therefore finds every manifest and payload of ``v`` complete. A publisher killed
before ``LATEST`` leaves the previous version current; a publisher that restarts
without its previous bytes in memory starts with a keyframe.

A receiver applies a version only after every payload's checksum matched, and checks
each tensor's resulting bytes against the manifest; on any mismatch it undoes what it
applied (XOR is its own inverse) and raises, naming the version and the file: the
engine keeps its last complete version.

Speed (benchmarks/weight_sync.py): the sender reads each tensor's memory in place and
compares it with its copy of the last version a cache-sized chunk at a time, writing
back only the changed words (a failed publish XORs its payloads back out); payloads
are written by threads while the next tensors are encoded, and read by threads.
Big buffers are reused across versions: fresh ones cost page faults.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Mapping

import fsspec
import numpy as np
import xxhash
import zstandard

from skyrl_weightsync import weights_to_serve

FORMAT = 1
LATEST = "LATEST"
SPARSE_MAX_FRACTION = 0.2  # changed 16-bit words above this fraction: store the dense XOR
_CHUNK = 1 << 17  # 64-bit words the sender compares at a time (1 MiB: stays in cache)
_PIECE = 1 << 20  # changed words a receiver applies at a time
_INFLIGHT_BYTES = 256 << 20  # payload bytes a sender may have queued for writing


class DeltaError(RuntimeError):
    """A version cannot be applied; the receiver (and the engine) kept their last one."""


def version_dir(epoch: int, version: int) -> str:
    return f"e{epoch:03d}/v{version:08d}"


def _checksum(data: Any) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(data).cast("B") if not isinstance(data, bytes) else data)


def _words(buf: np.ndarray) -> np.ndarray:
    """A byte buffer as 16-bit words (bf16 / fp16 elements; fp32 as two words each)."""
    return buf.view(np.uint16)


def _scan(src: np.ndarray, last: np.ndarray, bufs: tuple[np.ndarray, np.ndarray, np.ndarray],
          limit: float) -> tuple[list[np.ndarray], list[np.ndarray], int] | None:
    """The 16-bit words where ``src`` and ``last`` (byte buffers of one even size) differ,
    as the sparse payload's gaps (uint32 pieces) and XOR values (uint16 pieces) and their
    count, with ``last`` updated to ``src`` in place; or None, ``last`` unchanged, when
    more than ``limit`` words differ or a gap does not fit 32 bits.

    Works a chunk of 64-bit words at a time (``bufs``: ``_CHUNK`` uint64, ``_CHUNK`` and
    ``_CHUNK // 8`` bool), so the XOR and the search for changed words stay in cache, and
    writes only the changed words to ``last``."""
    scratch, mask, mask8 = bufs
    n8 = src.size // 8
    gaps: list[np.ndarray] = []
    values: list[np.ndarray] = []
    count, prev = 0, -1  # changed words so far, and the position of the last one
    rare = True  # few changed 64-bit words: find them 8 at a time first

    def add(pos: np.ndarray, vals: np.ndarray) -> bool:
        nonlocal count, prev
        if count + pos.size > limit or int(pos[0]) - prev > 0xFFFFFFFF:
            _unscan(last, gaps, values)
            return False
        g = np.empty(pos.size, np.uint32)
        g[0] = int(pos[0]) - prev
        np.subtract(pos[1:], pos[:-1], out=g[1:], casting="unsafe")
        gaps.append(g)
        values.append(vals)
        count += pos.size
        prev = int(pos[-1])
        return True

    if n8:
        s64 = src[: n8 * 8].view(np.uint64)
        l64 = last[: n8 * 8].view(np.uint64)
        for o in range(0, n8, _CHUNK):
            s, l = s64[o:o + _CHUNK], l64[o:o + _CHUNK]
            m = s.size
            x = np.bitwise_xor(s, l, out=scratch[:m])
            changed = np.not_equal(x, 0, out=mask[:m])  # flatnonzero is ~2x faster on bool than on uint64
            if rare and m % 8 == 0:
                groups = changed.view(np.uint64)  # 8 flags a word
                hit = np.flatnonzero(np.not_equal(groups, 0, out=mask8[: m // 8]))
                sub = np.flatnonzero(groups[hit].view(np.bool_))
                hot = (hit[sub >> 3] << 3) | (sub & 7)
            else:
                hot = np.flatnonzero(changed)
            rare = hot.size < 0.06 * m
            if not hot.size:
                continue
            words = x[hot].view(np.uint16)  # the 4 16-bit words of each changed 64-bit word, in memory order
            lane = np.flatnonzero(words != 0)
            pos = (hot[lane >> 2] << 2) | (lane & 3)
            pos += 4 * o
            if not add(pos, words[lane]):
                return None
            l[hot] = s[hot]
    if n8 * 8 < src.size:  # the last 2, 4 or 6 bytes
        st, lt = _words(src[n8 * 8:]), _words(last[n8 * 8:])
        xt = np.bitwise_xor(st, lt)
        nz = np.flatnonzero(xt)
        if nz.size:
            if not add(nz + 4 * n8, xt[nz]):
                return None
            lt[nz] = st[nz]
    return gaps, values, count


def _unscan(last: np.ndarray, gaps: list[np.ndarray], values: list[np.ndarray]) -> None:
    """Undo what ``_scan`` wrote to ``last`` so far."""
    if gaps:
        positions = np.cumsum(np.concatenate(gaps), dtype=np.int64) - 1
        _words(last)[positions] ^= np.concatenate(values)


def _sparse_blob(gaps: list[np.ndarray], values: list[np.ndarray], count: int) -> np.ndarray:
    """The sparse payload before compression: count (uint64), gaps between the changed
    16-bit words' positions (uint32, the first from -1), XOR values (uint16), little-endian."""
    blob = np.empty(8 + 6 * count, dtype=np.uint8)
    blob[:8].view("<u8")[0] = count
    if count:
        np.concatenate(gaps, out=blob[8:8 + 4 * count].view("<u4"))
        np.concatenate(values, out=blob[8 + 4 * count:].view("<u2"))
    return blob


def _fill(decompressor: Any, payload: bytes, out: np.ndarray) -> bool:
    """Decompress ``payload`` straight into ``out``; True when it held exactly ``out.size``
    bytes (raises ``zstandard.ZstdError`` on a broken frame)."""
    view = memoryview(out).cast("B")
    got = 0
    with decompressor.stream_reader(payload) as reader:
        while got < len(view):
            n = reader.readinto(view[got:])
            if not n:
                break
            got += n
        extra = reader.read(1)
    return got == len(view) and not extra


def _sparse_raw(decompressor: Any, payload: bytes, scratch: Any) -> np.ndarray:
    """A sparse payload decompressed into ``scratch(size)`` (a reused buffer)."""
    size = zstandard.frame_content_size(payload)
    if size < 0:  # no size in the frame header
        return np.frombuffer(decompressor.decompress(payload), np.uint8)
    raw = scratch(size)
    if not _fill(decompressor, payload, raw):
        raise ValueError("malformed sparse payload")
    return raw


def _xor_sparse(buf: np.ndarray, raw: np.ndarray) -> None:
    """XOR a decompressed sparse payload into ``buf``, after checking it against ``buf``'s
    size (ValueError, ``buf`` untouched); positions are rebuilt ``_PIECE`` at a time, so
    the temporaries stay in cache."""
    count = int(raw[:8].view("<u8")[0]) if raw.size >= 8 else -1
    if count < 0 or raw.size != 8 + 6 * count:
        raise ValueError("malformed sparse payload")
    gaps = raw[8:8 + 4 * count].view("<u4")
    values = raw[8 + 4 * count:].view("<u2")
    if count and (int(gaps.min()) < 1 or int(gaps.sum(dtype=np.uint64)) - 1 >= buf.size // 2):
        raise ValueError("sparse payload positions out of range")
    words = _words(buf)
    positions = np.empty(min(count, _PIECE), np.int64)
    last = -1
    for a in range(0, count, _PIECE):
        g = gaps[a:a + _PIECE]
        pos = np.cumsum(g, dtype=np.int64, out=positions[: g.size])
        pos += last
        last = int(pos[-1])
        words[pos] ^= values[a:a + _PIECE]


def _to_bytes(tensor: Any, dtype: str, name: str = "") -> tuple[np.ndarray, str, tuple[int, ...]]:
    """A tensor's bytes in the wire dtype, contiguous: a view of the tensor's own memory
    when it is already a contiguous CPU tensor of that dtype (no copy: read it before
    the tensor changes), else of a converted copy. Only weights in a master dtype are
    converted: a precision's quantized payloads (e4m3, packed int4) and scales (named
    ``<weight>@<format>``) travel as they are."""
    import torch

    wire = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    t = tensor.detach()
    if t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) and "@" not in name:
        t = t.to(wire)
        name = dtype
    else:
        name = str(t.dtype).removeprefix("torch.")
    t = t.contiguous().cpu()
    shape = tuple(t.shape)
    raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
    return raw, name, shape


def _from_bytes(buf: np.ndarray, dtype: str, shape: tuple[int, ...]) -> Any:
    import torch

    tdtype = getattr(torch, dtype)
    if buf.size == 0:
        return torch.zeros(shape, dtype=tdtype)
    return torch.from_numpy(buf).view(tdtype).reshape(shape)


class _Store:
    """The fsspec target: ``uri`` plus options; writes whole objects, atomically."""

    def __init__(self, uri: str, storage_options: Mapping[str, Any] | None = None):
        self.fs, root = fsspec.core.url_to_fs(uri, **dict(storage_options or {}))
        self.root = root.rstrip("/")
        self.uri = uri.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.local = "file" in protocols
        # Threads for payload reads and writes: object stores answer each request after a
        # round trip (many at once pay it once); local files overlap with the encoding.
        self.workers = 0 if "memory" in protocols else (2 if self.local else 8)

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def url(self, *parts: str) -> str:
        return "/".join([self.uri, *parts])

    def write(self, rel: str, data: bytes) -> None:
        path = self.path(rel)
        if self.local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # readers see the old object or the whole new one
        else:
            self.fs.pipe_file(path, data)  # one PUT: atomic for readers on object stores

    def read(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def latest(self) -> tuple[int, int] | None:
        """(epoch, version) of the newest complete version, or None before the first."""
        try:
            data = json.loads(self.read(LATEST))
        except FileNotFoundError:
            return None
        except ValueError as exc:
            raise DeltaError(f"{self.url(LATEST)} is not valid JSON ({exc})") from None
        return int(data["epoch"]), int(data["version"])


class _Writes:
    """A publish's payload writes, in the store's threads while the next tensors are
    encoded (at most ``_INFLIGHT_BYTES`` queued); ``wait`` returns when all are written
    and raises the first error."""

    def __init__(self, store: _Store, pool: ThreadPoolExecutor | None):
        self.store, self.pool = store, pool
        self.pending: collections.deque[tuple[Future, int]] = collections.deque()
        self.queued = 0

    def submit(self, rel: str, data: bytes) -> None:
        if self.pool is None:
            self.store.write(rel, data)
            return
        while self.pending and (self.queued > _INFLIGHT_BYTES or self.pending[0][0].done()):
            self._pop()
        self.pending.append((self.pool.submit(self.store.write, rel, data), len(data)))
        self.queued += len(data)

    def _pop(self) -> None:
        future, size = self.pending.popleft()
        self.queued -= size
        future.result()

    def wait(self) -> None:
        while self.pending:
            self._pop()

    def abandon(self) -> None:
        """After an error: let the queued writes finish (no manifest will name them)."""
        for future, _ in self.pending:
            future.exception()
        self.pending.clear()


class DeltaSender:
    """The trainer's half: ``publish(version, named_tensors)``."""

    def __init__(self, uri: str, *, storage_options: Mapping[str, Any] | None = None, dtype: str = "bfloat16",
                 keyframe_every: int = 20, level: int = 1, threads: int = 2):
        self.store = _Store(uri, storage_options)
        self.dtype = dtype
        self.keyframe_every = keyframe_every
        self.compressor = zstandard.ZstdCompressor(level=level, threads=threads)
        self._last: dict[str, np.ndarray] | None = None  # the bytes of the last published version
        self._last_version: int | None = None
        self._since_keyframe = 0
        self.epoch: int | None = None  # set by the first publish
        # Reused between publishes (fresh big buffers cost page faults, ~10x a copy).
        self._bufs = (np.empty(_CHUNK, np.uint64), np.empty(_CHUNK, bool), np.empty(_CHUNK // 8, bool))
        self._dense = np.empty(0, np.uint8)
        self._pool: ThreadPoolExecutor | None = None

    def _dense_buffer(self, n: int) -> np.ndarray:
        if self._dense.size < n:
            self._dense = np.empty(n, np.uint8)
        return self._dense[:n]

    def _encode_delta(self, src: np.ndarray, last: np.ndarray) -> tuple[Any, str]:
        """(compressed payload or None, encoding) of ``src`` against ``last``, which is
        updated to ``src`` in place."""
        n = src.size
        if n % 2 == 0:
            found = _scan(src, last, self._bufs, (n // 2) * SPARSE_MAX_FRACTION)
            if found is not None:
                gaps, values, count = found
                if not count:
                    return None, "unchanged"
                return self.compressor.compress(_sparse_blob(gaps, values, count)), "sparse_xor"
        xor = np.bitwise_xor(src, last, out=self._dense_buffer(n))
        if not xor.any():
            return None, "unchanged"
        payload = self.compressor.compress(xor)
        np.copyto(last, src)
        return payload, "xor"

    def publish(self, version: int, named_tensors: Iterable[tuple[str, Any]]) -> dict[str, float]:
        version = int(version)
        if self.epoch is None:  # a new publisher: the next epoch, starting with a keyframe
            latest = self.store.latest()
            self.epoch = 0 if latest is None else latest[0] + 1
        elif self._last_version is not None and version <= self._last_version:
            raise ValueError(f"version {version} is not newer than the published version {self._last_version} "
                             f"at {self.store.uri}")
        epoch = self.epoch
        keyframe = self._last is None or (self.keyframe_every > 0 and self._since_keyframe >= self.keyframe_every)
        t0 = time.perf_counter()
        entries, new_last = [], {}
        total = payload_total = 0
        encode_s = 0.0
        seen: set[str] = set()
        # A delta updates the last published bytes in place; ``undo`` (buffer, encoding,
        # payload) puts them back if the publish fails (XOR is its own inverse).
        undo: list[tuple[np.ndarray, str, Any]] = []
        if self.store.workers and self._pool is None:
            self._pool = ThreadPoolExecutor(self.store.workers, thread_name_prefix="delta-write")
        writes = _Writes(self.store, self._pool)
        encoding_into: np.ndarray | None = None
        try:
            for i, (name, tensor) in enumerate(named_tensors):
                if name in seen:
                    raise ValueError(f"tensor {name!r} given twice")
                seen.add(name)
                e0 = time.perf_counter()
                src, dtype, shape = _to_bytes(tensor, self.dtype, name)
                entry: dict[str, Any] = {"name": name, "dtype": dtype, "shape": list(shape), "nbytes": int(src.size),
                                         "result_xxh3": _checksum(src)}
                if keyframe:
                    # The last version's buffers are reused (a failed keyframe drops them all).
                    buf = self._last.get(name) if self._last is not None else None
                    if buf is None or buf.size != src.size:
                        buf = np.empty(src.size, np.uint8)
                    np.copyto(buf, src)
                    new_last[name] = buf
                    payload, encoding = self.compressor.compress(buf if buf.size else b""), "full"
                else:
                    buf = self._last.get(name)  # type: ignore[union-attr]
                    if buf is None or buf.size != src.size:
                        raise ValueError(f"tensor {name!r} is new or changed size since version {self._last_version}")
                    encoding_into = buf  # an error inside leaves it half-updated: the next version is a keyframe
                    payload, encoding = self._encode_delta(src, buf)
                    encoding_into = None
                    if payload is not None:
                        undo.append((buf, encoding, payload))
                del src
                entry["encoding"] = encoding
                encode_s += time.perf_counter() - e0
                if payload is not None:
                    rel = f"{version_dir(epoch, version)}/t{i:05d}.zst"
                    writes.submit(rel, payload)
                    entry.update(payload=rel.rsplit("/", 1)[1], payload_bytes=len(payload),
                                 payload_xxh3=_checksum(payload))
                    payload_total += len(payload)
                entries.append(entry)
                total += entry["nbytes"]
            if not keyframe and set(self._last) - seen:  # type: ignore[arg-type]
                missing = sorted(set(self._last) - seen)  # type: ignore[arg-type]
                raise ValueError(f"tensor {missing[0]!r} of version {self._last_version} is missing from version {version}")
            writes.wait()
            manifest = {
                "format": FORMAT, "epoch": epoch, "version": version, "base": None if keyframe else self._last_version,
                "dtype": self.dtype, "created": time.time(), "total_bytes": total, "payload_bytes": payload_total,
                "tensors": entries,
            }
            self.store.write(f"{version_dir(epoch, version)}/manifest.json", json.dumps(manifest).encode())
            # Last: the version is now complete.
            self.store.write(LATEST, json.dumps({"epoch": epoch, "version": version}).encode())
        except BaseException:
            writes.abandon()
            if keyframe or encoding_into is not None:
                self._last = None  # some buffers may hold new bytes: the next version is a keyframe again
            else:
                decompressor = zstandard.ZstdDecompressor()
                for buf, encoding, payload in reversed(undo):
                    _xor_payload(buf, encoding, payload, decompressor, self._dense_buffer)
            raise
        if keyframe:
            self._last = new_last
        self._last_version = version
        self._since_keyframe = 1 if keyframe else self._since_keyframe + 1
        publish_s = time.perf_counter() - t0
        return {
            "sync_version": float(version), "sync_epoch": float(epoch), "sync_keyframe": float(keyframe), "sync_bytes": float(payload_total),
            # Payload writes overlap the encoding: the write time is what publishing did besides encoding.
            "sync_full_bytes": float(total), "sync_encode_s": encode_s, "sync_write_s": publish_s - encode_s,
            "sync_publish_s": publish_s,
        }


def _xor_payload(buf: np.ndarray, encoding: str, payload: bytes, decompressor: Any, scratch: Any) -> None:
    """XOR a delta payload (``xor`` or ``sparse_xor``) into ``buf``; ``scratch(n)`` lends a
    buffer of ``n`` bytes."""
    if encoding == "xor":
        xor = scratch(buf.size)
        if not _fill(decompressor, payload, xor):
            raise ValueError(f"the payload does not hold {buf.size} bytes")
        np.bitwise_xor(buf, xor, out=buf)
    else:
        _xor_sparse(buf, _sparse_raw(decompressor, payload, scratch))


class DeltaReceiver:
    """The engine's half: ``fetch()`` (may run while the engine generates), then
    ``apply(engine)`` at a safe point; ``sync(engine)`` does both."""

    def __init__(self, uri: str, *, storage_options: Mapping[str, Any] | None = None):
        self.store = _Store(uri, storage_options)
        self.version: int | None = None
        self.epoch: int | None = None
        self._bufs: dict[str, np.ndarray] = {}  # the current bytes of every tensor
        self._meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._fetched: list[tuple[dict, dict[str, bytes]]] | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.decompressor = zstandard.ZstdDecompressor()
        self._pool: ThreadPoolExecutor | None = None
        self._scratch = np.empty(0, np.uint8)  # payloads are decompressed here (reused: no page faults)

    # -- fetching ----------------------------------------------------------------

    def _manifest(self, epoch: int, version: int) -> dict:
        rel = f"{version_dir(epoch, version)}/manifest.json"
        try:
            data = json.loads(self.store.read(rel))
        except FileNotFoundError:
            raise DeltaError(f"version {version}: manifest {self.store.url(rel)} is missing") from None
        except ValueError as exc:
            raise DeltaError(f"version {version}: manifest {self.store.url(rel)} is not valid JSON ({exc})") from None
        if data.get("format") != FORMAT or data.get("version") != version or data.get("epoch") != epoch:
            raise DeltaError(f"version {version}: manifest {self.store.url(rel)} has format {data.get('format')!r}, "
                             f"version {data.get('version')!r}")
        return data

    def _plan(self, epoch: int, target: int) -> list[dict]:
        """The manifests to apply, oldest first, to go from the receiver's version to
        ``target`` of ``epoch`` (from the epoch's keyframe when the receiver is elsewhere)."""
        chain: list[dict] = []
        v: int | None = target
        while v is not None:
            if self.epoch == epoch and self.version is not None and v == self.version:
                break
            m = self._manifest(epoch, v)
            chain.append(m)
            if m["base"] is None:
                break
            v = int(m["base"])
        return chain[::-1]

    def fetch(self, target: int | None = None) -> int | None:
        """Download what is needed to reach ``target`` (default: the latest complete
        version), verifying payload checksums. Returns the version fetched (None: up to
        date)."""
        latest = self.store.latest()
        if latest is None:
            self._fetched = []
            return None
        epoch = latest[0]
        target = latest[1] if target is None else int(target)
        if epoch == self.epoch and target == self.version:
            self._fetched = []
            return None
        fetched = []
        for m in self._plan(epoch, target):
            todo = [e for e in m["tensors"] if "payload" in e]
            if self.store.workers and len(todo) > 1:  # all at once, then the first failure in manifest order
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.store.workers, thread_name_prefix="delta-read")
                got: Iterable[Any] = list(self._pool.map(lambda e, m=m: self._read(m, e), todo))
            else:
                got = (self._read(m, e) for e in todo)
            payloads: dict[str, bytes] = {}
            for entry, data in zip(todo, got):
                if isinstance(data, BaseException):
                    raise data
                payloads[entry["name"]] = data
            fetched.append((m, payloads))
        self._fetched = fetched
        return target

    def _read(self, m: dict, entry: dict) -> bytes | BaseException:
        """A payload, checked against the manifest, or the error to raise."""
        rel = f"{version_dir(m['epoch'], m['version'])}/{entry['payload']}"
        try:
            data = self.store.read(rel)
        except FileNotFoundError:
            return DeltaError(f"version {m['version']}: payload {self.store.url(rel)} "
                              f"(tensor {entry['name']!r}) is missing")
        except Exception as exc:  # noqa: BLE001 - raised by fetch, in manifest order
            return exc
        if len(data) != entry["payload_bytes"] or _checksum(data) != entry["payload_xxh3"]:
            return DeltaError(f"version {m['version']}: payload {self.store.url(rel)} "
                              f"(tensor {entry['name']!r}) fails its checksum")
        return data

    def prefetch(self, target: int | None = None) -> None:
        """``fetch`` in a background thread (the engine keeps generating); ``apply`` waits for it."""
        self._error = None

        def run() -> None:
            try:
                self.fetch(target)
            except BaseException as exc:  # noqa: BLE001 - re-raised by apply()
                self._error = exc

        self._thread = threading.Thread(target=run, name="delta-prefetch", daemon=True)
        self._thread.start()

    # -- applying ----------------------------------------------------------------

    def _apply_one(self, m: dict, payloads: dict[str, bytes]) -> list[tuple[str, str, bytes]]:
        """Apply one manifest to the buffers; returns the undo list (name, encoding, payload)."""
        undo: list[tuple[str, str, bytes]] = []
        version, epoch = m["version"], m["epoch"]
        keyframe = m["base"] is None
        if not keyframe and (m["base"] != self.version or epoch != self.epoch):
            raise DeltaError(f"version {version}: based on version {m['base']}, but the receiver has {self.version}")
        new_bufs: dict[str, np.ndarray] = {}
        try:
            for entry in m["tensors"]:
                name = entry["name"]
                enc = entry["encoding"]
                if keyframe:
                    out = np.empty(entry["nbytes"], dtype=np.uint8)
                    if entry["nbytes"]:
                        self._decompress_into(payloads[name], out, m, entry)
                    new_bufs[name] = out
                    buf = out
                else:
                    buf = self._bufs.get(name)
                    if buf is None or buf.size != entry["nbytes"]:
                        raise DeltaError(f"version {version}: tensor {name!r} does not match the receiver's version {self.version}")
                    if enc == "unchanged":
                        continue
                    file = self.store.url(version_dir(epoch, version), entry.get("payload", "?"))
                    if enc not in ("xor", "sparse_xor"):
                        raise DeltaError(f"version {version}: tensor {name!r} has unknown encoding {enc!r}")
                    if enc == "xor":
                        xor = self._scratch_buffer(buf.size)
                        self._decompress_into(payloads[name], xor, m, entry)
                        np.bitwise_xor(buf, xor, out=buf)
                    else:
                        try:
                            _xor_sparse(buf, _sparse_raw(self.decompressor, payloads[name], self._scratch_buffer))
                        except (ValueError, zstandard.ZstdError) as exc:
                            raise DeltaError(f"version {version}: payload {file} (tensor {name!r}): {exc}") from None
                    undo.append((name, enc, payloads[name]))  # undone by applying it again
                if _checksum(buf) != entry["result_xxh3"]:
                    file = f"{version_dir(epoch, version)}/{entry.get('payload', 'manifest.json')}"
                    raise DeltaError(f"version {version}: tensor {name!r} from {self.store.url(file)} does not give "
                                     "the published bytes (checksum mismatch)")
        except BaseException:
            self._undo(undo)
            raise
        if keyframe:
            self._bufs = new_bufs
        self._meta = {e["name"]: (e["dtype"], tuple(e["shape"])) for e in m["tensors"]}
        self.version, self.epoch = version, epoch
        return undo

    def _undo(self, undo: list[tuple[str, str, bytes]]) -> None:
        """XOR is its own inverse: apply the same payloads again, newest first."""
        for name, encoding, payload in reversed(undo):
            _xor_payload(self._bufs[name], encoding, payload, self.decompressor, self._scratch_buffer)

    def _scratch_buffer(self, n: int) -> np.ndarray:
        if self._scratch.size < n:
            self._scratch = np.empty(n, dtype=np.uint8)
        return self._scratch[:n]

    def _decompress_into(self, payload: bytes, out: np.ndarray, m: dict, entry: dict) -> None:
        """Decompress a payload straight into ``out`` (no intermediate buffer); it must fill it exactly."""
        version = m["version"]
        file = self.store.url(version_dir(m["epoch"], version), entry.get("payload", "?"))
        try:
            full = _fill(self.decompressor, payload, out)
        except zstandard.ZstdError as exc:
            raise DeltaError(f"version {version}: payload {file} (tensor {entry['name']!r}): {exc}") from None
        if not full:
            raise DeltaError(f"version {version}: payload {file} (tensor {entry['name']!r}) does not hold "
                             f"{out.size} bytes")

    def apply(self, engine: Any) -> dict[str, float]:
        """Apply what ``fetch``/``prefetch`` got, all versions or none, then hand the
        engine the complete new weights (``engine.update_weights``)."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self._error is not None:
                error, self._error = self._error, None
                raise error
        fetched, self._fetched = self._fetched, None
        if fetched is None:
            raise RuntimeError("apply() before fetch() or prefetch()")
        if not fetched:
            return {"sync_applied": 0.0}
        saved = (self.version, self.epoch, dict(self._bufs), dict(self._meta))
        undos: list[list[tuple[str, str, bytes]]] = []
        try:
            for m, payloads in fetched:
                undos.append(self._apply_one(m, payloads))
            tensors = [(name, _from_bytes(buf, *self._meta[name])) for name, buf in self._bufs.items()]
            engine.update_weights(tensors, self.version)
        except BaseException:
            for undo in reversed(undos):
                self._undo(undo)
            self.version, self.epoch, self._bufs, self._meta = saved
            raise
        return {"sync_applied": float(len(fetched)), "sync_apply_s": time.perf_counter() - t0}

    def sync(self, engine: Any, target: int | None = None) -> dict[str, float]:
        t0 = time.perf_counter()
        self.fetch(target)
        fetch_s = time.perf_counter() - t0
        out = self.apply(engine)
        out["sync_fetch_s"] = fetch_s
        return out


class Delta:
    """The ``delta`` transport: a sender and a receiver over one URL."""

    collective = False  # the receiver reads what the sender wrote: publish first, then sync

    def __init__(self, config: Any):
        self.config = config
        self._sender: DeltaSender | None = None
        self._receiver: DeltaReceiver | None = None

    def sender(self, **_context: Any) -> DeltaSender:
        c = self.config
        return DeltaSender(c.uri, storage_options=c.storage_options, dtype=c.dtype,
                           keyframe_every=c.keyframe_every, level=c.level, threads=c.threads)

    def receiver(self, **_context: Any) -> DeltaReceiver:
        return DeltaReceiver(self.config.uri, storage_options=self.config.storage_options)

    def publish(self, backend: Any, engine: Any, version: int) -> Mapping[str, float]:
        """One process: publish the backend's weights, then bring the engine up to date."""
        if getattr(engine, "shares_weights", False) and self.config.dtype != _param_dtype(backend):
            raise ValueError(
                f"the delta transport ships weights as {self.config.dtype}, but the engine shares the trainer's "
                f"tensors ({_param_dtype(backend)}), so applying them would overwrite the trainer's weights: "
                f"set engine.dtype = \"{self.config.dtype}\" (the engine then keeps its own copy)"
            )
        if self._sender is None:
            self._sender, self._receiver = self.sender(), self.receiver()
        stats = self._sender.publish(version, weights_to_serve(backend))
        stats.update(self._receiver.sync(engine, version))
        return stats


def _param_dtype(backend: Any) -> str:
    for _, t in backend.named_weights():
        if t.is_floating_point():
            return str(t.dtype).removeprefix("torch.")
    return "float32"
