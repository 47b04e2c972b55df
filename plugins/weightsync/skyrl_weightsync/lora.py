"""``transport = "lora"``: only the LoRA adapter tensors move, in memory, never to disk.

For backends trained with ``[backend] lora_rank > 0``: the engine keeps its own copy
of the frozen base weights and receives only the adapters (``backend.named_adapters()``
and ``backend.adapter_config()``), which it swaps in atomically
(``engine.update_adapter``): a generate call in flight finishes on the adapter it
started with.

Halves, for launchers that run the engine in a process of its own
(``carries_payload = True``: the payload travels with the call, e.g. through Ray's
object store):

- ``transport.sender().publish(version, backend) -> (stats, payload)``: the payload is a
  picklable dict ``{"format", "version", "config", "tensors", "checksums"}`` whose
  ``tensors`` are contiguous float32 numpy arrays (zero-copy through Ray's object store)
  and ``checksums`` one xxHash3-64 of each tensor's bytes, computed by the sender;
- ``transport.receiver().sync(engine, target=version, payload=payload) -> stats``:
  checks the version, the names and shapes against the engine's adapter slots and every
  checksum, then hands the adapters to ``engine.update_adapter``. On any mismatch it
  raises :class:`LoraSyncError` naming the version (and the tensor) and the engine keeps
  its last adapter.

``publish(backend, engine, version)`` runs both halves in one process
(``launcher = "local"``). See docs/weightsync.md.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from skyrl_host import hookimpl
from skyrl_host.contracts import has, require
from skyrl_host.interfaces import AdapterServing, AdapterTraining

PAYLOAD_FORMAT = 1
# The engines known to serve adapters (the AdapterServing capability), checked by name at
# `skyrl validate` time, before any engine exists.
ADAPTER_ENGINES = ("embedded", "vllm")


class LoraSyncError(RuntimeError):
    """An adapter version that cannot be applied; the engine keeps its last one."""


def _checksum(array: Any) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(memoryview(array).cast("B"))


class LoraSender:
    """The trainer's half: copies the backend's adapters into a payload."""

    def publish(self, version: int, backend: Any) -> tuple[dict[str, float], dict[str, Any]]:
        import numpy as np
        import torch

        start = time.perf_counter()
        config = backend.adapter_config() if has(backend, AdapterTraining) else None
        if config is None:
            raise LoraSyncError(
                f"version {version}: the backend trains no LoRA adapters ([backend] lora_rank = 0); "
                "the lora transport moves adapters only"
            )
        tensors: dict[str, Any] = {}
        checksums: dict[str, str] = {}
        nbytes = 0
        for name, tensor in backend.named_adapters():
            array = np.ascontiguousarray(tensor.detach().to("cpu", torch.float32).numpy()).copy()
            tensors[name] = array
            checksums[name] = _checksum(array)
            nbytes += array.nbytes
        payload = {
            "format": PAYLOAD_FORMAT,
            "version": int(version),
            "config": {"rank": int(config["rank"]), "alpha": float(config["alpha"]), "targets": list(config["targets"])},
            "tensors": tensors,
            "checksums": checksums,
        }
        stats = {
            "sync_bytes": float(nbytes),
            "sync_tensors": float(len(tensors)),
            "sync_encode_seconds": time.perf_counter() - start,
        }
        return stats, payload


class LoraReceiver:
    """The engine's half: verifies a payload and applies it atomically."""

    def __init__(self) -> None:
        self.version: int | None = None  # the last version applied

    def verify(self, engine: Any, payload: Any, target: int | None = None) -> tuple[int, dict[str, Any], dict[str, Any]]:
        """(version, config, tensors) of a payload that fits ``engine``; raises
        :class:`LoraSyncError` otherwise (nothing is applied)."""
        import numpy as np

        want = "?" if target is None else target
        if not isinstance(payload, Mapping) or payload.get("format") != PAYLOAD_FORMAT:
            raise LoraSyncError(f"version {want}: not a lora payload (format {PAYLOAD_FORMAT} expected)")
        version = payload.get("version")
        if target is not None and version != target:
            raise LoraSyncError(f"version {target}: the payload carries version {version!r}")
        if self.version is not None and isinstance(version, int) and version < self.version:
            raise LoraSyncError(f"version {version}: older than the version already applied ({self.version})")
        config, tensors, checksums = payload.get("config"), payload.get("tensors"), payload.get("checksums")
        if not isinstance(config, Mapping) or not isinstance(tensors, Mapping) or not isinstance(checksums, Mapping):
            raise LoraSyncError(f"version {version}: the payload lacks config, tensors or checksums")
        try:
            slots = engine.adapter_slots(config)
        except ValueError as exc:
            raise LoraSyncError(f"version {version}: {exc}") from None
        for name in tensors:
            if name not in slots:
                raise LoraSyncError(f"version {version}: tensor {name!r} has no adapter slot in the engine's model")
        for name, shape in slots.items():
            array = tensors.get(name)
            if array is None:
                raise LoraSyncError(f"version {version}: tensor {name!r} is missing from the payload")
            if not isinstance(array, np.ndarray) or array.dtype != np.float32 or tuple(array.shape) != tuple(shape):
                got = (getattr(array, "dtype", type(array).__name__), tuple(getattr(array, "shape", ())))
                raise LoraSyncError(
                    f"version {version}: tensor {name!r} is {got[0]} {got[1]}, expected float32 {tuple(shape)}"
                )
            if _checksum(np.ascontiguousarray(array)) != checksums.get(name):
                raise LoraSyncError(f"version {version}: tensor {name!r} fails its checksum")
        return int(version), dict(config), dict(tensors)

    def sync(self, engine: Any, target: int | None = None, payload: Any = None) -> dict[str, float]:
        start = time.perf_counter()
        version, config, tensors = self.verify(engine, payload, target)
        try:
            engine.update_adapter(tensors.items(), config, version)
        except ValueError as exc:
            raise LoraSyncError(f"version {version}: the engine refused the adapter: {exc}") from None
        self.version = version
        return {
            "sync_version": float(version),
            "sync_bytes": float(sum(a.nbytes for a in tensors.values())),
            "sync_apply_seconds": time.perf_counter() - start,
        }


