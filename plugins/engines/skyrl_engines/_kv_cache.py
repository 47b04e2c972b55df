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
