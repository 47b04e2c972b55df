"""The Ray launcher's actors and the driver's handles on them (imports ray and torch).

- an **engine actor** starts the engine (:func:`skyrl_toolkit.launch.start_engine`) and
  the weight transport's receiver and answers ``generate`` with the RolloutBatch's
  numpy arrays (``RolloutBatch.to_arrays``), which travel through Ray's object store
  and reach the driver as zero-copy, read-only views; the driver splits a step's
  prompts between the replicas and joins their batches;
- a **backend actor** (one per rank) starts the backend
  (:func:`skyrl_toolkit.launch.start_backend`, with the job's replay strategies and
  precision) and trains on its share of each batch's sequences; rank 0 holds the
  transport's sender (every rank, for rendezvous transports) and publishes each version.

Weights move only through the job's weight transport, never through Ray's object store
(``delta`` through its URL; ``broadcast`` over a group of its own between backend rank 0
and the engines; ``nixl`` from every backend rank to every engine; ``lora``'s adapters
as one object handed from rank 0 to the engines). Everything a placement started
(actors, placement groups, groups, Ray itself when it started it) belongs to its
:class:`RayPlacement` and goes with its ``close``.

Async RL (``[job] mode = "async"``): the driver's rollout thread calls the engine actors
while its main thread calls the backend actors, so generation and training run at once in
their processes (Ray handles may be used from several threads; each actor runs one call
at a time, in the order its calls were made). The driver's schedule calls an engine's
``sync`` only once it is idle; :meth:`RayPlacement.stage` does the backend's half of a
publish before that, while the engines still generate. With in-flight updates
(``weight_updates = "in_flight"`` or ``"abort"``: ``PlacementRequest.in_flight_updates``)
the engine actors are threaded (two calls at once), so a ``sync`` runs beside the
``generate`` call in progress and the engine applies it between two forwards (or, with
``"abort"``, resubmits the live requests there).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from concurrent.futures import Future
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from skyrl_host.contracts import describe, has, receives_in_workers, require
from skyrl_host.errors import ProcessLost, UserError
from skyrl_host.interfaces import (
    AbortingUpdates,
    AdapterTraining,
    LoadedModel,
    PlacementRequest,
    QuantizedServing,
    ShardedCheckpoints,
    ShardedWeights,
    SplitTransport,
    TokenizerLoading,
)
from skyrl_toolkit.groups import comm_device, destroy_group, gloo_towards, group_backend, weight_group
from skyrl_toolkit.launch import save_trained_model, start_backend, start_engine, trains_adapters, vocab_size


def ray_get(refs: Any) -> Any:
    """``ray.get``, re-raising a user error from an actor as itself (one clear message,
    not a remote traceback), and an actor that died (its process, or its node) as
    :class:`~skyrl_host.errors.ProcessLost` naming it and its node."""
    import ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, UserError):
            raise exc.cause from None
        raise
    except ray.exceptions.RayActorError as exc:
        raise ProcessLost(_lost(exc)) from None


def _lost(exc: Any) -> str:
    """One line for an actor that died: which one, on which node, and Ray's reason."""
    import ray

    actor_id = getattr(exc, "actor_id", None)
    where = ""
    if actor_id:
        try:
            info = ray._private.state.actors(actor_id) or {}
            name = info.get("ActorClassName", "an actor")
            node = (info.get("Address") or {}).get("NodeID", "?")
            ip = (info.get("Address") or {}).get("IPAddress", "?")
            where = f"{name} (node {str(node)[:12]} at {ip})"
        except Exception:  # noqa: BLE001 - the state table is a courtesy; the loss is the message
            where = ""
    reason = " ".join(str(getattr(exc, "error_msg", None) or exc).split())[:300]
    return (f"the Ray actor {where or actor_id or ''} of this job died: {reason}; `skyrl run JOB --resume` continues "
            "from the last checkpoint")


def _first_part(exc: BaseException) -> str:
    """A :class:`ProcessLost` message without its advice to resume (the job goes on)."""
    return str(exc).split("; `skyrl run", 1)[0]


