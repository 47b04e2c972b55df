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
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from typing import Any, Iterable, Mapping

import fsspec
import numpy as np
import xxhash
import zstandard

FORMAT = 1
LATEST = "LATEST"
SPARSE_MAX_FRACTION = 0.2  # changed 16-bit words above this fraction: store the dense XOR


class DeltaError(RuntimeError):
    """A version cannot be applied; the receiver (and the engine) kept their last one."""


def version_dir(epoch: int, version: int) -> str:
    return f"e{epoch:03d}/v{version:08d}"


def _checksum(data: Any) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(data).cast("B") if not isinstance(data, bytes) else data)


def _words(buf: np.ndarray) -> np.ndarray:
    """A byte buffer as 16-bit words (bf16 / fp16 elements; fp32 as two words each)."""
    return buf.view(np.uint16)


def _encode_sparse(xor: np.ndarray) -> bytes | None:
    """(count, gaps uint32, values uint16) of the non-zero 16-bit words, or None when
    too many changed for the sparse form to pay."""
    words = _words(xor)
    n = words.size
    # Non-zero 64-bit words first (4x fewer to scan), then their non-zero lanes.
    pad = (-n) % 4
    if pad:
        words64 = np.concatenate([words, np.zeros(pad, np.uint16)]).view(np.uint64)
    else:
        words64 = words.view(np.uint64)
    hot = np.flatnonzero(words64)
    if hot.size > n * SPARSE_MAX_FRACTION:  # each hot 64-bit word holds at least one changed word
        return None
    lanes = words64[hot][:, None] >> np.array([0, 16, 32, 48], dtype=np.uint64)
    lanes = (lanes & np.uint64(0xFFFF)).astype(np.uint16)
    nz = lanes != 0
    positions = (hot[:, None] * 4 + np.arange(4))[nz]
    if positions.size > n * SPARSE_MAX_FRACTION:
        return None
    values = lanes[nz]
    gaps = np.diff(positions, prepend=-1)
    if gaps.size and int(gaps.max()) > 0xFFFFFFFF:
        return None
    head = np.array([positions.size], dtype="<u8").tobytes()
    return head + gaps.astype("<u4").tobytes() + values.astype("<u2").tobytes()


