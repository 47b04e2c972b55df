"""The embedded engine's KV cache: a transformers ``DynamicCache`` whose attention layers
write into buffers preallocated for a chunk's longest prompt + ``max_new_tokens``.

No concatenation per decode step: each attention layer fills its buffers in place and
hands attention a view of the filled prefix. Other layer kinds (linear attention /
Mamba states) keep transformers' own layers. :func:`select_rows` keeps (or repeats)
batch rows of every layer: the prompts' rows replicated to their samples after the
prefill, finished rows dropped when the batch is compacted.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


def make_cache(config: Any, capacity: int) -> Any:
    """A transformers DynamicCache whose attention layers write into buffers
    preallocated for ``capacity`` tokens (no concatenation per step) and return
    views of the filled part, so attention only covers the tokens written so far.
    Sliding-window layers keep every token too (the mask limits the window).
    Layer kinds it does not know (linear attention, ...) keep transformers' own."""
    cache = DynamicCache(config=config)
    cache.layers = [
        PreallocatedLayer(capacity) if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) else layer
        for layer in cache.layers
    ]
    return cache


class PreallocatedLayer(DynamicLayer):
    """A full-attention cache layer over ``[batch, heads, capacity, dim]`` buffers,
    filled in place; ``keys``/``values`` are views of the filled prefix."""

    is_sliding = False

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        b, h, _, dk = key_states.shape
        self.key_buffer = key_states.new_empty((b, h, self.capacity, dk))
        self.value_buffer = value_states.new_empty((b, value_states.shape[1], self.capacity, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} tokens for a capacity of {self.capacity}")
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.length = end
        self.keys = self.key_buffer[:, :, :end]
        self.values = self.value_buffer[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.key_buffer = self.key_buffer.index_select(0, indices)
            self.value_buffer = self.value_buffer.index_select(0, indices)
            self.keys = self.key_buffer[:, :, : self.length]
            self.values = self.value_buffer[:, :, : self.length]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the embedded engine's cache is never cropped")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_select_indices(
            torch.arange(self.key_buffer.shape[0], device=self.device).repeat_interleave(repeats)
        )

    def reset(self) -> None:
        self.length = 0
        self.keys = self.values = None
        self.is_initialized = False


def select_rows(cache: Any, index: torch.Tensor) -> None:
    """Keep (or repeat) the given batch rows of every cache layer, in that order."""
    for layer in cache.layers:
        if hasattr(layer, "batch_select_indices"):
            layer.batch_select_indices(index)
        elif hasattr(layer, "reorder_cache"):  # linear-attention states: an index_select of each state
            layer.reorder_cache(index)
        else:  # pragma: no cover - a layer kind this engine does not know
            raise NotImplementedError(f"cannot select batch rows of cache layer {type(layer).__name__}")


# -- conversations kept between turns -----------------------------------------------


class TurnCache:
    """The KV of conversations between turns (``continue_turn``), so a turn prefills only
    its new tokens: keyed by the exact token ids fed (a conversation's history but its
    last token), each entry the per-layer keys and values ``[heads, length, dim]`` of
    those tokens. An entry is taken (removed) when its conversation continues; the
    least recently stored go first once more than ``budget`` bytes are held; every
    entry goes when the weights change."""

    def __init__(self, budget: int):
        from collections import OrderedDict

        self.budget = budget
        self.nbytes = 0
        self._entries: "OrderedDict[bytes, tuple[list[torch.Tensor], list[torch.Tensor], int, int]]" = OrderedDict()
        self.hits = self.misses = 0

    @staticmethod
    def key(ids: Any) -> bytes:
        import numpy as np

        return np.asarray(ids, dtype=np.int64).tobytes()

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, ids: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], int] | None:
        """The entry of exactly these fed ids ``(keys, values, length)``, removed; None if absent."""
        entry = self._entries.pop(self.key(ids), None)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self.nbytes -= entry[3]
        return entry[:3]

    def put(self, ids: Any, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        n = int(keys[0].shape[-2]) if keys else 0
        size = sum(t.numel() * t.element_size() for t in (*keys, *values))
        if n == 0 or size > self.budget:
            return
        k = self.key(ids)
        old = self._entries.pop(k, None)
        if old is not None:
            self.nbytes -= old[3]
        self._entries[k] = (keys, values, n, size)
        self.nbytes += size
        while self.nbytes > self.budget:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old[3]

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0


def reusable_layers(config: Any) -> bool:
    """Whether every cache layer of this model is plain full attention (no sliding
    window, no linear-attention or Mamba state): then a conversation's kept KV can sit
    before its new tokens with a gap of padding between them."""
    cache = DynamicCache(config=config)
    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


def cache_with_prefix(config: Any, capacity: int, kept: list[Any], before: int) -> Any:
    """A :func:`make_cache` cache whose first ``before`` columns hold, right-aligned, the
    kept KV of each row (``kept[i]``: ``(keys, values, length)`` per layer, or None)."""
    cache = make_cache(config, capacity)
    sample = next(e for e in kept if e is not None)
    rows = len(kept)
    for li, layer in enumerate(cache.layers):
        k0, v0 = sample[0][li], sample[1][li]
        layer.device = k0.device
        layer.key_buffer = k0.new_zeros((rows, k0.shape[0], capacity, k0.shape[-1]))
        layer.value_buffer = v0.new_zeros((rows, v0.shape[0], capacity, v0.shape[-1]))
        layer.is_initialized = True
        for i, e in enumerate(kept):
            if e is not None:
                n = e[2]
                layer.key_buffer[i, :, before - n : before] = e[0][li]
                layer.value_buffer[i, :, before - n : before] = e[1][li]
        layer.length = before
        layer.keys = layer.key_buffer[:, :, :before]
        layer.values = layer.value_buffer[:, :, :before]
    return cache


def row_kv(cache: Any, row: int, cols: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copies of one batch row's keys and values at the given cache columns, per layer."""
    keys = [layer.key_buffer[row].index_select(1, cols).clone() for layer in cache.layers]
    values = [layer.value_buffer[row].index_select(1, cols).clone() for layer in cache.layers]
    return keys, values


# -- the continuous batcher's cache: rows that come and go -----------------------------


class SlotLayer(DynamicLayer):
    """A full-attention cache layer over ``[max_rows, heads, capacity, dim]`` buffers in
    which the first ``rows`` rows are live (the continuous batcher's running batch).
    Every live row shares one filled length (rows are left-padded to it; the attention
    mask hides the padding), so a decode forward writes one column for all of them.
    Rows join with :meth:`put_rows`, leave by :meth:`move_rows` (a finished row's slot is
    refilled from the tail), and the filled columns move with :meth:`shift`."""

    is_sliding = False

    def __init__(self, max_rows: int):
        super().__init__()
        self.max_rows = max_rows
        self.capacity = 0
        self.rows = 0
        self.length = 0

    def _views(self) -> None:
        self.keys = self.key_buffer[: self.rows, :, : self.length]
        self.values = self.value_buffer[: self.rows, :, : self.length]

    def reserve(self, capacity: int, like: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Room for ``capacity`` columns (the filled ones kept); ``like``: the key and value
        tensors whose heads, dim and dtype the buffers take, before the first allocation."""
        if self.is_initialized and capacity <= self.capacity:
            return
        if not self.is_initialized:
            k, v = like
            self.device = k.device
            self.key_buffer = k.new_zeros((self.max_rows, k.shape[1], capacity, k.shape[-1]))
            self.value_buffer = v.new_zeros((self.max_rows, v.shape[1], capacity, v.shape[-1]))
            self.is_initialized = True
        else:
            kb, vb = self.key_buffer, self.value_buffer
            self.key_buffer = kb.new_zeros((kb.shape[0], kb.shape[1], capacity, kb.shape[-1]))
            self.value_buffer = vb.new_zeros((vb.shape[0], vb.shape[1], capacity, vb.shape[-1]))
            self.key_buffer[: self.rows, :, : self.length] = kb[: self.rows, :, : self.length]
            self.value_buffer[: self.rows, :, : self.length] = vb[: self.rows, :, : self.length]
        self.capacity = capacity
        self._views()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        rows, start = key_states.shape[0], self.length
        end = start + key_states.shape[-2]
        if rows != self.rows:
            raise RuntimeError(f"a forward of {rows} rows over a cache holding {self.rows}")
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} tokens for a capacity of {self.capacity}")
        self.key_buffer[:rows, :, start:end] = key_states
        self.value_buffer[:rows, :, start:end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def put_rows(self, at: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Rows ``[at, at + len(keys))`` become ``keys``/``values`` (``[k, heads, width,
        dim]``, width <= the filled length), right-aligned to the filled length; the
        columns left of them are zeroed (masked, but never garbage)."""
        k, width = keys.shape[0], keys.shape[-2]
        self.key_buffer[at : at + k, :, : self.length - width] = 0
        self.value_buffer[at : at + k, :, : self.length - width] = 0
        self.key_buffer[at : at + k, :, self.length - width : self.length] = keys
        self.value_buffer[at : at + k, :, self.length - width : self.length] = values
        self.rows = max(self.rows, at + k)
        self._views()

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, rows: int) -> None:
        """Rows ``src`` are copied to slots ``dst`` (disjoint); then ``rows`` rows are live."""
        if src.numel():
            self.key_buffer[dst, :, : self.length] = self.key_buffer[src, :, : self.length]
            self.value_buffer[dst, :, : self.length] = self.value_buffer[src, :, : self.length]
        self.rows = rows
        self._views()

    def shift(self, delta: int) -> None:
        """Move the filled columns of the live rows ``delta`` to the right (zeros come in
        on the left; room must be reserved) or ``-delta`` to the left (dropping the first
        ``-delta`` columns, which no live row may use)."""
        n, r = self.length, self.rows
        if delta > 0:
            for buf in (self.key_buffer, self.value_buffer):
                buf[:r, :, delta : delta + n] = buf[:r, :, :n].clone()
                buf[:r, :, :delta] = 0
        elif delta < 0:
            for buf in (self.key_buffer, self.value_buffer):
                buf[:r, :, : n + delta] = buf[:r, :, -delta:n].clone()
        self.length = n + delta
        self._views()

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the continuous batcher's cache is never cropped")

    def reset(self) -> None:
        self.rows = self.length = 0
        if self.is_initialized:
            self._views()


def slot_cache_supported(config: Any) -> bool:
    """Whether every cache layer of the model is attention (full or sliding-window), the
    kind whose rows can come and go; linear-attention / Mamba states cannot."""
    return all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in DynamicCache(config=config).layers)


def make_slot_cache(config: Any, max_rows: int) -> Any:
    """A DynamicCache of :class:`SlotLayer` s (buffers allocated at the first rows put),
    for a model :func:`slot_cache_supported` accepts (else ValueError)."""
    if not slot_cache_supported(config):
        raise ValueError("continuous batching into a running cache needs attention KV caches only; "
                         "this model has linear-attention or Mamba state layers")
    cache = DynamicCache(config=config)
    cache.layers = [SlotLayer(max_rows) for _ in cache.layers]
    return cache


def slot_layers(cache: Any) -> list[SlotLayer]:
    return list(cache.layers)