class Lora:
    """The ``lora`` transport (see the module docstring)."""

    collective = False
    rendezvous = False
    carries_payload = True  # the sender's payload travels to the receiver with the call (no shared storage)

    def __init__(self, config: Any = None):
        self.config = config
        self._receivers: dict[int, LoraReceiver] = {}

    def sender(self, **_context: Any) -> LoraSender:
        return LoraSender()

    def receiver(self, **_context: Any) -> LoraReceiver:
        return LoraReceiver()

    def publish(self, backend: Any, engine: Any, version: int) -> Mapping[str, float]:
        """Both halves in one process: the adapters are copied (never shared with the
        trainer, which keeps training them) and applied to the engine."""
        start = time.perf_counter()
        require(engine, AdapterServing, who=f"the engine ({type(engine).__name__})", needed_by="transport 'lora'")
        stats, payload = self.sender().publish(version, backend)
        receiver = self._receivers.setdefault(id(engine), LoraReceiver())
        applied = receiver.sync(engine, target=version, payload=payload)
        out = dict(stats)
        out.update(applied)
        out["sync_seconds"] = time.perf_counter() - start
        return out


def check(spec: Any) -> list[tuple[str, str]]:
    """Job-level check: adapters need a backend that trains them and an engine that takes them."""
    backend, engine = spec.plugins.get("backend"), spec.plugins.get("engine")
    problems: list[tuple[str, str]] = []
    if backend is not None:
        rank = backend.traits.adapter_rank
        option = backend.traits.switches.get("adapter_rank", "its adapter rank")
        if rank is None:
            problems.append(("weight_sync.transport", f"transport 'lora' moves LoRA adapters, but backend "
                             f"{backend.name!r} trains none (it declares no adapter rank)"))
        elif rank == 0:
            problems.append(("weight_sync.transport", f"transport 'lora' moves LoRA adapters only, but [backend] "
                             f"{option} = 0 trains every weight: set [backend] {option} > 0 (e.g. 8), or use "
                             "another transport (inproc, delta, broadcast) for full fine-tuning"))
    if engine is not None and engine.name not in ADAPTER_ENGINES:
        problems.append(("weight_sync.transport", f"transport 'lora' hands adapters to engine.update_adapter, "
                         f"which [engine] name = {engine.name!r} does not offer yet: use the \"embedded\" or the "
                         "\"vllm\" engine"))
    return problems


@hookimpl
def skyrl_register_weight_transports(register: Any) -> None:
    register(
        "lora",
        Lora,
        description="LoRA adapters only, in memory, checksummed; the engine swaps the active adapter atomically",
        check=check,
    )
