"""``[cluster] launcher = "ray"``: the engine and the backend in Ray actors (imports ray
only when used).

The driver process keeps the dataset, the algorithm (for advantages) and the
tokenizer. Each actor builds its own copy of the model from the same family plugin and
seed, in a placement group of its own (one CPU, or one GPU when the cluster has them):

- the **engine actor** starts the engine and the weight transport's receiver and answers
  ``generate`` with the RolloutBatch's numpy arrays (``RolloutBatch.to_arrays``), which
  travel through Ray's object store and reach the driver as zero-copy, read-only views;
- the **backend actor** starts the backend (with the job's replay strategies) and the
  transport's sender, trains on the batches the driver hands it (again numpy arrays
  through the object store) and publishes each version.

Weights move only through the job's weight transport (``delta`` through its URL,
``broadcast`` over a gloo group between the two actors), never through Ray.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Mapping, Sequence

from skyrl_host.errors import UserError


class EngineWorker:
    """The engine's actor (wrapped with ``ray.remote`` by :func:`start_actor`)."""

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


class BackendWorker:
    """The backend's actor (wrapped with ``ray.remote`` by :func:`start_actor`)."""

    def __init__(self, choices: Mapping[str, Any], alphabet: str | None, seed: int, threads: int | None,
                 total_steps: int):
        import torch

        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)  # as the one-process driver does before starting the backend
        self.family = choices["model"].create()
        self.loaded = self.family.load(alphabet=alphabet, seed=seed)
        self.algorithm = choices["algorithm"].create()
        self.backend = choices["backend"].create()
        replay = [c.create() for c in choices["replay"]]
        self.backend.start(self.loaded, seed=seed, total_steps=total_steps,
                           reference=bool(self.algorithm.needs_reference), **({"replay": replay} if replay else {}))
        self.transport = choices["weight_sync"].create()
        self.sender: Any = None

    def ready(self) -> str:
        return socket.gethostname()

    def init_sender(self, group_address: str | None = None) -> None:
        if group_address is not None:
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=group_address, rank=0, world_size=2)
            self.sender = self.transport.sender(src=0)
        else:
            self.sender = self.transport.sender()

    def publish(self, version: int) -> Mapping[str, float]:
        return self.sender.publish(version, self.backend.named_weights())

    def train_step(self, arrays: Mapping[str, Any], advantages: Any, temperature: float,
                   max_new_tokens: int) -> Mapping[str, float]:
        from skyrl_host.rollout import RolloutBatch

        return self.backend.train_step(RolloutBatch.from_arrays(arrays), advantages, self.algorithm,
                                       temperature=temperature, max_new_tokens=max_new_tokens)

    def reference_logprobs(self, arrays: Mapping[str, Any], temperature: float) -> Any:
        from skyrl_host.rollout import RolloutBatch

        return self.backend.reference_logprobs(RolloutBatch.from_arrays(arrays), temperature=temperature)

    def state_dict(self) -> Any:
        return self.backend.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.backend.load_state_dict(state)

    def save_final(self, path: str) -> None:
        import torch

        trained = dict(self.backend.named_weights())
        with torch.no_grad():
            for name, param in self.loaded.model.state_dict().items():
                if name in trained and trained[name].data_ptr() != param.data_ptr():
                    param.copy_(trained[name])
        self.family.save(self.loaded, path)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class RemoteBackend:
    """The driver's handle on the backend actor: the Backend protocol's calls the driver makes."""

    def __init__(self, actor: Any):
        self.actor = actor

    def train_step(self, batch: Any, advantages: Any, algorithm: Any, *, temperature: float,
                   max_new_tokens: int) -> Mapping[str, float]:
        import ray

        return ray.get(self.actor.train_step.remote(dict(batch.to_arrays()), advantages, temperature, max_new_tokens))

    def reference_logprobs(self, batch: Any, *, temperature: float) -> Any:
        import ray

        return ray.get(self.actor.reference_logprobs.remote(dict(batch.to_arrays()), temperature))

    def state_dict(self) -> Any:
        import ray

        return ray.get(self.actor.state_dict.remote())

    def load_state_dict(self, state: Any) -> None:
        import ray

        ray.get(self.actor.load_state_dict.remote(state))


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
    """The weight transport between the backend actor (sender) and the engine actor (receiver)."""

    def __init__(self, transport: Any, backend_actor: Any, engine_actor: Any):
        import ray

        self.backend_actor, self.engine_actor = backend_actor, engine_actor
        self.collective = bool(getattr(transport, "collective", False))
        if self.collective:
            address = f"tcp://{ray.util.get_node_ip_address()}:{_free_port()}"
            ray.get([engine_actor.init_receiver.remote(address), backend_actor.init_sender.remote(address)])
        else:
            ray.get([engine_actor.init_receiver.remote(), backend_actor.init_sender.remote()])

    def publish(self, version: int) -> dict[str, float]:
        import ray

        if self.collective:  # both sides in the same collectives
            sent, received = ray.get([self.backend_actor.publish.remote(version), self.engine_actor.sync.remote(version)])
            stats = dict(sent)
            stats.update(received)
        else:  # written first, then read
            stats = dict(ray.get(self.backend_actor.publish.remote(version)))
            stats.update(ray.get(self.engine_actor.sync.remote(version)))
        return stats

    def close(self) -> None:
        import ray

        if self.collective:
            ray.get(self.backend_actor.close.remote())


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


def start_actor(worker: type, *args: Any) -> Any:
    """``worker`` as a Ray actor in a placement group of its own (one GPU when the cluster
    has one to give, else one CPU); waits until it is built."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    bundle = {"CPU": 1, **({"GPU": 1} if gpus else {})}
    group = placement_group([bundle])
    ray.get(group.ready())
    actor_cls = ray.remote(num_cpus=1, num_gpus=gpus)(worker)
    actor = actor_cls.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=0)
    ).remote(*args)
    ray.get(actor.ready.remote())
    _STARTED.append((actor, group))
    return actor


_STARTED: list[tuple[Any, Any]] = []  # (actor, placement group) of this process, for stop_actors


def stop_actors() -> None:
    """Kill the actors :func:`start_actor` started and free their placement groups."""
    import ray
    from ray.util.placement_group import remove_placement_group

    while _STARTED:
        actor, group = _STARTED.pop()
        ray.kill(actor)
        remove_placement_group(group)
