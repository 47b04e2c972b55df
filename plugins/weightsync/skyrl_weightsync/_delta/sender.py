"""The trainer's half of ``delta``: :class:`DeltaSender` encodes each version against
the bytes it last published and writes payloads, manifest and ``LATEST``."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Mapping

import numpy as np
import zstandard

from .codec import (
    SPARSE_MAX_FRACTION,
    checksum,
    scan,
    scan_buffers,
    snapshot_tensor,
    sparse_blob,
    surely_dense,
    to_bytes,
    xor_payload,
)
from .store import FORMAT, PACK_BELOW, Packs, PayloadWrites, Store, parts_of, version_dir


class DeltaSender:
    """The trainer's half: ``publish(version, named_tensors)``."""

    def __init__(self, uri: str, *, storage_options: Mapping[str, Any] | None = None, dtype: str = "bfloat16",
                 keyframe_every: int = 20, level: int = 1, threads: int = 2):
        self.store = Store(uri, storage_options)
        self.dtype = dtype
        self.keyframe_every = keyframe_every
        self.compressor = zstandard.ZstdCompressor(level=level, threads=threads)
        self._last: dict[str, np.ndarray] | None = None  # the bytes of the last published version
        self._last_version: int | None = None
        self._since_keyframe = 0
        self.epoch: int | None = None  # set by the first publish
        # Reused between publishes (fresh big buffers cost page faults, ~10x a copy).
        self._bufs = scan_buffers()
        self._dense = np.empty(0, np.uint8)
        self._pool: ThreadPoolExecutor | None = None
        self._encoder: ThreadPoolExecutor | None = None  # publish_in_background's one thread

    def _dense_buffer(self, n: int) -> np.ndarray:
        if self._dense.size < n:
            self._dense = np.empty(n, np.uint8)
        return self._dense[:n]

    def _encode_delta(self, src: np.ndarray, last: np.ndarray) -> tuple[Any, str, int]:
        """(compressed payload or None, encoding, changed 16-bit words) of ``src`` against
        ``last``, which is updated to ``src`` in place."""
        n = src.size
        if n % 2 == 0 and not surely_dense(src, last):
            found = scan(src, last, self._bufs, (n // 2) * SPARSE_MAX_FRACTION)
            if found is not None:
                gaps, values, count = found
                if not count:
                    return None, "unchanged", 0
                return self.compressor.compress(sparse_blob(gaps, values, count)), "sparse_xor", count
        xor = np.bitwise_xor(src, last, out=self._dense_buffer(n))
        if not xor.any():
            return None, "unchanged", 0
        payload = self.compressor.compress(xor)
        np.copyto(last, src)
        words = xor[: n - n % 2].view(np.uint16)
        return payload, "xor", int(np.count_nonzero(words)) + int(n % 2 == 1 and xor[-1] != 0)

    def publish_in_background(self, version: int, named_tensors: Iterable[tuple[str, Any]]) -> Future:
        """Take a snapshot of the tensors now (a copy in the wire dtype, in host memory:
        the caller may change them as soon as this returns) and :meth:`publish` it in a
        thread of the sender's own; the future's result is publish's metrics plus
        ``sync_snapshot_s`` (the time the caller was held), its exception publish's. Calls
        publish in the order made. The price: one more copy of the weights in host memory
        while a version is encoded."""
        t0 = time.perf_counter()
        snapshot = [(name, snapshot_tensor(tensor, self.dtype, name)) for name, tensor in named_tensors]
        held = time.perf_counter() - t0
        if self._encoder is None:
            self._encoder = ThreadPoolExecutor(1, thread_name_prefix="delta-encode")
        return self._encoder.submit(lambda: {**self.publish(version, snapshot), "sync_snapshot_s": held})

    def publish(self, version: int, named_tensors: Iterable[tuple[str, Any]]) -> dict[str, float]:
        version = int(version)
        if self.epoch is None:  # a new publisher: the next epoch, starting with a keyframe
            self.epoch = self.store.next_epoch()
        elif self._last_version is not None and version <= self._last_version:
            raise ValueError(f"version {version} is not newer than the published version {self._last_version} "
                             f"at {self.store.uri}")
        epoch = self.epoch
        keyframe = self._last is None or (self.keyframe_every > 0 and self._since_keyframe >= self.keyframe_every)
        t0 = time.perf_counter()
        entries, new_last = [], {}
        total = payload_total = changed_words = 0
        encode_s = 0.0
        seen: set[str] = set()
        # A delta updates the last published bytes in place; ``undo`` (buffer, encoding,
        # payload) puts them back if the publish fails (XOR is its own inverse).
        undo: list[tuple[np.ndarray, str, Any]] = []
        if self.store.workers and self._pool is None:
            self._pool = ThreadPoolExecutor(self.store.workers, thread_name_prefix="delta-write")
        writes = PayloadWrites(self.store, self._pool)
        packs = Packs(writes, version_dir(epoch, version))
        encoding_into: np.ndarray | None = None
        try:
            for i, (name, tensor) in enumerate(named_tensors):
                if name in seen:
                    raise ValueError(f"tensor {name!r} given twice")
                seen.add(name)
                e0 = time.perf_counter()
                src, dtype, shape = to_bytes(tensor, self.dtype, name)
                entry: dict[str, Any] = {"name": name, "dtype": dtype, "shape": list(shape), "nbytes": int(src.size),
                                         "result_xxh3": checksum(src)}
                if keyframe:
                    # The last version's buffers are reused (a failed keyframe drops them all).
                    buf = self._last.get(name) if self._last is not None else None
                    if buf is None or buf.size != src.size:
                        buf = np.empty(src.size, np.uint8)
                    np.copyto(buf, src)
                    new_last[name] = buf
                else:
                    buf = self._last.get(name)  # type: ignore[union-attr]
                    if buf is None or buf.size != src.size:
                        raise ValueError(f"tensor {name!r} is new or changed size since version {self._last_version}")
                    encoding_into = buf  # an error inside leaves it half-updated: the next version is a keyframe
                # A tensor above PART_BYTES goes as parts, each encoded and written on its own:
                # every object stays one PUT (no multipart upload), and parts write in parallel.
                spans = parts_of(src.size)
                parts: list[dict[str, Any]] = []
                for k, (a, b) in enumerate(spans):
                    if keyframe:
                        payload, encoding = self.compressor.compress(buf[a:b] if b > a else b""), "full"
                    else:
                        payload, encoding, count = self._encode_delta(src[a:b], buf[a:b])
                        changed_words += count
                        if payload is not None:
                            undo.append((buf[a:b], encoding, payload))
                    part: dict[str, Any] = {"offset": a, "nbytes": b - a, "encoding": encoding}
                    if payload is not None:
                        w0 = time.perf_counter()  # a write may wait for earlier writes: not encoding time
                        if len(payload) < PACK_BELOW:
                            file, offset = packs.add(payload)
                            part["payload_offset"] = offset
                        else:
                            file = f"t{i:05d}" + (f".p{k:04d}.zst" if len(spans) > 1 else ".zst")
                            writes.submit(f"{version_dir(epoch, version)}/{file}", payload)
                        encode_s -= time.perf_counter() - w0
                        part.update(payload=file, payload_bytes=len(payload), payload_xxh3=checksum(payload))
                        payload_total += len(payload)
                    parts.append(part)
                encoding_into = None
                del src
                if len(parts) == 1:  # one part: its fields are the tensor's own (as in format 1)
                    del parts[0]["offset"], parts[0]["nbytes"]
                    entry.update(parts[0])
                else:
                    entry["encoding"] = "parts"
                    entry["parts"] = parts
                encode_s += time.perf_counter() - e0
                entries.append(entry)
                total += entry["nbytes"]
            if not keyframe and set(self._last) - seen:  # type: ignore[arg-type]
                missing = sorted(set(self._last) - seen)  # type: ignore[arg-type]
                raise ValueError(f"tensor {missing[0]!r} of version {self._last_version} is missing from version {version}")
            packs.flush()
            writes.wait()
            manifest = {
                "format": FORMAT, "epoch": epoch, "version": version, "base": None if keyframe else self._last_version,
                "dtype": self.dtype, "created": time.time(), "total_bytes": total, "payload_bytes": payload_total,
                "tensors": entries,
            }
            self.store.commit(epoch, version, manifest)  # the manifest, then LATEST: the version is now complete
        except BaseException:
            writes.abandon()
            if keyframe or encoding_into is not None:
                self._last = None  # some buffers may hold new bytes: the next version is a keyframe again
            else:
                decompressor = zstandard.ZstdDecompressor()
                for buf, encoding, payload in reversed(undo):
                    xor_payload(buf, encoding, payload, decompressor, self._dense_buffer)
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
            # 16-bit words (bf16 elements; fp32 halves) that differ from the last version (deltas only)
            **({} if keyframe else {"sync_changed_words": float(changed_words)}), "sync_words": float(total // 2),
        }
