"""``[cluster] launcher = "ray"``: the backend's ranks and the engine's replicas in Ray
actors, in placement groups (imports ray only when a job is placed).

The driver keeps the dataset, the algorithm (for advantages) and the tokenizer; each
actor builds its own copy of the model from the same family plugin and seed. The
``[cluster] trainer_ranks`` backend actors share one placement group and one
``torch.distributed`` group (gloo on CPU, NCCL on GPU) in which the backend runs data
parallel; the ``engine_replicas`` engine actors share another. Batches travel through
Ray's object store as numpy arrays (zero-copy, read-only views); weights only through
the job's weight transport (which must have halves for separate processes: the
SplitTransport capability). See :mod:`skyrl_launchers._ray_actors`.
"""

from __future__ import annotations

from typing import Any

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import gt, option


def _resources(_inst: Any, _attr: Any, value: dict[str, float]) -> None:
    for name, amount in value.items():
        if name in ("CPU", "GPU", "memory", "object_store_memory"):
            raise ValueError(f"{name!r} is Ray's own resource; custom resources only (CPUs: cpus_per_actor)")
        if not amount > 0:
            raise ValueError(f"{name} = {amount!r}: expected an amount > 0")


@attrs.frozen
class RayConfig:
    """The ray launcher's keys of ``[cluster]``."""

    address: str | None = option(None, help="address of a running Ray cluster: 'auto' (the one `ray start` made "
                                 "on this machine) or host:port (default: start one of the job's own)")
    cpus_per_actor: float = option(1.0, help="CPUs each actor's placement-group bundle asks Ray for", validator=gt(0))
    trainer_resources: dict[str, float] = option(
        factory=dict, help="custom Ray resources each backend rank's bundle also asks for, e.g. {trainer_node = 1}: "
        "only nodes started with them (ray start --resources) take the ranks", validator=_resources)
    engine_resources: dict[str, float] = option(
        factory=dict, help="custom Ray resources each engine replica's bundle also asks for", validator=_resources)
    teacher_resources: dict[str, float] = option(
        factory=dict, help="custom Ray resources the [teacher]'s actor's bundle also asks for", validator=_resources)


class RayLauncher:
    """A :class:`skyrl_host.interfaces.Launcher` placing every rank and replica in a Ray actor."""

    def __init__(self, config: RayConfig, cluster: Any):
        self.config, self.cluster = config, cluster

    def place(self, request: Any) -> Any:
        from skyrl_launchers._ray_actors import place

        return place(request, self.cluster, self.config)


@hookimpl
def skyrl_register_launchers(register: Any) -> None:
    register(
        "ray",
        RayLauncher,
        config=RayConfig,
        description="Backend ranks and engine replicas as Ray actors in placement groups",
    )
