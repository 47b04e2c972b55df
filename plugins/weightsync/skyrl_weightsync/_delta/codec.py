"""The bytes of a ``delta`` version: tensors as wire bytes and back, the XOR of two
versions as a sparse payload (gaps between the changed 16-bit words, XOR values) or a
dense one (the XOR bytes), zstd decompression straight into reused buffers, and the
xxHash3 checksums (imports numpy, zstandard, xxhash; torch only to convert tensors)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import xxhash
import zstandard

SPARSE_MAX_FRACTION = 0.2  # changed 16-bit words above this fraction: store the dense XOR
_CHUNK = 1 << 17  # 64-bit words the sender compares at a time (1 MiB: stays in cache)
_PIECE = 1 << 20  # changed words a receiver applies at a time


def checksum(data: Any) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(data).cast("B") if not isinstance(data, bytes) else data)


def _words(buf: np.ndarray) -> np.ndarray:
    """A byte buffer as 16-bit words (bf16 / fp16 elements; fp32 as two words each)."""
    return buf.view(np.uint16)


def scan_buffers() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The scratch buffers :func:`scan` works in (a sender keeps them between publishes:
    fresh big buffers cost page faults, ~10x a copy)."""
    return np.empty(_CHUNK, np.uint64), np.empty(_CHUNK, bool), np.empty(_CHUNK // 8, bool)


def scan(src: np.ndarray, last: np.ndarray, bufs: tuple[np.ndarray, np.ndarray, np.ndarray],
         limit: float) -> tuple[list[np.ndarray], list[np.ndarray], int] | None:
    """The 16-bit words where ``src`` and ``last`` (byte buffers of one even size) differ,
    as the sparse payload's gaps (uint32 pieces) and XOR values (uint16 pieces) and their
    count, with ``last`` updated to ``src`` in place; or None, ``last`` unchanged, when
    more than ``limit`` words differ or a gap does not fit 32 bits.

    Works a chunk of 64-bit words at a time (``bufs``, from :func:`scan_buffers`:
    ``_CHUNK`` uint64, ``_CHUNK`` and ``_CHUNK // 8`` bool), so the XOR and the search for
    changed words stay in cache, and writes only the changed words to ``last``."""
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


def surely_dense(src: np.ndarray, last: np.ndarray, samples: int = 2048) -> bool:
    """True when ``samples`` 16-bit words spread over two byte buffers of one even size
    differ in more than twice :data:`SPARSE_MAX_FRACTION` of them: the sparse payload is
    then out of reach and :func:`scan` is not worth trying (it finds out only after
    comparing the words, half a dense publish's time on small tensors). An optimizer step
    changes most words of most tensors. The positions are a multiplicative hash of
    0..samples-1, so rows and columns of any width are sampled alike; a tensor that is
    truly sparse (under 20%) shows over 40% only if its changes line up with the sample,
    and even then the payload is the dense XOR: larger, still exact."""
    words = src.size // 2
    if words < 4 * samples:  # small: the scan itself is about as cheap
        return False
    at = _sample_positions(words, samples)
    return int(np.count_nonzero(_words(src)[at] != _words(last)[at])) > 2 * SPARSE_MAX_FRACTION * samples


@functools.lru_cache(maxsize=256)
def _sample_positions(words: int, samples: int) -> np.ndarray:
    return ((np.arange(samples, dtype=np.uint64) * np.uint64(0x9E3779B1)) % np.uint64(words)).astype(np.intp)


def _unscan(last: np.ndarray, gaps: list[np.ndarray], values: list[np.ndarray]) -> None:
    """Undo what ``scan`` wrote to ``last`` so far."""
    if gaps:
        positions = np.cumsum(np.concatenate(gaps), dtype=np.int64) - 1
        _words(last)[positions] ^= np.concatenate(values)


def sparse_blob(gaps: list[np.ndarray], values: list[np.ndarray], count: int) -> np.ndarray:
    """The sparse payload before compression: count (uint64), gaps between the changed
    16-bit words' positions (uint32, the first from -1), XOR values (uint16), little-endian."""
    blob = np.empty(8 + 6 * count, dtype=np.uint8)
    blob[:8].view("<u8")[0] = count
    if count:
        np.concatenate(gaps, out=blob[8:8 + 4 * count].view("<u4"))
        np.concatenate(values, out=blob[8 + 4 * count:].view("<u2"))
    return blob


def fill(decompressor: Any, payload: bytes, out: np.ndarray) -> bool:
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


def sparse_raw(decompressor: Any, payload: bytes, scratch: Any) -> np.ndarray:
    """A sparse payload decompressed into ``scratch(size)`` (a reused buffer)."""
    size = zstandard.frame_content_size(payload)
    if size < 0:  # no size in the frame header
        return np.frombuffer(decompressor.decompress(payload), np.uint8)
    raw = scratch(size)
    if not fill(decompressor, payload, raw):
        raise ValueError("malformed sparse payload")
    return raw


def xor_sparse(buf: np.ndarray, raw: np.ndarray) -> None:
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


def xor_payload(buf: np.ndarray, encoding: str, payload: bytes, decompressor: Any, scratch: Any) -> None:
    """XOR a delta payload (``xor`` or ``sparse_xor``) into ``buf``; ``scratch(n)`` lends a
    buffer of ``n`` bytes."""
    if encoding == "xor":
        xor = scratch(buf.size)
        if not fill(decompressor, payload, xor):
            raise ValueError(f"the payload does not hold {buf.size} bytes")
        np.bitwise_xor(buf, xor, out=buf)
    else:
        xor_sparse(buf, sparse_raw(decompressor, payload, scratch))


def to_bytes(tensor: Any, dtype: str, name: str = "") -> tuple[np.ndarray, str, tuple[int, ...]]:
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


def snapshot_tensor(tensor: Any, dtype: str, name: str = "") -> Any:
    """A copy of ``tensor`` in host memory, in the wire dtype :func:`to_bytes` would send
    (one copy: a conversion or a device-to-host move is that copy)."""
    import torch

    t = tensor.detach()
    if t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) and "@" not in name:
        wire = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
        converted = t.to(wire)
        copied = converted.data_ptr() != t.data_ptr() or t.numel() == 0
        t = converted
    else:
        copied = False
    if t.device.type != "cpu":
        return t.to("cpu")
    return t.contiguous() if copied else t.clone(memory_format=torch.contiguous_format)


def from_bytes(buf: np.ndarray, dtype: str, shape: tuple[int, ...]) -> Any:
    import torch

    tdtype = getattr(torch, dtype)
    if buf.size == 0:
        return torch.zeros(shape, dtype=tdtype)
    return torch.from_numpy(buf).view(tdtype).reshape(shape)
