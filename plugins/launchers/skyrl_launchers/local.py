"""``[cluster] launcher = "local"`` (the default): the backend and the engine in the
driver's process, the weight transport between them, every object made once."""

from __future__ import annotations

from typing import Any, Mapping

from skyrl_host import hookimpl
from skyrl_host.contracts import has
from skyrl_host.interfaces import LoadedModel, ModelTraits, PlacementRequest, StagedTransport
from skyrl_toolkit.launch import save_trained_model, start_backend, start_engine, vocab_size


class LocalPlacement:
    """Backend and engine in the driver's process; weights move by the transport's
    one-process ``publish``."""

    def __init__(self, family: Any, loaded: LoadedModel, backend: Any, engine: Any, transport: Any,
                 model: ModelTraits | None = None, sampler: Any = None):
        self.family, self.loaded, self.sampler = family, loaded, sampler
        self.model = model if model is not None else ModelTraits()
        self.backend, self.engine, self.transport = backend, engine, transport
        self._staged: int | None = None  # the version stage() sent, until commit() applies it

    @property
    def vocab_size(self) -> int:
        return vocab_size(self.loaded.model)

    def publish(self, version: int) -> Mapping[str, float]:
        if self.transport is None or self.engine is None:
            return {}
        return self.transport.publish(self.backend, self.engine, version)

    def stage(self, version: int) -> Mapping[str, float]:
        """StagedPlacement: a transport that stages (delta) sends and fetches now; others wait for commit."""
        if self.transport is None or self.engine is None or not has(self.transport, StagedTransport):
            return {}
        self._staged = version
        return self.transport.stage(self.backend, self.engine, version)

    def commit_on_engine_side(self) -> bool:
        """EngineSideCommit: a staging transport's commit only applies what stage() fetched."""
        return self.transport is not None and self.engine is not None and has(self.transport, StagedTransport)

    def commit(self, version: int) -> Mapping[str, float]:
        if self._staged == version:
            self._staged = None
            return self.transport.commit(self.engine, version)
        return self.publish(version)

    def save_final(self, path: str) -> None:
        save_trained_model(self.backend, self.family, self.loaded, path, self.model)

    def close(self) -> None:
        pass


class LocalLauncher:
    """``[cluster] launcher = "local"``: one process."""

    def __init__(self, config: Any = None, cluster: Any = None):
        self.config, self.cluster = config, cluster

    def place(self, request: PlacementRequest) -> LocalPlacement:
        # The precision first: it may decide what the model code imports (bf16: no torchao).
        precision = request.precision.create() if request.precision is not None else None
        family = request.model.create()
        loaded = family.load(alphabet=request.alphabet, seed=request.seed)
        if request.check_tokenizer is not None:
            request.check_tokenizer(loaded.tokenizer)
        # Each made once, here, and shared: the sampler (the driver's and the engine's), the
        # replay strategies (the backend's and the engine's).
        sampler = request.sampler.create() if request.sampler is not None else None
        replay = [choice.create() for choice in request.replay]
        transport = request.weight_sync.create() if request.weight_sync is not None else None
        backend = start_backend(request, loaded, request.algorithm, precision, replay)
        engine = start_engine(request, loaded, precision, sampler, replay) if request.engine is not None else None
        return LocalPlacement(family, loaded, backend, engine, transport, request.model.traits, sampler)


def check_local(spec: Any) -> list[tuple[str, str]]:
    """One process places one backend rank and one engine."""
    return [
        (f"cluster.{key}", f'more than one needs launcher = "ray" (launcher is {spec.cluster.launcher!r})')
        for key in ("trainer_ranks", "engine_replicas")
        if getattr(spec.cluster, key) > 1
    ]


@hookimpl
def skyrl_register_launchers(register: Any) -> None:
    register("local", LocalLauncher, description="Everything in the driver's process (the default)", check=check_local)
