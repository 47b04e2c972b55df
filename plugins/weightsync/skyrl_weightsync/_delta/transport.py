"""The ``delta`` transport the plugin creates (:func:`skyrl_weightsync.delta.create`):
a :class:`DeltaSender` and a :class:`DeltaReceiver` over one URL."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping

from skyrl_host.contracts import receives_in_workers, shares_trainer_tensors
from skyrl_weightsync import weights_to_serve

from .receiver import DeltaReceiver
from .sender import DeltaSender


class Delta:
    """The ``delta`` transport: a sender and a receiver over one URL."""

    collective = False  # the receiver reads what the sender wrote: publish first, then sync
    rendezvous = False
    carries_payload = False

    def __init__(self, config: Any):
        self.config = config
        self._sender: DeltaSender | None = None
        self._receiver: DeltaReceiver | None = None
        self._prefetching: int | None = None  # the version stage() is fetching
        self._staging: tuple[int, Future] | None = None  # (version, its write then fetch), from stage()
        self._background: ThreadPoolExecutor | None = None

    def writes_in_background(self, backend: Any) -> bool:
        """``background``: on, off, or (auto) when the trainer computes on an accelerator."""
        if self.config.background != "auto":
            return self.config.background == "on"
        return str(getattr(backend, "device", "cpu")).split(":")[0] != "cpu"

    def sender(self, **_context: Any) -> DeltaSender:
        c = self.config
        return DeltaSender(c.uri, storage_options=c.storage_options, dtype=c.dtype,
                           keyframe_every=c.keyframe_every, level=c.level, threads=c.threads)

    def receiver(self, **_context: Any) -> DeltaReceiver:
        return DeltaReceiver(self.config.uri, storage_options=self.config.storage_options,
                             max_bytes=self.config.max_bytes)

    def publish(self, backend: Any, engine: Any, version: int) -> Mapping[str, float]:
        """One process: publish the backend's weights, then bring the engine up to date."""
        stats = self.stage(backend, engine, version, prefetch=False)
        stats.update(self._receiver.sync(engine, version))
        return stats

    def stage(self, backend: Any, engine: Any, version: int, prefetch: bool = True) -> dict[str, float]:
        """StagedTransport: publish ``version`` and fetch and verify it in a background
        thread while the engine keeps generating (``commit`` applies it); with
        ``background`` the publish too, from a snapshot, while the trainer trains on.
        ``prefetch=False``: publish now, in this thread, and fetch nothing (:meth:`publish`
        receives next)."""
        if shares_trainer_tensors(engine, backend) and self.config.dtype != _param_dtype(backend):
            raise ValueError(
                f"the delta transport ships weights as {self.config.dtype}, but the engine shares the trainer's "
                f"tensors ({_param_dtype(backend)}), so applying them would overwrite the trainer's weights: "
                f"set engine.dtype = \"{self.config.dtype}\" (the engine then keeps its own copy)"
            )
        if self._sender is None:
            self._sender, self._receiver = self.sender(), self.receiver()
        if not prefetch:  # publish(): written before the receive that follows
            return dict(self._sender.publish(version, weights_to_serve(backend)))
        if self.writes_in_background(backend):  # a snapshot now; encoded and written while the trainer trains on
            t0 = time.perf_counter()
            written = self._sender.publish_in_background(version, weights_to_serve(backend))
            stats = {"sync_version": float(version), "sync_snapshot_s": time.perf_counter() - t0}
        else:  # written now
            stats = dict(self._sender.publish(version, weights_to_serve(backend)))
            written = Future()
            written.set_result({})
        # Fetched (and verified) in the background while the engine generates; commit() waits for it.
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix="delta-stage")
        self._staging = (version, self._background.submit(self._fetch_when_written, written, engine, version))
        return stats

    def _fetch_when_written(self, written: Future, engine: Any, version: int) -> dict[str, float]:
        stats = dict(written.result())
        if receives_in_workers(engine):  # the workers fetch it themselves, still generating
            engine.fetch_in_workers(self._receiver.worker_recipe(), version)
        else:
            self._receiver.fetch(version)
            self._prefetching = version
        return stats

    def commit(self, engine: Any, version: int) -> dict[str, float]:
        """Apply the staged ``version``, once written and fetched: the engine pauses for
        what of that is left and the apply (``sync_pause_s``). Returns the writing's
        metrics and the receiving's."""
        t0 = time.perf_counter()
        stats: dict[str, float] = {}
        if self._staging is not None and self._staging[0] == version:
            staging, self._staging = self._staging[1], None
            stats.update(staging.result())  # the sender's or the fetch's error, raised here
        if self._prefetching == version:
            self._prefetching = None
            stats.update(self._receiver.apply(engine))
        else:  # an engine whose workers receive weights themselves: they fetched it (or fetch it now), then apply
            stats.update(self._receiver.sync(engine, version))
        stats["sync_pause_s"] = time.perf_counter() - t0
        return stats


def _param_dtype(backend: Any) -> str:
    for _, t in backend.named_weights():
        if t.is_floating_point():
            return str(t.dtype).removeprefix("torch.")
    return "float32"