def _decode_sparse(raw: bytes, n_words: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions int64, XOR values uint16) of a sparse payload, checked against ``n_words``."""
    count = int(np.frombuffer(raw, dtype="<u8", count=1)[0]) if len(raw) >= 8 else -1
    if count < 0 or len(raw) != 8 + 6 * count:
        raise ValueError("malformed sparse payload")
    gaps = np.frombuffer(raw, dtype="<u4", count=count, offset=8)
    values = np.frombuffer(raw, dtype="<u2", count=count, offset=8 + 4 * count)
    positions = np.cumsum(gaps, dtype=np.int64) - 1
    if count and (positions[-1] >= n_words or int(gaps.min()) < 1):
        raise ValueError("sparse payload positions out of range")
    return positions, values


def _to_bytes(tensor: Any, dtype: str) -> tuple[np.ndarray, str, tuple[int, ...]]:
    """A tensor as contiguous bytes in the wire dtype (a new array the caller owns)."""
    import torch

    wire = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    t = tensor.detach()
    if t.is_floating_point():
        t = t.to(wire)
        name = dtype
    else:
        name = str(t.dtype).removeprefix("torch.")
    t = t.contiguous().cpu()
    shape = tuple(t.shape)
    raw = t.reshape(-1).view(torch.uint8).numpy().copy() if t.numel() else np.zeros(0, np.uint8)
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
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

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
        encode_s = write_s = 0.0
        seen: set[str] = set()
        for i, (name, tensor) in enumerate(named_tensors):
            if name in seen:
                raise ValueError(f"tensor {name!r} given twice")
            seen.add(name)
            e0 = time.perf_counter()
            raw, dtype, shape = _to_bytes(tensor, self.dtype)
            entry: dict[str, Any] = {"name": name, "dtype": dtype, "shape": list(shape), "nbytes": int(raw.size),
                                     "result_xxh3": _checksum(raw)}
            base = None if keyframe else self._last.get(name)  # type: ignore[union-attr]
            if not keyframe and (base is None or base.size != raw.size):
                raise ValueError(f"tensor {name!r} is new or changed size since version {self._last_version}")
            if keyframe:
                payload, encoding = self.compressor.compress(raw.tobytes()), "full"
            else:
                xor = np.bitwise_xor(raw, base)
                if not xor.any():
                    payload, encoding = None, "unchanged"
                else:
                    sparse = _encode_sparse(xor) if raw.size % 2 == 0 else None
                    if sparse is not None:
                        payload, encoding = self.compressor.compress(sparse), "sparse_xor"
                    else:
                        payload, encoding = self.compressor.compress(xor.tobytes()), "xor"
            entry["encoding"] = encoding
            encode_s += time.perf_counter() - e0
            if payload is not None:
                rel = f"{version_dir(epoch, version)}/t{i:05d}.zst"
                w0 = time.perf_counter()
                self.store.write(rel, payload)
                write_s += time.perf_counter() - w0
                entry.update(payload=rel.rsplit("/", 1)[1], payload_bytes=len(payload), payload_xxh3=_checksum(payload))
                payload_total += len(payload)
            entries.append(entry)
            new_last[name] = raw
            total += raw.size
        if not keyframe and set(self._last) - seen:  # type: ignore[arg-type]
            missing = sorted(set(self._last) - seen)  # type: ignore[arg-type]
            raise ValueError(f"tensor {missing[0]!r} of version {self._last_version} is missing from version {version}")
        manifest = {
            "format": FORMAT, "epoch": epoch, "version": version, "base": None if keyframe else self._last_version,
            "dtype": self.dtype, "created": time.time(), "total_bytes": total, "payload_bytes": payload_total,
            "tensors": entries,
        }
        w0 = time.perf_counter()
        self.store.write(f"{version_dir(epoch, version)}/manifest.json", json.dumps(manifest).encode())
        # Last: the version is now complete.
        self.store.write(LATEST, json.dumps({"epoch": epoch, "version": version}).encode())
        write_s += time.perf_counter() - w0
        self._last, self._last_version = new_last, version
        self._since_keyframe = 1 if keyframe else self._since_keyframe + 1
        return {
            "sync_version": float(version), "sync_epoch": float(epoch), "sync_keyframe": float(keyframe), "sync_bytes": float(payload_total),
            "sync_full_bytes": float(total), "sync_encode_s": encode_s, "sync_write_s": write_s,
            "sync_publish_s": time.perf_counter() - t0,
        }


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
            payloads: dict[str, bytes] = {}
            for entry in m["tensors"]:
                if "payload" not in entry:
                    continue
                rel = f"{version_dir(epoch, m['version'])}/{entry['payload']}"
                try:
                    data = self.store.read(rel)
                except FileNotFoundError:
                    raise DeltaError(f"version {m['version']}: payload {self.store.url(rel)} "
                                     f"(tensor {entry['name']!r}) is missing") from None
                if len(data) != entry["payload_bytes"] or _checksum(data) != entry["payload_xxh3"]:
                    raise DeltaError(f"version {m['version']}: payload {self.store.url(rel)} "
                                     f"(tensor {entry['name']!r}) fails its checksum")
                payloads[entry["name"]] = data
            fetched.append((m, payloads))
        self._fetched = fetched
        return target

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

    def _apply_one(self, m: dict, payloads: dict[str, bytes]) -> list[tuple[str, Any, np.ndarray]]:
        """Apply one manifest to the buffers; returns the undo list (name, positions or
        None, XOR values)."""
        undo: list[tuple[str, Any, np.ndarray]] = []
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
                    if enc == "xor":
                        xor = np.empty(buf.size, dtype=np.uint8)
                        self._decompress_into(payloads[name], xor, m, entry)
                        np.bitwise_xor(buf, xor, out=buf)
                        undo.append((name, None, xor))
                    elif enc == "sparse_xor":
                        try:
                            positions, values = _decode_sparse(self.decompressor.decompress(payloads[name]), buf.size // 2)
                        except (ValueError, zstandard.ZstdError) as exc:
                            raise DeltaError(f"version {version}: payload {file} (tensor {name!r}): {exc}") from None
                        _words(buf)[positions] ^= values
                        undo.append((name, positions, values))
                    else:
                        raise DeltaError(f"version {version}: tensor {name!r} has unknown encoding {enc!r}")
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

    def _undo(self, undo: list[tuple[str, Any, np.ndarray]]) -> None:
        """XOR is its own inverse: apply the same changes again, newest first."""
        for name, positions, values in reversed(undo):
            if positions is None:
                np.bitwise_xor(self._bufs[name], values, out=self._bufs[name])
            else:
                _words(self._bufs[name])[positions] ^= values

    def _decompress_into(self, payload: bytes, out: np.ndarray, m: dict, entry: dict) -> None:
        """Decompress a payload straight into ``out`` (no intermediate buffer); it must fill it exactly."""
        version = m["version"]
        file = self.store.url(version_dir(m["epoch"], version), entry.get("payload", "?"))
        view = memoryview(out).cast("B")
        got = 0
        try:
            with self.decompressor.stream_reader(payload) as reader:
                while got < len(view):
                    n = reader.readinto(view[got:])
                    if not n:
                        break
                    got += n
                extra = reader.read(1)
        except zstandard.ZstdError as exc:
            raise DeltaError(f"version {version}: payload {file} (tensor {entry['name']!r}): {exc}") from None
        if got != len(view) or extra:
            raise DeltaError(f"version {version}: payload {file} (tensor {entry['name']!r}) does not hold "
                             f"{len(view)} bytes")

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
        undos: list[list[tuple[str, Any, np.ndarray]]] = []
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
        stats = self._sender.publish(version, backend.named_weights())
        stats.update(self._receiver.sync(engine, version))
        return stats


def _param_dtype(backend: Any) -> str:
    for _, t in backend.named_weights():
        if t.is_floating_point():
            return str(t.dtype).removeprefix("torch.")
    return "float32"