def _address() -> str:
    """``tcp://<this node's IP>:<a free port>``, for a group whose rank 0 runs here."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"tcp://{ray.util.get_node_ip_address()}:{port}"


def _dist_backend(device: str = "auto") -> str:
    """The data-parallel group's backend for ranks whose ``device`` option is ``device``:
    NCCL when CUDA is available (and the ranks do not ask for the CPU), gloo otherwise."""
    import torch

    return "nccl" if device != "cpu" and torch.cuda.is_available() else "gloo"


def gpu_bundles(n: int, available: Mapping[str, float]) -> int:
    """GPUs per bundle for ``n`` actors: 1 when the cluster's free GPUs
    (``ray.available_resources()``) give each one its own, else 0."""
    return 1 if n > 0 and float(available.get("GPU", 0) or 0) >= n else 0


class EngineWorker:
    """One engine replica's actor (wrapped with ``ray.remote`` by :class:`Actors`)."""

    def __init__(self, request: PlacementRequest):
        import torch

        self.threads = request.threads
        if request.threads:
            torch.set_num_threads(request.threads)
        precision = request.precision.create()  # first: it may decide what the model code imports
        self.family = request.model.create()
        self.loaded = self.family.load(alphabet=request.alphabet, seed=request.seed)
        self.sampler = request.sampler.create()  # this process's: made once, shared with the engine
        replay = [choice.create() for choice in request.replay]
        self.engine = start_engine(request, self.loaded, precision, self.sampler, replay)
        self.transport = request.weight_sync.create()
        self.receiver: Any = None
        self.group: Any = None

    def ready(self) -> str:
        return socket.gethostname()

    def device(self) -> str:
        """The engine's device ("cpu", "cuda:0", ...)."""
        return str(getattr(self.engine, "device", "cpu"))

    def group_members(self) -> int:
        """Members of a collective transport's group this replica contributes: its
        engine's workers where they receive weights themselves (WorkerReceiving), else
        this actor."""
        return int(self.engine.worker_ranks()) if receives_in_workers(self.engine) else 1

    def init_receiver(self, group: tuple[str, int, int] | None = None, backend: str | None = None) -> None:
        """``group``: (address, first rank, world) of the weight group, for collective
        transports; ``backend``: the group's (decided by the driver from every member's
        device). An engine whose workers receive weights themselves gets them its
        receiver instead (they join the group, as ranks from the first on)."""
        self.leave()  # a group formed again (a replica lost or restarted): the old one first
        context: dict[str, Any] = {}
        workers = receives_in_workers(self.engine)
        if group is not None:
            backend = backend or _dist_backend()
            if workers:
                context = {"members": (*group, backend), "src": 0}
            else:
                self.group = weight_group(*group, backend=backend)
                context = {"group": self.group, "src": 0, "device": comm_device(self.device(), backend)}
        if workers:
            context["engine"] = self.engine
        self.receiver = self.transport.receiver(**context)

    def connect(self, endpoints: Sequence[Any]) -> None:
        """Rendezvous transports: every backend rank's endpoint."""
        self.receiver.connect(list(endpoints))

    def sync(self, version: int, payload: Any = None) -> Mapping[str, float]:
        kwargs: dict[str, Any] = {"target": version}
        if payload is not None:
            kwargs["payload"] = payload
        return self.receiver.sync(self.engine, **kwargs)

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampler: Any, max_new_tokens: int, seed: int,
                 group_offset: int) -> Mapping[str, Any]:
        """The driver's call, with the driver's sampler (the job's, or another: an evaluation's)."""
        if self.threads:  # a threaded actor's calls run in pool threads, which start with the default count
            import torch

            torch.set_num_threads(self.threads)
        batch = self.engine.generate(prompts, n=n, sampler=sampler, max_new_tokens=max_new_tokens, seed=seed,
                                     group_offset=group_offset)
        return dict(batch.to_arrays())

    def weight_version(self) -> int:
        return int(self.engine.weight_version)

    def abort_on_update(self, enabled: bool) -> None:
        """AbortingUpdates, passed on to this actor's engine (a UserError where it has none)."""
        if not has(self.engine, AbortingUpdates):
            raise UserError(
                f"[job] weight_updates = \"abort\": engine {type(self.engine).__name__} in the engine actor cannot "
                "abort and resubmit the requests in progress at a weight update; use weight_updates = \"in_flight\""
            )
        self.engine.abort_on_update(enabled)

    def resubmitted(self) -> int:
        return int(getattr(self.engine, "resubmitted", 0))

    def leave(self) -> None:
        """Drop the receiver and leave its group."""
        if self.group is not None:
            destroy_group(self.group)
            self.group = None
        if self.receiver is not None and hasattr(self.receiver, "close"):
            self.receiver.close()
        self.receiver = None

    def close(self) -> None:
        self.leave()
        if hasattr(self.engine, "close"):  # an engine's own processes (vLLM servers) go with it
            self.engine.close()


