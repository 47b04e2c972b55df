"""``[cluster] launcher = "ray"``: the engine in a Ray actor (imports ray only when used).

The driver process keeps the dataset, the algorithm and the backend; the actor builds
its own copy of the model from the same family plugin and seed, starts the engine and
the weight transport's receiver, and answers ``generate`` with the RolloutBatch's numpy
arrays (``RolloutBatch.to_arrays``): they travel through Ray's object store and come
back to the driver as zero-copy, read-only numpy views. Weights move only through the
job's weight transport (``delta`` through its URL, ``broadcast`` over a gloo/NCCL group
between the driver and the actor), never through Ray.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Mapping, Sequence

from skyrl_host.errors import UserError


class EngineWorker:
    """The actor's class (wrapped with ``ray.remote`` by :func:`start_engine_actor`)."""

    def __init__(self, choices: Mapping[str, Any], alphabet: str | None, seed: int, threads: int | None):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.family = choices["model"].create()
        self.loaded = self.family.load(alphabet=alphabet, seed=seed)
        self.sampler = choices["sampler"].create()
        self.engine = choices["engine"].create()
        self.engine.start(self.loaded)
        self.transport = choices["weight_sync"].create()
        self.receiver: Any = None

    def ready(self) -> str:
        return socket.gethostname()

    def init_receiver(self, group_address: str | None = None) -> None:
        context: dict[str, Any] = {}
        if group_address is not None:
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=group_address, rank=1, world_size=2)
            context = {"src": 0}
        self.receiver = self.transport.receiver(**context)

    def sync(self, version: int) -> Mapping[str, float]:
        kwargs = {} if getattr(self.transport, "collective", False) else {"target": version}
        return self.receiver.sync(self.engine, **kwargs)

    def generate(self, prompts: Sequence[Sequence[int]], n: int, max_new_tokens: int, seed: int,
                 group_offset: int) -> Mapping[str, Any]:
        batch = self.engine.generate(prompts, n=n, sampler=self.sampler, max_new_tokens=max_new_tokens, seed=seed,
                                     group_offset=group_offset)
        return dict(batch.to_arrays())

    def weight_version(self) -> int:
        return int(self.engine.weight_version)


class RemoteEngine:
    """The driver's handle on the actor: the parts of the Engine protocol the driver uses."""

    def __init__(self, actor: Any):
        self.actor = actor

    @property
    def weight_version(self) -> int:
        import ray

        return ray.get(self.actor.weight_version.remote())

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, sampler: Any, max_new_tokens: int, seed: int,
                 group_offset: int = 0) -> Any:
        import ray

        from skyrl_host.rollout import RolloutBatch

        arrays = ray.get(self.actor.generate.remote([list(p) for p in prompts], n, max_new_tokens, seed, group_offset))
        return RolloutBatch.from_arrays(arrays)


class RaySync:
    """The weight transport between the driver (sender) and the actor (receiver)."""

    def __init__(self, transport: Any, actor: Any):
        import ray

        self.transport, self.actor = transport, actor
        self.collective = bool(getattr(transport, "collective", False))
        if self.collective:
            import torch.distributed as dist

            address = f"tcp://{ray.util.get_node_ip_address()}:{_free_port()}"
            pending = actor.init_receiver.remote(address)
            dist.init_process_group("gloo", init_method=address, rank=0, world_size=2)
            ray.get(pending)
            self.sender = transport.sender(src=0)
        else:
            ray.get(actor.init_receiver.remote())
            self.sender = transport.sender()

    def publish(self, backend: Any, version: int) -> dict[str, float]:
        import ray

        if self.collective:  # both sides in the same collectives
            pending = self.actor.sync.remote(version)
            stats = dict(self.sender.publish(version, backend.named_weights()))
            stats.update(ray.get(pending))
        else:  # written first, then read
            stats = dict(self.sender.publish(version, backend.named_weights()))
            stats.update(ray.get(self.actor.sync.remote(version)))
        return stats

    def close(self) -> None:
        if self.collective:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def start_ray(cluster: Any) -> bool:
    """Connect to ``cluster.address`` or start a local Ray; True when this process started it."""
    try:
        import ray
    except ImportError:
        raise UserError('[cluster] launcher = "ray" needs Ray: pip install "ray>=2.60"') from None
    if ray.is_initialized():
        return False
    if cluster.address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster of this job
    ray.init(address=cluster.address, num_cpus=cluster.num_cpus, num_gpus=cluster.num_gpus,
             include_dashboard=False, log_to_driver=True, configure_logging=False)
    return True


def start_engine_actor(choices: Mapping[str, Any], alphabet: str | None, seed: int, threads: int | None) -> Any:
    import ray

    actor_cls = ray.remote(num_cpus=1)(EngineWorker)
    actor = actor_cls.remote(dict(choices), alphabet, seed, threads)
    ray.get(actor.ready.remote())
    return actor
