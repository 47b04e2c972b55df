"""The trainer's half of ``delta``: :class:`DeltaSender` encodes each version against
the bytes it last published and writes payloads, manifest and ``LATEST``."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Mapping

import numpy as np
import zstandard

from .codec import SPARSE_MAX_FRACTION, checksum, scan, scan_buffers, sparse_blob, to_bytes, xor_payload
from .store import FORMAT, PayloadWrites, Store, version_dir


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

    def _dense_buffer(self, n: int) -> np.ndarray:
        if self._dense.size < n:
            self._dense = np.empty(n, np.uint8)
        return self._dense[:n]

    def _encode_delta(self, src: np.ndarray, last: np.ndarray) -> tuple[Any, str]:
        """(compressed payload or None, encoding) of ``src`` against ``last``, which is
        updated to ``src`` in place."""
        n = src.size
        if n % 2 == 0:
            found = scan(src, last, self._bufs, (n // 2) * SPARSE_MAX_FRACTION)
            if found is not None:
                gaps, values, count = found
                if not count:
                    return None, "unchanged"
                return self.compressor.compress(sparse_blob(gaps, values, count)), "sparse_xor"
        xor = np.bitwise_xor(src, last, out=self._dense_buffer(n))
        if not xor.any():
            return None, "unchanged"
        payload = self.compressor.compress(xor)
        np.copyto(last, src)
        return payload, "xor"

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
        total = payload_total = 0
        encode_s = 0.0
        seen: set[str] = set()
        # A delta updates the last published bytes in place; ``undo`` (buffer, encoding,
        # payload) puts them back if the publish fails (XOR is its own inverse).
        undo: list[tuple[np.ndarray, str, Any]] = []
        if self.store.workers and self._pool is None:
            self._pool = ThreadPoolExecutor(self.store.workers, thread_name_prefix="delta-write")
        writes = PayloadWrites(self.store, self._pool)
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
                                 payload_xxh3=checksum(payload))
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
        }