class BackendWorker:
    """One backend rank's actor (wrapped with ``ray.remote`` by :class:`Actors`)."""

    def __init__(self, request: PlacementRequest, rank: int, world: int):
        """A job without ``[weight_sync]`` (sft) publishes nothing."""
        import torch

        if request.threads:
            torch.set_num_threads(request.threads)
        self.request = request
        self.rank, self.world = rank, world
        self.precision = request.precision.create()  # first: it may decide what the model code imports
        self.family = request.model.create()
        self.loaded = self.family.load(alphabet=request.alphabet, seed=request.seed)
        self.transport = request.weight_sync.create() if request.weight_sync is not None else None
        self.backend: Any = None
        self.sender: Any = None
        self.group: Any = None
        self._staged: dict[int, Future] = {}  # version -> its writing (publish_staged)

    def ready(self) -> str:
        return socket.gethostname()

    def address(self) -> str:
        return _address()

    def vocab_size(self) -> int:
        return vocab_size(self.loaded.model)

    def start(self, dp_address: str | None) -> None:
        """Join the ranks' data-parallel group (``dp_address``: when there are several ranks,
        or one whose backend trains data parallel), then start the backend."""
        import torch

        if dp_address is not None:  # several ranks, or one that trains data parallel (FSDP2 over one GPU)
            import torch.distributed as dist

            os.environ.setdefault("LOCAL_RANK", "0")  # Ray gives each actor its own GPU (device 0)
            device = self.request.backend.traits.device
            backend = _dist_backend(device)
            with gloo_towards(dp_address, backend):
                dist.init_process_group(backend, init_method=dp_address, rank=self.rank, world_size=self.world)
        torch.manual_seed(self.request.seed)  # as the one-process launcher's driver does before starting the backend
        request = self.request
        self.backend = start_backend(request, self.loaded, request.algorithm, self.precision,
                                     [choice.create() for choice in request.replay])
        if self.transport is not None and self.transport.rendezvous:
            require(self.backend, ShardedWeights, who=describe(request.backend),
                    needed_by=f"transport {request.weight_sync.name!r}")

    def data_parallel(self) -> tuple[int, int]:
        """(this rank's data-parallel index, the data-parallel size): the backend's own when it
        says (a model-parallel backend: ranks of one model replica train on the same data),
        else (rank, world)."""
        layout = getattr(self.backend, "data_parallel", None)
        return tuple(layout()) if callable(layout) else (self.rank, self.world)

    def device(self) -> str:
        """The backend's device ("cpu", "cuda:0", ...)."""
        return str(getattr(self.backend, "device", "cpu"))

    def init_sender(self, group: tuple[str, int, int] | None = None, backend: str | None = None) -> None:
        if self.transport.rendezvous:  # every rank serves its own shards
            self.sender = self.transport.sender(rank=self.rank, world=self.world)
        elif self.rank == 0:
            if self.group is not None:  # formed again (an engine replica lost or restarted)
                destroy_group(self.group)
                self.group = None
            if group is not None:
                backend = backend or _dist_backend()
                self.group = weight_group(*group, backend=backend)
                self.sender = self.transport.sender(group=self.group, src=0, device=comm_device(self.device(), backend))
            else:
                self.sender = self.transport.sender()

    def publish(self, version: int) -> Any:
        """Publish ``version``; every rank calls it (gathering sharded weights is a
        collective). Transports that carry their payload return (stats, payload)."""
        serving = self.backend.serving_weights if has(self.backend, QuantizedServing) else None
        if self.transport.carries_payload:
            if self.sender is None:
                if has(self.backend, AdapterTraining):
                    for _ in self.backend.named_adapters():  # take part in the gather (FSDP2); rank 0 publishes
                        pass
                return {}, None
            return self.sender.publish(version, self.backend)
        if self.transport.rendezvous:  # every rank serves what it holds
            local = list(self.backend.local_weights())
            if not any(hasattr(t, "placements") for _, t in local):  # no DTensor shards
                # Whole tensors on every rank (DDP, or one rank): rank 0 serves them.
                local = (list(serving()) if serving is not None else local) if self.rank == 0 else []
            elif serving is not None:  # FSDP2: each rank its own shards (quantized by itself)
                local = list(serving(local=True))
            return self.sender.publish(version, local)
        weights = serving() if serving is not None else self.backend.named_weights()
        if self.sender is None:
            for _ in weights:  # take part in the gather; rank 0 publishes
                pass
            return {}
        return self.sender.publish(version, weights)

    def publish_staged(self, version: int) -> Mapping[str, float]:
        """Async RL's staged hand-over, for a transport that writes where the engines read
        (delta): the weights as ``publish`` takes them, written now or, when the transport
        says so (``writes_in_background``), by the sender in a thread of its own while this
        actor trains on (it returns at once). :meth:`staged_result` waits for the writing."""
        serving = self.backend.serving_weights if has(self.backend, QuantizedServing) else None
        weights = serving() if serving is not None else self.backend.named_weights()
        if self.sender is None:
            for _ in weights:  # take part in the gather; rank 0 publishes
                pass
            return {}
        if hasattr(self.sender, "publish_in_background") and self.transport.writes_in_background(self.backend):
            t0 = time.perf_counter()
            self._staged[version] = self.sender.publish_in_background(version, weights)
            return {"sync_version": float(version), "sync_snapshot_s": time.perf_counter() - t0}
        return dict(self.sender.publish(version, weights))  # written now: nothing for staged_result to wait for

    def staged_result(self, version: int) -> Mapping[str, float]:
        """The writing's metrics once ``version`` (from :meth:`publish_staged`) is written;
        its error raised here. Runs in the actor's ``staged`` concurrency group, beside the
        train step in progress."""
        future = self._staged.pop(version, None)
        return dict(future.result()) if future is not None else {}

    def endpoint(self) -> Any:
        return self.sender.endpoint()

    def train_step(self, arrays: Mapping[str, Any], advantages: Any, algorithm: Any, temperature: float,
                   max_new_tokens: int) -> Mapping[str, float]:
        """The driver's step, with the driver's algorithm (its loss)."""
        from skyrl_host.rollout import RolloutBatch

        return self.backend.train_step(RolloutBatch.from_arrays(arrays), advantages, algorithm,
                                       temperature=temperature, max_new_tokens=max_new_tokens)

    def reference_logprobs(self, arrays: Mapping[str, Any], temperature: float) -> Any:
        from skyrl_host.rollout import RolloutBatch

        return self.backend.reference_logprobs(RolloutBatch.from_arrays(arrays), temperature=temperature)

    def state_dict(self) -> Any:
        state = self.backend.state_dict()  # a collective with several ranks: rank 0 gets the full state
        return state if self.rank == 0 else None

    def load_state_dict(self, state: Any) -> None:
        self.backend.load_state_dict(state if self.rank == 0 else {})

    def sharded_checkpoints(self) -> bool:
        return has(self.backend, ShardedCheckpoints)

    def save_checkpoint(self, folder: str) -> None:
        self.backend.save_checkpoint(folder)  # a collective: each rank writes its shards

    def load_checkpoint(self, folder: str) -> None:
        self.backend.load_checkpoint(folder)

    def save_final(self, path: str) -> None:
        trained = dict(self.backend.named_weights())  # a collective with several ranks
        if self.rank != 0:
            if trains_adapters(self.backend):
                self.backend.save_adapters(path)  # a collective under FSDP2; rank 0 writes
            return
        # With several ranks the model this actor holds is sharded or wrapped: save a fresh copy.
        request = self.request
        loaded = self.loaded if self.world == 1 else self.family.load(alphabet=request.alphabet, seed=request.seed)
        save_trained_model(self.backend, self.family, loaded, path, self.request.model.traits, trained=trained)

    def close(self) -> None:
        import torch.distributed as dist

        if self.group is not None:
            destroy_group(self.group)
            self.group = None
        if dist.is_initialized():
            dist.destroy_process_group()


def split_sequences(seq_lens: np.ndarray, parts: int) -> list[np.ndarray]:
    """Contiguous runs of sequence indices, one per part, with token counts as even as
    whole sequences allow (a part may be empty)."""
    cum = np.cumsum(np.asarray(seq_lens, dtype=np.int64))
    total = int(cum[-1]) if len(cum) else 0
    # Sequence i goes to the part its middle token falls in.
    middle = cum - np.asarray(seq_lens, dtype=np.int64) / 2.0
    owner = np.minimum((middle * parts / max(total, 1)).astype(np.int64), parts - 1)
    return [np.flatnonzero(owner == p) for p in range(parts)]


