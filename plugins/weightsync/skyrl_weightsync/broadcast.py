"""``transport = "broadcast"``: torch.distributed broadcast from the trainer's rank to the
engine processes, in reused flat buckets (NCCL only when the sender and every receiver
are on CUDA, gloo otherwise: decided once for the whole group).

The halves (:mod:`skyrl_weightsync._broadcast`): ``BroadcastSender.publish(version,
named_tensors)`` on the trainer's rank, ``BroadcastReceiver.sync(engine)`` in each engine
process, over a weight group (:mod:`skyrl_toolkit.groups`). The engine gets the complete
set only once every bucket arrived.

Where the receivers run:

- the Ray launcher's engine actors (the launcher makes the group: backend rank 0 and
  one member per engine actor);
- an engine's own worker processes, for an engine that receives weights in its workers
  (``vllm``: :class:`skyrl_host.interfaces.WorkerReceiving`): each worker joins the
  group itself, from a recipe, and receives into buffers of its own while its server
  keeps generating; the server pauses only to load them. This also works in one job
  process (``[cluster] launcher = "local"``): the trainer's process is rank 0, the
  vLLM workers 1..n.

A job whose engine shares the trainer's process has no one to broadcast to: ``skyrl
validate`` says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import gt, option
from skyrl_weightsync import lazy_exports


# The transport's halves, for programs that drive them themselves (benchmarks): imported
# on first use (PEP 562), so that discovering this plugin does not import torch.
__getattr__ = lazy_exports(__name__, {
    "BroadcastSender": "skyrl_weightsync._broadcast",
    "BroadcastReceiver": "skyrl_weightsync._broadcast",
})

if TYPE_CHECKING:
    from skyrl_weightsync._broadcast import BroadcastReceiver, BroadcastSender


@attrs.frozen
class BroadcastConfig:
    """Options of ``[weight_sync]`` when ``transport = "broadcast"``."""

    bucket_mb: int = option(64, help="size of the flat buckets the weights travel in (MiB)", validator=gt(0))
    dtype: Literal["bfloat16", "float32"] = option("bfloat16", help="dtype of the weights on the wire")
    timeout_s: float = option(
        300.0, help="how long the group's members wait for each other (joining, and each broadcast) before "
        "giving up", validator=gt(0),
    )

    @property
    def bucket_bytes(self) -> int:
        return self.bucket_mb << 20


class Broadcast:
    collective = True  # sender and receivers take part in the same collectives: start the receiver first
    rendezvous = False
    carries_payload = False

    def __init__(self, config: BroadcastConfig):
        self.config = config
        self._local: tuple[Any, Any, Any] | None = None  # (group, sender, receiver) of a one-process job

    def sender(self, *, group: Any = None, src: int = 0, device: Any = None) -> Any:
        """``device``: where the buckets live (None: the weights' own device); the
        launcher passes "cpu" for a gloo group, the backend's device for NCCL."""
        from skyrl_weightsync._broadcast import BroadcastSender

        return BroadcastSender(group=group, src=src, bucket_bytes=self.config.bucket_bytes, dtype=self.config.dtype,
                               device=device)

    def receiver(self, *, group: Any = None, src: int = 0, device: Any = "cpu", engine: Any = None,
                 members: tuple[str, int, int, str] | None = None) -> Any:
        """``device``: where the buckets and received tensors live (the engine's device
        under NCCL, "cpu" under gloo). ``engine`` + ``members`` (address, first rank,
        world, backend of the group): an engine whose workers receive themselves; they
        join the group now, as ranks ``first rank`` onwards (blocks until the sender
        joins: the launcher joins it meanwhile)."""
        from skyrl_host.contracts import receives_in_workers

        if engine is not None and receives_in_workers(engine):
            if members is None:
                raise ValueError("a broadcast receiver in an engine's workers needs the group's members=")
            from skyrl_weightsync._workers import InWorkers

            return InWorkers(engine, self.worker_recipe(*members), join=True)
        from skyrl_weightsync._broadcast import BroadcastReceiver

        return BroadcastReceiver(group=group, src=src, bucket_bytes=self.config.bucket_bytes, device=device,
                                 timeout_s=self.config.timeout_s)

    def worker_recipe(self, address: str, rank: int, world: int, backend: str) -> dict[str, Any]:
        """How an engine's workers build their receivers (WorkerReceiving): members of the
        group at ``address`` from ``rank`` on."""
        return {"receiver": "broadcast",
                "kwargs": {"src": 0, "bucket_bytes": self.config.bucket_bytes, "timeout_s": self.config.timeout_s},
                "group": {"address": address, "rank": int(rank), "world": int(world), "backend": backend}}

    def publish(self, backend: Any, engine: Any, version: int) -> Any:
        """One job process: the trainer's process is rank 0 of a group with the engine's
        workers (an engine that receives in its workers; anything else shares the
        trainer's process and has no one to broadcast to)."""
        from skyrl_host.contracts import receives_in_workers
        from skyrl_weightsync import weights_to_serve
        from skyrl_weightsync._workers import InWorkers, together

        if not receives_in_workers(engine):
            raise RuntimeError(
                "the broadcast transport moves weights to engine processes; this job runs the engine in the trainer's "
                "process (use transport = \"inproc\" or \"delta\", or [cluster] launcher = \"ray\")"
            )
        if self._local is None:
            from skyrl_toolkit.groups import comm_device, free_address, group_backend, weight_group

            trainer_device = str(getattr(backend, "device", "cpu"))
            kind = group_backend([trainer_device, str(engine.device)])
            address, world = free_address(), 1 + int(engine.worker_ranks())
            recipe = self.worker_recipe(address, 1, world, kind)
            group, receiver = together(lambda: weight_group(address, 0, world, self.config.timeout_s, kind),
                                       lambda: InWorkers(engine, recipe, join=True))
            self._local = (group, self.sender(group=group, src=0, device=comm_device(trainer_device, kind)), receiver)
        _group, sender, receiver = self._local
        try:
            sent, received = together(lambda: sender.publish(version, weights_to_serve(backend)),
                                      lambda: receiver.sync(engine, version))
        except BaseException:
            # A failed broadcast leaves the group unusable (the other half may still be waiting
            # in it, until its timeout): the next version makes a new one.
            self._local = None
            raise
        return {**dict(sent), **dict(received)}

    def close(self) -> None:
        """Leave the group of a one-process job."""
        if self._local is not None:
            from skyrl_toolkit.groups import destroy_group

            destroy_group(self._local[0])
            self._local = None


def check(spec: Any) -> list[tuple[str, str]]:
    engine = spec.plugins.get("engine")
    workers = bool(getattr(getattr(engine, "config", None), "receives_in_workers", False))
    if spec.cluster.launcher == "local" and not workers:
        return [("weight_sync.transport", "transport 'broadcast' needs the engine in processes of its own; with "
                 "[cluster] launcher = \"local\" it shares the trainer's: use \"inproc\" or \"delta\" (or an engine "
                 "whose workers receive weights, such as vllm's servers)")]
    return []


@hookimpl
def skyrl_register_weight_transports(register: Any) -> None:
    register(
        "broadcast",
        Broadcast,
        config=BroadcastConfig,
        description="torch.distributed broadcast from the trainer to the engine processes, in reused buckets",
        check=check,
    )
