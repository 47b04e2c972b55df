"""``transport = "inproc"``: the engine and the backend share one process.

The engine takes the trainer's tensors directly: where both hold the same
tensors (same dtype, same device) nothing is copied at all; otherwise each
parameter is copied in place into the engine's preallocated storage. The
engine applies the whole set or nothing, then reports the new version.

With a LoRA backend (``adapter_config()`` not None) and an engine that takes adapters
(``update_adapter``), only the adapters are handed over: the engine copies them and
keeps serving its frozen base (merged weights would otherwise be written into a base
the engine may share with the trainer).
With a quantized ``[precision]`` an engine with its own copy gets what the backend
serves (``serving_weights``: quantized payloads + scales, which the engine
dequantizes); an engine sharing the trainer's tensors shares its fake-quantized
forward too.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from skyrl_host import hookimpl
from skyrl_host.contracts import has, shares_trainer_tensors
from skyrl_host.interfaces import AdapterServing, AdapterTraining, UpdateStats
from skyrl_weightsync import weights_to_serve


class Inproc:
    def __init__(self, config: Any = None):
        self.config = config

    def publish(self, backend: Any, engine: Any, version: int) -> Mapping[str, float]:
        start = time.perf_counter()
        adapter = backend.adapter_config() if has(backend, AdapterTraining) else None
        if adapter is not None and has(engine, AdapterServing):
            # A LoRA backend: the engine serves the frozen base (possibly the very same tensors)
            # plus a copy of the adapters; merged weights must never be written into a shared base.
            engine.update_adapter(backend.named_adapters(), adapter, version)
        elif shares_trainer_tensors(engine, backend):
            engine.update_weights(backend.named_weights(), version)  # the same tensors: nothing moves
        else:  # with a quantized precision: the payloads and scales the trainer's forward used
            engine.update_weights(weights_to_serve(backend), version)
        stats = (engine.last_update or {}) if has(engine, UpdateStats) else {}
        return {
            "sync_seconds": time.perf_counter() - start,
            "sync_bytes_copied": float(stats.get("bytes", 0)),
            "sync_tensors_shared": float(stats.get("shared", 0)),
            "sync_tensors_copied": float(stats.get("copied", 0)),
        }


def check(spec: Any) -> list[tuple[str, str]]:
    if spec.cluster.launcher != "local":
        return [("weight_sync.transport" if "weight_sync" in spec.raw else "cluster.launcher",
                 f"transport 'inproc' hands tensors over within one process, but [cluster] launcher = "
                 f"{spec.cluster.launcher!r} runs the engine in a process of its own: use transport = \"delta\" "
                 "or \"broadcast\"")]
    return []


@hookimpl
def skyrl_register_weight_transports(register: Any) -> None:
    register(
        "inproc",
        Inproc,
        description="Engine and trainer in one process: shared tensors, or in-place copies",
        check=check,
    )
