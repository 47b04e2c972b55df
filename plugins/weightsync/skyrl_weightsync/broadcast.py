"""``transport = "broadcast"``: torch.distributed broadcast from the trainer's rank to the
engine processes, in reused flat buckets (NCCL only when the sender and every receiver
are on CUDA, gloo otherwise: the launcher decides once for the whole group).

The halves (:mod:`skyrl_weightsync._broadcast`): ``BroadcastSender.publish(version,
named_tensors)`` on the trainer's rank, ``BroadcastReceiver.sync(engine)`` in each engine
process, over a process group the launcher created. The engine gets the complete set
only once every bucket arrived. A one-process job has no engine process to broadcast to:
``skyrl validate`` says so (``[cluster] launcher = "ray"`` runs the engine apart).
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


class Broadcast:
    collective = True  # sender and receivers take part in the same collectives: start the receiver first
    rendezvous = False
    carries_payload = False

    def __init__(self, config: BroadcastConfig):
        self.config = config

    def sender(self, *, group: Any = None, src: int = 0, device: Any = None) -> Any:
        """``device``: where the buckets live (None: the weights' own device); the
        launcher passes "cpu" for a gloo group, the backend's device for NCCL."""
        from skyrl_weightsync._broadcast import BroadcastSender

        return BroadcastSender(group=group, src=src, bucket_bytes=self.config.bucket_mb << 20, dtype=self.config.dtype,
                               device=device)

    def receiver(self, *, group: Any = None, src: int = 0, device: Any = "cpu") -> Any:
        """``device``: where the buckets and received tensors live (the engine's device
        under NCCL, "cpu" under gloo)."""
        from skyrl_weightsync._broadcast import BroadcastReceiver

        return BroadcastReceiver(group=group, src=src, bucket_bytes=self.config.bucket_mb << 20, device=device)

    def publish(self, backend: Any, engine: Any, version: int) -> Any:
        raise RuntimeError(
            "the broadcast transport moves weights to engine processes; this job runs the engine in the trainer's "
            "process (use transport = \"inproc\" or \"delta\", or [cluster] launcher = \"ray\")"
        )


def check(spec: Any) -> list[tuple[str, str]]:
    if spec.cluster.launcher == "local":
        return [("weight_sync.transport", "transport 'broadcast' needs the engine in processes of its own; with "
                 "[cluster] launcher = \"local\" it shares the trainer's: use \"inproc\" or \"delta\"")]
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
