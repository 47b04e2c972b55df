"""How the ``rl`` job hands each trained version to the engines: one
:class:`WeightHandover`, chosen once in ``RLDriver.build``.

- :class:`Publish` (``mode = "sync"``): the placement publishes the version whole, after
  the train step;
- :class:`PublishWhenIdle` (async, a placement that publishes in one piece): once the
  rollouts older weights must generate are generated (at once with in-flight updates);
- :class:`StageThenCommit` (async, a :class:`~skyrl_host.interfaces.StagedPlacement`):
  the trainer's half is sent while the engines still generate; the engines' half waits
  for them to be idle;
- :class:`StageForTheProducer` (async, staged, an
  :class:`~skyrl_host.interfaces.EngineSideCommit` placement): the trainer stages the
  version and trains on; the rollout thread commits it just before the first rollout
  that needs it. With an :class:`~skyrl_host.interfaces.OrderedTrainStep` backend the
  stage is sent while the train step still runs and runs right after it.

:class:`Training` is a train step in progress; a hand-over decides when to wait for it.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Protocol


class Training:
    """One train step on the backend. Started at once: whole (``train_step``), or, when
    ``ordered``, as ``start_train_step``, whose result :meth:`finish` waits for (the
    backend runs what is sent meanwhile after the step)."""

    def __init__(self, backend: Any, batch: Any, advantages: Any, algorithm: Any, *, temperature: float,
                 max_new_tokens: int, ordered: bool = False):
        self.n_tokens = int(batch.n_tokens)
        t0 = time.perf_counter()
        kwargs = dict(temperature=temperature, max_new_tokens=max_new_tokens)
        self._finish: Callable[[], tuple[Mapping[str, float], float]] | None = None
        self._result: tuple[Mapping[str, float], float] | None = None
        if ordered:
            self._finish = backend.start_train_step(batch, advantages, algorithm, **kwargs)
        else:
            out = backend.train_step(batch, advantages, algorithm, **kwargs)
            self._result = (out, time.perf_counter() - t0)

    def finish(self) -> None:
        """Wait for the step (once)."""
        if self._result is None:
            assert self._finish is not None
            self._result = self._finish()

    def metrics(self) -> dict[str, float]:
        """The backend's metrics, and tokens/s as the driver measures it for every backend
        (the backend's own timings are superseded)."""
        self.finish()
        out, seconds = self._result  # type: ignore[misc]
        metrics = {k: float(v) for k, v in out.items() if k not in ("tokens_per_s", "step_time_s")}
        metrics["train_tokens_per_s"] = float(self.n_tokens / max(seconds, 1e-9))
        return metrics


class WeightHandover(Protocol):
    #: start train steps ordered (``start_train_step``) so that the hand-over can be sent
    #: while they run
    ordered_training: bool

    def after_train(self, version: int, training: Training | None) -> dict[str, float]:
        """Hand version ``version`` (the step just trained: ``training``, None when the step
        had nothing to train) to the engines; the hand-over's metrics."""


class Publish:
    """``mode = "sync"``: the placement publishes the whole version after the train step."""

    ordered_training = False

    def __init__(self, placement: Any):
        self.placement = placement

    def after_train(self, version: int, training: Training | None) -> dict[str, float]:
        if training is not None:
            training.finish()
        return {k: float(v) for k, v in self.placement.publish(version).items()}


class PublishWhenIdle:
    """Async, one-piece publish: once every step older weights must generate is generated
    (the engines are idle), or at once with in-flight updates (``pipeline``: the source's
    :class:`skyrl_host.asyncrl.RolloutPipeline` or ``DroppingPipeline``)."""

    ordered_training = False

    def __init__(self, placement: Any, pipeline: Any):
        self.placement, self.pipeline = placement, pipeline

    def after_train(self, version: int, training: Training | None) -> dict[str, float]:
        if training is not None:
            training.finish()
        sync, waited = self.pipeline.publish(version, self.placement.publish)
        return {"publish_wait_time_s": waited, **{k: float(v) for k, v in sync.items()}}


class StageThenCommit(PublishWhenIdle):
    """Async, staged: send (``delta``: also fetch and verify) while the engines still
    generate; the apply, once they are idle, is the only pause."""

    def after_train(self, version: int, training: Training | None) -> dict[str, float]:
        if training is not None:
            training.finish()
        sent = dict(self.placement.stage(version))
        sync, waited = self.pipeline.publish(version, self.placement.commit)
        return {"publish_wait_time_s": waited, **{k: float(v) for k, v in {**sent, **sync}.items()}}


class StageForTheProducer:
    """Async, staged, the engines' half needing nothing more from the trainer: the trainer
    stages (once the engines hold the previous version) and trains on; the rollout thread
    commits. The metrics are this version's stage and the previous version's commit."""

    def __init__(self, placement: Any, pipeline: Any, *, ordered_training: bool):
        self.placement, self.pipeline = placement, pipeline
        self.ordered_training = ordered_training  # stage right behind the train step, sent while it runs

    def after_train(self, version: int, training: Training | None) -> dict[str, float]:
        sync, waited = self.pipeline.hand_over(version, self.placement.stage)
        if training is not None:
            training.finish()
        return {"publish_wait_time_s": waited, **{k: float(v) for k, v in sync.items()}}
