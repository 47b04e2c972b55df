"""Building blocks of the data sampling strategies (no hooks here; numpy only).

- :func:`hash64`: a stateless 64-bit hash of integers (splitmix64 steps), so every
  random choice is a pure function of (seed, stream, counter) and a strategy's
  checkpoint is a few counters;
- :class:`Permutation`: a pseudo-random bijection of ``range(n)`` computed one index at
  a time or one block of consecutive positions at a time (a balanced Feistel network
  with cycle walking), so shuffling ``n`` documents takes O(1) memory and O(1) time
  per draw, whatever ``n`` is;
- :class:`Concatenation`: several datasets seen as one range of global document
  indices;
- :class:`BlockCache`: the strategies evaluate their permutations for ``BLOCK``
  consecutive positions at once in numpy and keep only that block: a pure function of
  (epoch, block), so it is a cache and never part of a checkpoint.
"""

from __future__ import annotations

import bisect
from typing import Any, Callable, Sequence

import numpy as np

_M64 = (1 << 64) - 1
_ROUNDS = 6
BLOCK = 4096  # positions evaluated at once by the strategies (32 KiB of int64)


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _splitmix_array(x: np.ndarray) -> np.ndarray:
    """:func:`_splitmix` on a uint64 array (numpy wraps uint64 arithmetic mod 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def hash64(*parts: int) -> int:
    """A 64-bit hash of non-negative integers (order matters)."""
    h = 0x243F6A8885A308D3
    for p in parts:
        h = _splitmix(h ^ (int(p) & _M64))
    return h


def uniform(*parts: int) -> float:
    """A float in [0, 1) from :func:`hash64` (53 random bits)."""
    return (hash64(*parts) >> 11) * (1.0 / (1 << 53))


def uniforms(prefix: Sequence[int], start: int, stop: int) -> np.ndarray:
    """``[uniform(*prefix, k) for k in range(start, stop)]``, computed in numpy."""
    h = np.uint64(hash64(*prefix))
    x = _splitmix_array(h ^ np.arange(start, stop, dtype=np.uint64))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class Permutation:
    """``perm(i)`` for ``i`` in ``range(n)``: a bijection of ``range(n)`` chosen by ``key``.

    A Feistel network on ``2k`` bits (``4**k >= n``) is a bijection of
    ``range(4**k)``; indices that land outside ``range(n)`` are mapped again until
    they land inside ("cycle walking"), which keeps it a bijection of ``range(n)``.
    Since ``4**k < 4 n``, that takes fewer than 4 rounds of the network on average.
    Six rounds with a splitmix64 round function: statistically a random shuffle for
    training purposes (not a cryptographic one)."""

    def __init__(self, n: int, key: int):
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self.n = int(n)
        self.key = int(key) & _M64
        half = 1
        while (1 << (2 * half)) < self.n:
            half += 1
        self._half = half
        self._mask = (1 << half) - 1
        self._keys = [hash64(self.key, r) for r in range(_ROUNDS)]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self._half, x & self._mask
        for k in self._keys:
            left, right = right, left ^ (_splitmix(k ^ right) & self._mask)
        return (left << self._half) | right

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} outside range({self.n})")
        x = self._encrypt(i)
        while x >= self.n:
            x = self._encrypt(x)
        return x

    def _encrypt_array(self, x: np.ndarray) -> np.ndarray:
        half, mask = np.uint64(self._half), np.uint64(self._mask)
        left, right = x >> half, x & mask
        for k in self._keys:
            left, right = right, left ^ (_splitmix_array(np.uint64(k) ^ right) & mask)
        return (left << half) | right

    def block(self, start: int, stop: int) -> np.ndarray:
        """``[perm(i) for i in range(start, stop)]`` as an int64 array, in numpy."""
        if not 0 <= start <= stop <= self.n:
            raise IndexError(f"block [{start}, {stop}) outside range({self.n})")
        x = self._encrypt_array(np.arange(start, stop, dtype=np.uint64))
        outside = np.flatnonzero(x >= np.uint64(self.n))
        while outside.size:
            x[outside] = self._encrypt_array(x[outside])
            outside = outside[x[outside] >= np.uint64(self.n)]
        return x.astype(np.int64)


class Concatenation:
    """Datasets end to end: global document ``g`` is ``(dataset, local index)``."""

    def __init__(self, sizes: Sequence[int]):
        self.sizes = [int(s) for s in sizes]
        self.starts = [0]
        for s in self.sizes:
            self.starts.append(self.starts[-1] + s)
        self.total = self.starts[-1]

    def locate(self, g: int) -> tuple[int, int]:
        # The last dataset starting at or before g: never an empty one (it shares its
        # start with the next dataset, which bisect_right prefers).
        d = bisect.bisect_right(self.starts, g) - 1
        return d, g - self.starts[d]

    def locate_many(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`locate` of every global index in ``g``: (datasets, local indices)."""
        starts = np.asarray(self.starts, dtype=np.int64)
        d = np.searchsorted(starts, g, side="right") - 1
        return d, g - starts[d]


class BlockCache:
    """The values of ``fill(key, start, stop)`` for one block of ``BLOCK`` positions at a
    time: ``get(key, position, end)`` recomputes the block starting at ``position``
    (up to ``end``) when ``key`` changed or ``position`` lies outside the cached block."""

    def __init__(self, fill: Callable[[Any, int, int], Any]):
        self.fill = fill
        self.key: Any = None
        self.start = 0
        self.stop = 0
        self.values: Any = None

    def get(self, key: Any, position: int, end: int) -> tuple[Any, int]:
        """(the cached arrays, the offset of ``position`` in them)."""
        if key != self.key or not self.start <= position < self.stop:
            self.key, self.start, self.stop = key, position, min(position + BLOCK, end)
            self.values = self.fill(key, self.start, self.stop)
        return self.values, position - self.start


def sizes_of(lengths: Sequence[Any]) -> list[int]:
    """Document counts of the datasets, checked: a list of at least one array and
    at least one document in all."""
    if len(lengths) == 0:
        raise ValueError("no datasets: give at least one path")
    sizes = [len(x) for x in lengths]
    if sum(sizes) == 0:
        raise ValueError("the datasets hold no documents")
    return sizes


def epoch_key(seed: int, stream: int, epoch: int) -> int:
    """The permutation key of one epoch of one stream (a dataset, or all of them)."""
    return hash64(seed, stream, epoch)


def check_state(state: Any, keys: Sequence[str], name: str) -> None:
    if not isinstance(state, dict) or any(k not in state for k in keys):
        raise ValueError(f"not a {name!r} strategy state: expected the keys {list(keys)}, got {state!r}")