class RemoteBackend:
    """The driver's handle on the backend ranks: the Backend protocol's calls the driver
    makes. Each rank trains on its share of the batch's sequences; the backend reduces
    over ranks, so every rank returns the step's metrics."""

    def __init__(self, actors: Sequence[Any]):
        self.actors = list(actors)
        self.actor = self.actors[0]
        self._layout: list[tuple[int, int]] | None = None  # each rank's (data-parallel index, size)

    def train_step(self, batch: Any, advantages: Any, algorithm: Any, *, temperature: float,
                   max_new_tokens: int) -> Mapping[str, float]:
        return self.start_train_step(batch, advantages, algorithm, temperature=temperature,
                                     max_new_tokens=max_new_tokens)()[0]

    def start_train_step(self, batch: Any, advantages: Any, algorithm: Any, *, temperature: float,
                         max_new_tokens: int) -> Callable[[], tuple[Mapping[str, float], float]]:
        """OrderedTrainStep: send the step to the ranks and return ``finish()`` (its
        metrics, and the seconds until rank 0's result arrived). An actor runs the calls
        it gets in order (its default concurrency group), so a call sent before ``finish``
        (async RL's stage) runs right after the step. Each data-parallel index trains on
        its share of the sequences; the ranks of one index (a model-parallel backend's
        tensor-parallel ranks) all get the same share."""
        t0 = time.perf_counter()
        advantages = np.asarray(advantages)
        if self._layout is None:
            self._layout = [tuple(x) for x in ray_get([a.data_parallel.remote() for a in self.actors])]
        size = self._layout[0][1]
        shares = split_sequences(batch.seq_lens, size)
        calls = []
        for actor, (index, _) in zip(self.actors, self._layout):
            if size == 1:
                part, adv = batch, advantages
            else:
                seqs = shares[index]
                part = batch.select(seqs)
                cu = batch.cu_seqlens
                tokens = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in seqs]) if len(seqs) else np.zeros(0, np.int64)
                adv = advantages[tokens]
            calls.append(actor.train_step.remote(dict(part.to_arrays()), adv, algorithm, temperature, max_new_tokens))
        ended: list[float] = []
        calls[0].future().add_done_callback(lambda _: ended.append(time.perf_counter()))

        def finish() -> tuple[Mapping[str, float], float]:
            metrics = ray_get(calls)[0]
            return metrics, (ended[0] if ended else time.perf_counter()) - t0

        return finish

    def reference_logprobs(self, batch: Any, *, temperature: float) -> Any:
        import ray

        # Every rank scores the whole batch (the same forwards on every rank: safe when they are collectives).
        ref = ray.put(dict(batch.to_arrays()))
        return ray_get([a.reference_logprobs.remote(ref, temperature) for a in self.actors])[0]

    def state_dict(self) -> Any:
        return ray_get([a.state_dict.remote() for a in self.actors])[0]

    def load_state_dict(self, state: Any) -> None:
        import ray

        ref = ray.put(state)
        ray_get([a.load_state_dict.remote(ref if i == 0 else None) for i, a in enumerate(self.actors)])

    def save_final(self, path: str) -> None:
        ray_get([a.save_final.remote(path) for a in self.actors])


class RemoteShardedBackend(RemoteBackend):
    """:class:`RemoteBackend` of a backend with ``ShardedCheckpoints``: every rank writes
    and reads its own shards in the checkpoint's folder (the actors and the driver share
    the filesystem the run's output folder is on)."""

    def save_checkpoint(self, folder: str) -> None:
        ray_get([a.save_checkpoint.remote(folder) for a in self.actors])

    def load_checkpoint(self, folder: str) -> None:
        ray_get([a.load_checkpoint.remote(folder) for a in self.actors])


def replica_seed(seed: int, replica: int) -> int:
    """The generation seed of engine replica ``replica`` (replica 0 keeps the step's seed)."""
    return (seed + replica * 0x9E3779B97F4A7C15) % (2**63 - 1)


