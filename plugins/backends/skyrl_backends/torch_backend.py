"""The torch backend's implementation, for other distributions' code, tests and tools.

Importing this imports torch (unlike ``skyrl_backends.torch``, the registered module,
which only declares the options and the factory). A job gets the backend through the
registry (``[backend] name = "torch"``); these names are for code that needs it
directly:

- :class:`TorchBackend`: a :class:`skyrl_host.interfaces.Backend` (build it from a
  ``skyrl_backends.torch.TorchBackendConfig``);
- :func:`has_recurrent_layers`: whether a model config has layers that carry state
  along the sequence (the backend then packs one sequence per row);
- :func:`pack_groups`, :func:`layout_rows`: how sequences are packed into
  micro-batches and rows; :func:`layout_flat`, :func:`segment_sdpa` and
  ``SEGMENTS_KEY``: a flat row's layout and its attention per group of equal-length
  sequences (``benchmarks/attention_dtype.py``);
- :class:`LrSchedule`: the learning-rate factor of each optimizer update.
"""

from __future__ import annotations

from skyrl_backends._optimizer import LrSchedule
from skyrl_backends._packing import SEGMENTS_KEY, has_recurrent_layers, layout_flat, layout_rows, pack_groups, segment_sdpa
from skyrl_backends._trainer import TorchBackend

__all__ = ["LrSchedule", "SEGMENTS_KEY", "TorchBackend", "has_recurrent_layers", "layout_flat", "layout_rows", "pack_groups",
           "segment_sdpa"]
