"""The Protocols each plugin kind implements: one per kind.

A registration hook registers a *factory*; the factory, called with the plugin's
validated config, returns an object of the matching Protocol below. The host and
the drivers only ever talk to plugins through these Protocols.

The engine/trainer contracts (ModelFamily, Engine, Backend, Algorithm, Sampler,
ReplayStrategy, Precision, WeightTransport) meet in a packed RolloutBatch. Only
their entry methods are fixed so far; the RL loop (issue 3) completes them with
the RolloutBatch contract. Dataset and JobDriver are complete.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import attrs


@attrs.frozen
class Task:
    """One prompt of a dataset, with what its reward function needs to score it."""

    prompt: str
    answer: str | None = None  # a reference completion that earns the maximal reward, if known
    meta: Mapping[str, Any] = attrs.field(factory=dict)


@runtime_checkable
class Dataset(Protocol):
    """Prompts and their reward. ``batch`` is a pure function of the dataset's seed
    and ``step``, so a resumed job sees exactly the prompts it would have seen."""

    def batch(self, step: int, size: int) -> Sequence[Task]:
        """``size`` tasks for ``step`` (counting from 1)."""
        ...

    def reward(self, task: Task, completion: str) -> float:
        """The reward of ``completion`` for ``task``, in [0, 1]."""
        ...


@runtime_checkable
class JobDriver(Protocol):
    """The loop of one job kind. Made by ``factory(run)``; reports each step with
    ``run.report(step, metrics)``."""

    def run(self) -> None: ...


@runtime_checkable
class ModelFamily(Protocol):
    """A model family: which transformers model types it covers, where its routers
    are, how it loads and saves (``[model] family``)."""

    model_types: Sequence[str]


@runtime_checkable
class Engine(Protocol):
    """Generates rollouts (``[engine] name``)."""

    def generate(self, prompts: Sequence[Any], sampler: Any) -> Any: ...


@runtime_checkable
class Backend(Protocol):
    """Owns parameters and optimizer; trains on rollouts (``[backend] name``)."""

    def train_step(self, batch: Any, algorithm: Any) -> Mapping[str, float]: ...


@runtime_checkable
class Algorithm(Protocol):
    """Advantages, filters and the policy loss (``[algorithm] name``)."""

    def advantages(self, batch: Any) -> Any: ...

    def loss(self, *args: Any, **kwargs: Any) -> Any: ...


@runtime_checkable
class Sampler(Protocol):
    """Chooses the next token from logits (``[sampler] name``)."""

    def sample(self, logits: Any, generator: Any) -> Any: ...


@runtime_checkable
class ReplayStrategy(Protocol):
    """Replays what the engine did inside the trainer's forward
    (``[replay] strategies``)."""

    def attach(self, model: Any, batch: Any) -> Any: ...


@runtime_checkable
class Precision(Protocol):
    """How the backend computes and what the sender ships (``[precision] name``)."""

    def prepare_model(self, model: Any) -> Any: ...


@runtime_checkable
class WeightTransport(Protocol):
    """Moves new weights from the backend's sender to the engine's receiver
    (``[weight_sync] transport``)."""

    def sender(self, *args: Any, **kwargs: Any) -> Any: ...

    def receiver(self, *args: Any, **kwargs: Any) -> Any: ...


PROTOCOLS: Mapping[str, type] = {
    "models": ModelFamily,
    "algorithms": Algorithm,
    "replay_strategies": ReplayStrategy,
    "precisions": Precision,
    "weight_transports": WeightTransport,
    "samplers": Sampler,
    "datasets": Dataset,
    "engines": Engine,
    "backends": Backend,
    "jobs": JobDriver,
}