class RemoteEngine:
    """The driver's handle on the engine replicas: the parts of the Engine protocol the
    driver uses. A step's prompts are split into contiguous runs, one per replica.

    A replica that dies (its process, or its node) does not stop the job. Its run of the
    step's prompts is generated again by a surviving replica with the lost replica's seed
    and offsets, so the step's batch is the one it would have made; a new actor is started
    for it at once in its placement-group bundle, which Ray creates when the bundle has a
    node again (the lost node back, or another with the resources); between two steps
    (:meth:`tend`) a new actor that is up is handed the current weights, checked, and
    only then generates. From the first loss on, the step's metrics count it:
    ``engine_replicas_live``, ``engine_replicas_lost``, ``engine_replicas_restarted``,
    ``engine_prompts_regenerated`` (the last three since the start). With no replica left
    the job stops (:class:`~skyrl_host.errors.ProcessLost`)."""

    def __init__(self, actors: list[Any], respawn: Callable[[int], Any] | None = None):
        """``actors``: the replicas' list (replaced actors are put in it, in place: whoever
        holds the list stops them too); ``respawn(i)``: a new actor for replica ``i``."""
        import threading

        self.actors = actors
        self.replicas = len(actors)
        self.live = list(range(self.replicas))
        self.pending: dict[int, Any] = {}  # replica -> its new actor's ready() reference
        self.respawn = respawn
        self.lock = threading.RLock()  # async RL: the rollout thread generates, the main thread publishes
        self.changes = 0  # how often the live set changed (a collective transport re-forms its group)
        self.counts: dict[str, float] = {}  # the metrics, from the first loss on
        self.aborting: bool | None = None

    @property
    def actor(self) -> Any:
        return self.actors[self.live[0]]

    def live_actors(self) -> list[Any]:
        with self.lock:
            return [self.actors[i] for i in self.live]

    def _each(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` of every live replica; the answers of those that answer (a
        replica found dead is lost)."""
        with self.lock:
            live = [(i, getattr(self.actors[i], method).remote(*args)) for i in self.live]
        answers = []
        for i, ref in live:
            try:
                answers.append(ray_get(ref))
            except ProcessLost as exc:
                self.lose(i, _first_part(exc))
        return answers

    @property
    def weight_version(self) -> int:
        return min(self._each("weight_version"))

    def abort_on_update(self, enabled: bool) -> None:
        """AbortingUpdates: every replica aborts and resubmits at an update inside its
        generation (the actors are threaded then: ``PlacementRequest.in_flight_updates``)."""
        self.aborting = enabled
        self._each("abort_on_update", enabled)

    @property
    def resubmitted(self) -> int:
        return sum(self._each("resubmitted"))

    def lose(self, replica: int, why: str) -> None:
        """Replica ``replica`` died: serve without it, and start its new actor (Ray creates
        it once its bundle has a node). The last replica lost stops the job."""
        with self.lock:
            if replica not in self.live:
                return
            self.live.remove(replica)
            self.changes += 1
            self.counts = {"engine_replicas_lost": 0.0, "engine_replicas_restarted": 0.0,
                           "engine_prompts_regenerated": 0.0, **self.counts}
            self.counts["engine_replicas_lost"] += 1
            if not self.live:
                raise ProcessLost(f"every engine replica of this job is lost (the last: {why})")
            print(f"notice: engine replica {replica} lost ({why}); going on with {len(self.live)} of "
                  f"{self.replicas}, and restarting it once Ray can place it again", file=sys.stderr, flush=True)
            if self.respawn is not None:
                self._respawn(replica)

    def _respawn(self, replica: int) -> None:
        """Ask Ray for replica ``replica``'s new actor (created when its bundle has a node)."""
        self.actors[replica] = self.respawn(replica)
        self.pending[replica] = self.actors[replica].ready.remote()

    def _restart_again(self, replica: int, why: str) -> None:
        """Replica ``replica``'s new actor died before it served (Ray placed it on a node
        that was dying, say): not a second loss; another new actor is asked for."""
        with self.lock:
            if replica in self.live:
                self.live.remove(replica)
                self.changes += 1
            print(f"notice: engine replica {replica}'s new actor died before it served ({why}); "
                  "starting another", file=sys.stderr, flush=True)
            self._respawn(replica)

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, sampler: Any, max_new_tokens: int, seed: int,
                 group_offset: int = 0) -> Any:
        from skyrl_host.rollout import RolloutBatch

        prompts = [list(p) for p in prompts]
        bounds = np.linspace(0, len(prompts), self.replicas + 1).round().astype(int)
        runs = [(i, int(a), int(b)) for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if b > a]

        def call(run: tuple[int, int, int], replica: int) -> Any:
            i, a, b = run
            return self.actors[replica].generate.remote(prompts[a:b], n, sampler, max_new_tokens,
                                                       replica_seed(seed, i), group_offset + a)

        with self.lock:
            live = list(self.live)
        # Each run to its own replica; a lost replica's run to the survivors in turn.
        todo = [(run, run[0] if run[0] in live else live[k % len(live)], None) for k, run in enumerate(runs)]
        if any(run[0] != replica for run, replica, _ in todo):
            self._regenerated(sum(b - a for (i, a, b), replica, _ in todo if i != replica))
        todo = [(run, replica, call(run, replica)) for run, replica, _ in todo]
        arrays: dict[int, Any] = {}
        while todo:
            run, replica, ref = todo.pop(0)
            try:
                arrays[run[0]] = ray_get(ref)
            except ProcessLost as exc:
                self.lose(replica, _first_part(exc))
                with self.lock:
                    instead = self.live[run[0] % len(self.live)]
                self._regenerated(run[2] - run[1])
                todo.append((run, instead, call(run, instead)))
        batches = [RolloutBatch.from_arrays(arrays[i]) for i, _, _ in runs]
        return batches[0] if len(batches) == 1 else RolloutBatch.concat(batches)

    def _regenerated(self, prompts: int) -> None:
        with self.lock:
            self.counts["engine_prompts_regenerated"] = self.counts.get("engine_prompts_regenerated", 0.0) + prompts

    def tend(self, version: int, sync: RaySync | None) -> dict[str, float]:
        """Between two steps (the engines idle, ``version`` the weights they serve): each
        new actor that is up is handed ``version`` through the transport (a collective one
        re-forms its group first), checked, and serves from the next step on. Returns the
        metrics of the replicas (none before the first loss)."""
        import ray

        with self.lock:
            for replica, ready in list(self.pending.items()):
                if not ray.wait([ready], timeout=0)[0]:
                    continue  # not created yet: no node has room for its bundle
                del self.pending[replica]
                actor = self.actors[replica]
                self.live = sorted([*self.live, replica])  # seen by generate only once this returns (the lock)
                self.changes += 1
                try:
                    ray_get(ready)
                    if self.aborting is not None:
                        ray_get(actor.abort_on_update.remote(self.aborting))
                    if sync is not None:
                        sync.join(actor, version)
                    got = int(ray_get(actor.weight_version.remote()))
                except ProcessLost as exc:  # its new actor died before it served: once more
                    self._restart_again(replica, _first_part(exc))
                    continue
                if sync is not None and got != version:
                    raise RuntimeError(f"engine replica {replica} restarted with weight version {got}, not {version}")
                self.counts["engine_replicas_restarted"] += 1
                print(f"notice: engine replica {replica} restarted with weight version {version}; "
                      f"{len(self.live)} of {self.replicas} replicas serve", file=sys.stderr, flush=True)
            if not self.counts:
                return {}
            return {**self.counts, "engine_replicas_live": float(len(self.live))}


class RaySync:
    """The weight transport between the backend ranks (senders) and the engine replicas
    that serve (receivers: ``engine``'s live ones, :class:`RemoteEngine`)."""

    def __init__(self, transport: Any, backend_actors: Sequence[Any], engine: RemoteEngine):
        self.backends, self.engine = list(backend_actors), engine
        self.collective = bool(transport.collective)
        self.rendezvous = bool(transport.rendezvous)
        self.carries_payload = bool(transport.carries_payload)
        self.endpoints: list[Any] | None = None  # rendezvous: the backend ranks', once asked
        self.payload: Any = None  # carried payloads: the last one sent (a restarted replica's weights)
        self.grouped = -1  # collective: the engine's live set the group was formed for (its `changes`)
        if self.collective:
            self._form_group(self.engine.live_actors())
            ray_get([b.init_sender.remote() for b in self.backends[1:]])
        else:
            ray_get([e.init_receiver.remote() for e in self.engine.live_actors()]
                    + [b.init_sender.remote() for b in self.backends])

    def _form_group(self, engines: Sequence[Any]) -> None:
        """Backend rank 0 and ``engines`` in a group of their own (again: a replica lost or
        restarted; every member leaves its old group first)."""
        address = ray_get(self.backends[0].address.remote())
        # Each engine replica's members: the actor, or its engine's workers (vLLM's), ranks 1.. in order.
        members = [int(m) for m in ray_get([e.group_members.remote() for e in engines])]
        if self.grouped >= 0 and any(m != 1 for m in members):
            raise ProcessLost("an engine replica was lost or restarted, and the broadcast group of engines whose "
                              "workers receive the weights (vLLM's) cannot be formed again while the job runs")
        firsts = (1 + np.cumsum([0] + members[:-1])).tolist()
        world = 1 + sum(members)
        # One backend for the whole group, from every member's device (a per-process choice could mismatch).
        devices = ray_get([self.backends[0].device.remote()] + [e.device.remote() for e in engines])
        self.group_backend = group_backend(devices)
        ray_get([e.init_receiver.remote((address, int(first), world), self.group_backend)
                 for first, e in zip(firsts, engines)]
                + [self.backends[0].init_sender.remote((address, 0, world), self.group_backend)])
        self.grouped = self.engine.changes

    def publish(self, version: int) -> dict[str, float]:
        return self.receive(version, self.send(version))

    def send(self, version: int, background: bool = False) -> Any:
        """The backend ranks' half of publishing ``version``, which leaves the engines alone
        (they may be generating): what :meth:`receive` needs. A collective transport sends
        nothing here (both sides take part in the same collectives, in :meth:`receive`).
        ``background`` (async RL's stage): a transport that writes where the engines read
        (delta) writes in the backend actors' background, and :meth:`receive` waits for it."""
        if self.collective:
            return None
        if background and not self.carries_payload and not self.rendezvous:
            return ray_get([b.publish_staged.remote(version) for b in self.backends])[0], None, True
        if self.carries_payload:  # rank 0's payload, kept in the object store for the engines
            first = self.backends[0].publish.options(num_returns=2).remote(version)
            others = [b.publish.remote(version) for b in self.backends[1:]]
            sent = ray_get(first[0])
            ray_get(others)
            return sent, first[1]
        return ray_get([b.publish.remote(version) for b in self.backends])[0], None  # written, read in receive

    def receive(self, version: int, sent: Any) -> dict[str, float]:
        """The engines' half (they must be idle): ``sent`` is what :meth:`send` returned. A
        replica found dead here is lost (:meth:`RemoteEngine.lose`) and the others go on;
        in a collective, the collective fails for every member and the job stops."""
        if self.collective:  # every side in the same collectives
            if self.grouped != self.engine.changes:
                self._form_group(self.engine.live_actors())
            engines = self.engine.live_actors()
            results = ray_get([b.publish.remote(version) for b in self.backends]
                              + [e.sync.remote(version) for e in engines])
            stats, received = dict(results[0]), results[len(self.backends):]
        else:
            stats, payload = dict(sent[0]), sent[1]
            # Written in the backend actors' background (stage returned after the snapshot):
            # wait for it, beside their train step; written in the foreground: no call at all.
            if len(sent) > 2 and "sync_snapshot_s" in stats:
                written = ray_get([b.staged_result.options(concurrency_group="staged").remote(version)
                                   for b in self.backends])[0]
                stats = {**written, **stats}
            self.payload = payload
            with self.engine.lock:
                live = list(zip(self.engine.live, self.engine.live_actors()))
            if self.rendezvous and self.endpoints is None:
                self.endpoints = ray_get([b.endpoint.remote() for b in self.backends])
                ray_get([e.connect.remote(self.endpoints) for _, e in live])
            calls = [(i, e.sync.remote(version, payload) if self.carries_payload else e.sync.remote(version))
                     for i, e in live]
            received = []
            for i, ref in calls:
                try:
                    received.append(ray_get(ref))
                except ProcessLost as exc:
                    self.engine.lose(i, _first_part(exc))
        stats.update(received[0])
        return stats

    def join(self, actor: Any, version: int) -> None:
        """A restarted replica's receiver, and ``version`` (the one the others serve)
        through the transport before it generates: delta from the store (its keyframe and
        the deltas since), nixl read from the backend ranks, lora the last adapters sent;
        broadcast re-forms the group with it and broadcasts ``version`` again to all."""
        if self.collective:
            self._form_group(self.engine.live_actors())
            ray_get([b.publish.remote(version) for b in self.backends]
                    + [e.sync.remote(version) for e in self.engine.live_actors()])
            return
        ray_get(actor.init_receiver.remote())
        if self.rendezvous:
            if self.endpoints is None:
                self.endpoints = ray_get([b.endpoint.remote() for b in self.backends])
            ray_get(actor.connect.remote(self.endpoints))
        ray_get(actor.sync.remote(version, self.payload) if self.carries_payload else actor.sync.remote(version))

    def close(self) -> None:
        engines = [e.close.remote() for e in self.engine.live_actors()]
        ray_get([a.close.remote() for a in self.backends])
        for ref in engines:
            try:
                ray_get(ref)
            except ProcessLost:  # lost at the end: its actor goes with the placement group
                pass


class TeacherWorker:
    """A distilling job's [teacher] in its own actor: the model of its family choice, loaded
    here, scoring the token ids and offsets the driver sends
    (:class:`skyrl_host.jobs.teacher.Teacher`)."""

    def __init__(self, family: Any, options: Any, alphabet: str | None, seed: int, temperature: float,
                 threads: int | None):
        import torch

        from skyrl_host.jobs.teacher import Teacher

        if threads:
            torch.set_num_threads(threads)
        loaded = family.create().load(alphabet=alphabet, seed=seed)
        self.vocabulary = dict(loaded.tokenizer.get_vocab())
        self.name = str(loaded.tokenizer.name_or_path or "")
        self.teacher = Teacher(loaded, options, temperature=temperature)

    def ready(self) -> str:
        return socket.gethostname()

    def vocab(self) -> tuple[str, dict[str, int]]:
        return self.name, self.vocabulary

    def score(self, tokens: np.ndarray, cu_seqlens: np.ndarray, k: int) -> tuple[Any, Any, Any]:
        import types

        return self.teacher.score(types.SimpleNamespace(tokens=tokens, cu_seqlens=cu_seqlens,
                                                        n_tokens=int(cu_seqlens[-1])), k)


class RemoteTeacher:
    """The driver's handle on a :class:`TeacherWorker`."""

    def __init__(self, actor: Any):
        self.actor = actor
        self.counters: dict[str, float] = {}

    def vocab(self) -> Any:
        import types

        name, vocabulary = ray_get(self.actor.vocab.remote())
        return types.SimpleNamespace(name_or_path=name, get_vocab=lambda: vocabulary)

    def score(self, batch: Any, k: int) -> tuple[Any, Any, Any]:
        return ray_get(self.actor.score.remote(np.asarray(batch.tokens), np.asarray(batch.cu_seqlens), int(k)))


class Actors:
    """The actors and placement groups one placement started, released together."""

    def __init__(self) -> None:
        self.started: list[tuple[list[Any], Any, Any]] = []  # (actors, placement group, actor class)

    def start(self, worker: type, args: Sequence[Sequence[Any]], *, cpus: float = 1.0, concurrency: int = 1,
              groups: Mapping[str, int] | None = None, gpus: bool = True,
              resources: Mapping[str, float] | None = None, role: str = "") -> list[Any]:
        """One ``worker`` actor per entry of ``args`` (its constructor's arguments), in one
        placement group with a bundle each (``cpus`` CPUs, plus one GPU when the cluster has
        enough free ones to give each one: :func:`gpu_bundles`); waits until all are built.
        ``concurrency`` > 1: a threaded actor serving that many calls at once. ``groups``:
        Ray concurrency groups (name: threads) whose calls run beside the others. ``gpus``
        False: no GPU whatever the cluster has (an actor that computes on its CPUs).
        ``resources``: custom Ray resources each bundle asks for too (``[cluster]
        <role>_resources``): only nodes that hold them take the actors."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n = len(args)
        gpus = gpu_bundles(n, ray.available_resources()) if gpus else 0  # the free GPUs: earlier actors may hold some
        bundle = {"CPU": cpus, **({"GPU": 1} if gpus else {}), **dict(resources or {})}
        missing = sorted(set(resources or {}) - set(ray.cluster_resources()))
        if missing:
            raise UserError(
                f"[cluster] {role}_resources: no node of the Ray cluster holds {', '.join(map(repr, missing))} (its "
                f"resources: {sorted(k for k in ray.cluster_resources() if not k.startswith('node:'))}); start the "
                f"nodes for it with ray start --resources='{{\"{missing[0]}\": 1}}'"
            )
        group = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
        ready, _ = ray.wait([group.ready()], timeout=120)
        if not ready:
            remove_placement_group(group)
            raise UserError(
                f"[cluster]: Ray cannot place {n} {worker.__name__} actor(s) of {bundle} each "
                f"(the cluster has {ray.cluster_resources()}): lower cpus_per_actor, trainer_ranks or engine_replicas"
            )
        actor_cls = ray.remote(num_cpus=cpus, num_gpus=gpus, max_concurrency=concurrency,
                               **({"concurrency_groups": dict(groups)} if groups else {}))(worker)
        actors = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i)
            ).remote(*a)
            for i, a in enumerate(args)
        ]
        self.started.append((actors, group, actor_cls))
        ray_get([a.ready.remote() for a in actors])
        return actors

    def respawn(self, actors: list[Any], index: int, *args: Any) -> Any:
        """A new actor for ``actors[index]`` (one :meth:`start` returned; the old one dead
        or killed) in the same bundle of its placement group, with constructor arguments
        ``args``: Ray creates it when that bundle has a node (at once, or when a node with
        the resources joins). Returned without waiting; it is stopped with the others."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        for started, group, actor_cls in self.started:
            if started is actors:
                ray.kill(actors[index])
                actors[index] = actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=index)).remote(*args)
                return actors[index]
        raise ValueError("not a list of actors this placement started")

    def stop(self) -> None:
        """Kill the actors and free their placement groups."""
        import ray
        from ray.util.placement_group import remove_placement_group

        while self.started:
            actors, group, _ = self.started.pop()
            for actor in actors:
                ray.kill(actor)
            remove_placement_group(group)


_AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def _reload_ray_auth() -> None:
    """Make this process's Ray read the authentication variables again: Ray reads them
    once per process (its config and its token cache), so a process that used Ray before
    (a test run, a resumed job) would keep the old mode without this."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


class _PrivateAuth:
    """Ray's token authentication for a cluster this job starts: a fresh 256-bit token in
    this process's environment (the head, its raylet and every worker inherit it; another
    user cannot read it), so a driver or client without the token is refused on every
    port Ray opens. :meth:`restore` puts the variables back as they were."""

    def __init__(self) -> None:
        import secrets

        self.saved = {name: os.environ.get(name) for name in _AUTH_VARIABLES}
        os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        _reload_ray_auth()

    def restore(self) -> None:
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _reload_ray_auth()


def start_ray(cluster: Any, config: Any) -> _PrivateAuth | bool:
    """Connect to ``config.address`` or start a local Ray cluster of this job's own, with
    token authentication (:class:`_PrivateAuth`). Returns what :meth:`RayPlacement.close`
    must undo: the cluster's authentication when this process started it, True when it
    connected to ``config.address``, False when Ray was already running in this process."""
    try:
        import ray
    except ImportError:
        raise UserError('[cluster] launcher = "ray" needs Ray: pip install "ray>=2.60"') from None
    if ray.is_initialized():
        return False
    auth = _PrivateAuth() if config.address is None else None
    try:
        # No address: a new instance ("local"). Ray's own default (None) would join the
        # cluster last started on this machine, or RAY_ADDRESS's.
        ray.init(address="local" if config.address is None else config.address, num_cpus=cluster.num_cpus,
                 num_gpus=cluster.num_gpus, include_dashboard=False, log_to_driver=True, configure_logging=False)
    except BaseException:
        if auth is not None:
            auth.restore()
        raise
    return auth if auth is not None else True


class RayPlacement:
    """The :class:`skyrl_host.interfaces.Placement` of the Ray launcher."""

    def __init__(self, own_ray: _PrivateAuth | bool, loaded: LoadedModel, sampler: Any = None) -> None:
        self.own_ray = own_ray  # what start_ray returned
        self.loaded = loaded
        self.sampler = sampler  # the driver's (each engine actor makes its own)
        self.actors = Actors()
        self.backend: Any = None
        self.engine: Any = None
        self.sync: RaySync | None = None
        self._vocab_size: int | None = None
        self._staged: tuple[int, Any] | None = None  # (version, what RaySync.send returned), until commit
        self.closed = False
        self.config: Any = None  # the launcher's [cluster] keys (set by place())
        self.threads: int | None = None

    @property
    def vocab_size(self) -> int:
        if self._vocab_size is None:
            self._vocab_size = int(ray_get(self.backend.actor.vocab_size.remote()))
        return self._vocab_size

    def publish(self, version: int) -> Mapping[str, float]:
        stats = self.sync.publish(version) if self.sync is not None else {}
        return self._tend(version, stats)

    def _tend(self, version: int, stats: Mapping[str, float]) -> dict[str, float]:
        """After a version reached the engines: restarted replicas join (RemoteEngine.tend)."""
        stats = dict(stats)
        if self.engine is not None:
            stats.update(self.engine.tend(version, self.sync))
        return stats

    def stage(self, version: int) -> Mapping[str, float]:
        """StagedPlacement (async RL): the backend ranks' half of publishing ``version``
        (delta: encode and write it; lora: the adapters into the object store) while the
        engine actors still generate; a collective transport (broadcast) waits for
        :meth:`commit`, which needs both sides. The engine actors are not called: each
        runs one call at a time, so anything sent to them would only queue behind the
        generation in progress."""
        if self.sync is None:
            return {}
        self._staged = (version, self.sync.send(version, background=True))
        sent = self._staged[1]
        return dict(sent[0]) if sent is not None else {}  # the senders' metrics (delta: the snapshot)

    def commit_on_engine_side(self) -> bool:
        """EngineSideCommit: what stage() sent (delta: written; nixl: served; lora: in the
        object store) is all the engines' half needs, unless the transport is collective
        (broadcast: the backend rank takes part in the commit's collectives)."""
        return self.sync is not None and not self.sync.collective

    def commit(self, version: int) -> Mapping[str, float]:
        """The engines' half (they are idle): the staged version's receive (delta: fetch,
        verify and apply), or the whole publish of one not staged. ``sync_pause_s``: the
        seconds the engines were held."""
        if self.sync is None:
            return {}
        t0 = time.perf_counter()
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] == version:
            stats = self.sync.receive(version, staged[1])
        else:
            stats = self.sync.publish(version)
        stats = self._tend(version, stats)
        stats["sync_pause_s"] = time.perf_counter() - t0
        return stats

    def save_final(self, path: str) -> None:
        self.backend.save_final(path)  # gathered from the ranks, saved by rank 0

    def place_teacher(self, family: Any, options: Any, *, alphabet: str | None, seed: int,
                      temperature: float) -> RemoteTeacher:
        """TeacherPlacement: the [teacher] in an actor of its own (a bundle of
        ``cpus_per_actor`` CPUs and the ``teacher_resources``, and with ``device =
        "cuda..."`` a GPU when one is free), released with the others."""
        (actor,) = self.actors.start(TeacherWorker, [(family, options, alphabet, seed, temperature, self.threads)],
                                     cpus=self.config.cpus_per_actor, gpus=options.device.startswith("cuda"),
                                     resources=self.config.teacher_resources, role="teacher")
        return RemoteTeacher(actor)

    def close(self) -> None:
        """Stop the transport's groups, the actors and their placement groups, and Ray
        itself when this placement started it."""
        if self.closed:
            return
        self.closed = True
        import ray

        try:
            if self.sync is not None:
                self.sync.close()
        finally:
            self.sync = None
            self.actors.stop()
            if self.own_ray:
                ray.shutdown()
                if isinstance(self.own_ray, _PrivateAuth):
                    self.own_ray.restore()


def place(request: PlacementRequest, cluster: Any, config: Any) -> RayPlacement:
    """Start the backend ranks (and the engine replicas, with the transport's halves
    between them) for ``request``; the driver keeps only the tokenizer."""
    transport = request.weight_sync.create() if request.weight_sync is not None else None
    if transport is not None and request.engine is not None:
        require(transport, SplitTransport, who=describe(request.weight_sync),
                needed_by='[cluster] launcher = "ray" (the engines run in processes of their own)')
    family = request.model.create()
    if has(family, TokenizerLoading):
        loaded = family.load_tokenizer(alphabet=request.alphabet)  # the actors hold the models
    else:
        loaded = family.load(alphabet=request.alphabet, seed=request.seed)
    if request.check_tokenizer is not None:
        request.check_tokenizer(loaded.tokenizer)  # before any process starts
    sampler = request.sampler.create() if request.sampler is not None else None
    placement = RayPlacement(start_ray(cluster, config), loaded, sampler)
    placement.config, placement.threads = config, request.threads
    try:
        ranks = cluster.trainer_ranks
        backends = placement.actors.start(
            BackendWorker, [(request, rank, ranks) for rank in range(ranks)], cpus=config.cpus_per_actor,
            resources=config.trainer_resources, role="trainer",
            groups={"staged": 1},  # staged_result waits for a background write beside the train step
        )
        data_parallel = request.backend.traits.data_parallel
        dp_address = ray_get(backends[0].address.remote()) if ranks > 1 or data_parallel else None
        ray_get([b.start.remote(dp_address) for b in backends])
        sharded = ray_get(backends[0].sharded_checkpoints.remote())
        placement.backend = (RemoteShardedBackend if sharded else RemoteBackend)(backends)
        if request.engine is not None:
            # In-flight updates: a sync runs in a second thread of the actor beside the generate
            # call in progress; the engine applies it between two forwards.
            engines = placement.actors.start(
                EngineWorker, [(request,)] * cluster.engine_replicas, cpus=config.cpus_per_actor,
                resources=config.engine_resources, role="engine",
                concurrency=2 if request.in_flight_updates else 1,
            )
            placement.engine = RemoteEngine(
                engines, respawn=lambda i: placement.actors.respawn(engines, i, request))
            if transport is not None:
                placement.sync = RaySync(transport, backends, placement.engine)
    except BaseException:
        placement.close()
        raise
    return placement
