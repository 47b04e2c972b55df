"""``transport = "inproc"``: the engine and the backend share one process.

The engine takes the trainer's tensors directly: where both hold the same
tensors (same dtype, same device) nothing is copied at all; otherwise each
parameter is copied in place into the engine's preallocated storage. The
engine applies the whole set or nothing, then reports the new version.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from skyrl_host import hookimpl


class Inproc:
    def __init__(self, config: Any = None):
        self.config = config

    def publish(self, backend: Any, engine: Any, version: int) -> Mapping[str, float]:
        start = time.perf_counter()
        named = list(backend.named_weights())
        shared = copied = 0
        served = dict(engine.named_weights()) if hasattr(engine, "named_weights") else {}
        for name, tensor in named:
            other = served.get(name)
            if other is not None and other.data_ptr() == tensor.data_ptr():
                shared += tensor.numel() * tensor.element_size()
            else:
                copied += tensor.numel() * tensor.element_size()
        engine.update_weights(named, version)
        return {
            "sync_seconds": time.perf_counter() - start,
            "sync_bytes_copied": float(copied),
            "sync_bytes_shared": float(shared),
        }


@hookimpl
def skyrl_register_weight_transports(register: Any) -> None:
    register(
        "inproc",
        Inproc,
        description="Engine and trainer in one process: shared tensors, or in-place copies",
    )
