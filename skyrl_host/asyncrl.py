"""Asynchronous RL (``[job] mode = "async"``): generation runs ahead of training.

A producer thread generates the rollouts of the coming steps while the trainer trains
on the ones already generated. The staleness bound ``max_staleness = k`` fixes which
weights generate which step: the rollout of step ``t`` is generated with weight version
``max(v0, t - 1 - k)`` (``v0``: the version the run started from), and it is trained at
step ``t``, after version ``t - 1``, so every trained sample is at most ``k`` versions
behind the trainer (exactly ``k`` once the pipeline is full). ``k = 0`` is the
synchronous loop.

Two waits enforce it, and they make the schedule independent of timing: the producer
waits for version ``t - 1 - k`` before it generates step ``t``, and the trainer waits
before it publishes version ``v`` until every step that must be generated with an older
version (steps up to ``v + k``) has been. So weights are only handed over while the
engine is idle, a rollout never mixes versions, and a run is the same pure function of
the seed as a synchronous one.

With a staged hand-over whose engine half needs nothing more from the trainer (``delta``,
``nixl``, adapters: :class:`skyrl_host.interfaces.EngineSideCommit`) the second wait moves
to the producer: the trainer stages version ``v`` right after its step and trains on,
and the producer applies (commits) ``v`` itself, between two rollouts, just before the
first rollout that needs it (versions no rollout needs, at the end of a run, once it has
generated every step). The trainer then never waits for the engine to be idle; it waits
only, before staging ``v``, for ``v - 1`` to be committed (the engines may still be
reading it from where ``v`` is written). The schedule, and so the run, is the same. The
last version is staged and not applied: no rollout needs it.

In-flight updates (``weight_updates = "in_flight"``): the trainer publishes at once and
the engine applies the new version between two forwards of the generation in progress;
step ``t`` still starts with version ``t - 1 - k`` or newer, so the bound holds, but a
sample's tokens may come from several versions (the engine's ``token_versions`` side
channel says which) and the schedule depends on timing. ``weight_updates = "abort"``
publishes at once as well; the engine then aborts the requests in progress and resubmits
them with what they generated, prefilled again with the new weights.

``stale_samples = "drop"`` (:class:`DroppingPipeline`): instead of waiting for a version the
producer generates dataset positions ahead with the newest weights, into a buffer of
``k + 1`` rollouts; the trainer drops those more than ``k`` versions old and their
positions are generated again, so every position is trained once, in an order that
timing decides.

Resume: a checkpoint after step ``s`` holds the rollouts of steps ``s + 1 ..`` that are
already generated (made with versions older than ``s``, which a resumed run could not
remake); the step being generated, if any, uses version ``s`` and is generated again
after the resume. Every step's prompts are the dataset's prompts of that step, so no
prompt is trained twice or lost.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping


class ProducerFailed(Exception):
    """The rollout thread failed; raised in the trainer's thread with the cause chained."""


class RolloutPipeline:
    """Generates ``rollout(step)`` for steps ``first .. last`` in a thread, ``k`` steps ahead.

    ``rollout(step)`` returns whatever the trainer consumes (a tuple); ``saved`` maps
    steps to rollouts restored from a checkpoint (generated before the resume);
    ``on_start()`` runs first in the thread (per-thread settings, e.g. torch's thread count,
    which a new thread does not inherit); ``commit(version)``: the engines' half of a staged
    version, which the thread then runs before the first rollout that needs it (the trainer
    calls :meth:`hand_over` instead of :meth:`publish`)."""

    def __init__(
        self, rollout: Callable[[int], Any], *, first: int, last: int, max_staleness: int, version: int,
        saved: Mapping[int, Any] | None = None, on_start: Callable[[], None] | None = None, in_flight: bool = False,
        commit: Callable[[int], Mapping[str, float]] | None = None,
    ):
        self.rollout_fn, self.first, self.last, self.k = rollout, first, last, max_staleness
        self.on_start = on_start
        self.in_flight = in_flight  # publish at once: the engine applies it between two forwards
        if commit is not None and in_flight:
            raise ValueError("in-flight updates are committed by the trainer, at once")
        # The engines' half of a staged version, run by the producer before the rollout that
        # needs it (:meth:`hand_over`); None: the trainer publishes whole (:meth:`publish`).
        self.commit_fn = commit
        self.v0 = version  # the version published when the run (re)started
        self.published = version  # with commit_fn: staged, the engines' half maybe still to come
        self.committed = version  # with commit_fn: the version the engines hold
        self.synced: dict[int, Mapping[str, float]] = {}  # version -> its commit's metrics
        self.ready: dict[int, Any] = dict(saved or {})
        self.generated = max([first - 1, *self.ready])  # steps up to here are generated (or restored)
        self._cond = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self.busy_s = 0.0  # time the producer spent generating
        self.wait_s = 0.0  # time the producer waited for weights
        self._thread = threading.Thread(target=self._loop, name="skyrl-rollouts", daemon=True)
        self._thread.start()

    def version_for(self, step: int) -> int:
        """The weight version that generates ``step``'s rollout."""
        return max(self.v0, step - 1 - self.k)

    # -- the producer ------------------------------------------------------------------

    def _loop(self) -> None:
        step = self.generated + 1
        try:
            if self.on_start is not None:
                self.on_start()
            while step <= self.last:
                need = self.version_for(step)
                w0 = time.perf_counter()
                with self._cond:
                    while self.published < need and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                    # Never: publish() waits for this step (staged versions may run ahead: committed below).
                    if self.published != need and not self.in_flight and self.commit_fn is None:
                        raise RuntimeError(f"step {step} needs version {need}, the engine holds {self.published}")
                self.wait_s += time.perf_counter() - w0
                if self.commit_fn is not None and self.committed < need:
                    # Versions are needed one after another (each step one newer), so none is skipped.
                    if need != self.committed + 1:
                        raise RuntimeError(f"step {step} needs version {need}, the engines hold {self.committed}")
                    self._commit(need)  # the engine is idle: between two rollouts
                g0 = time.perf_counter()
                out = self.rollout_fn(step)
                self.busy_s += time.perf_counter() - g0
                with self._cond:
                    self.ready[step] = out
                    self.generated = step
                    self._cond.notify_all()
                step += 1
            # Every step is generated: commit the versions no rollout needed as they come, so
            # the trainer's hand-over never waits for one; all but the last.
            while self.commit_fn is not None and self.committed < self.last - 1:
                with self._cond:
                    while self.published <= self.committed and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                self._commit(self.committed + 1)
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _commit(self, version: int) -> None:
        stats = dict(self.commit_fn(version))  # type: ignore[misc]
        with self._cond:
            self.committed = version
            self.synced[version] = stats
            self._cond.notify_all()

    # -- the trainer's side ----------------------------------------------------------------

    def _raise(self) -> None:
        if self._error is not None:
            raise ProducerFailed(f"the rollout thread failed: {self._error}") from self._error

    def take(self, step: int) -> tuple[Any, float]:
        """``step``'s rollout (waiting for it) and the seconds waited."""
        t0 = time.perf_counter()
        with self._cond:
            while step not in self.ready:
                self._raise()
                self._cond.wait()
            out = self.ready.pop(step)
        return out, time.perf_counter() - t0

    def publish(self, version: int, publish: Callable[[int], Any]) -> tuple[Any, float]:
        """Hand version ``version`` to the engine with ``publish(version)`` once every step
        that older weights must generate is generated (the engine is then idle); returns
        what ``publish`` returned and the seconds waited."""
        t0 = time.perf_counter()
        upto = self.generated if self.in_flight else min(self.last, version + self.k)
        with self._cond:
            while self.generated < upto:
                self._raise()
                self._cond.wait()
        waited = time.perf_counter() - t0
        out = publish(version)
        with self._cond:
            self.published = version
            self._cond.notify_all()
        return out, waited

    def hand_over(self, version: int, stage: Callable[[int], Any]) -> tuple[Any, float]:
        """With ``commit`` (the producer commits): stage ``version`` with ``stage(version)``
        once the engines hold ``version - 1`` (they may still be reading it from where
        ``version`` goes) and leave its commit to the producer. Returns what ``stage``
        returned, with the metrics of ``version - 1``'s commit under it (the engines' half
        of the previous hand-over, made meanwhile), and the seconds waited."""
        assert self.commit_fn is not None
        t0 = time.perf_counter()
        with self._cond:
            while self.committed < version - 1:
                self._raise()
                self._cond.wait()
            previous = self.synced.pop(version - 1, {})
        waited = time.perf_counter() - t0
        out = stage(version)
        with self._cond:
            self.published = version
            self._cond.notify_all()
        return {**previous, **out}, waited

    def pending(self, through: int | None = None) -> dict[int, Any]:
        """The generated rollouts not trained yet (for a checkpoint), once every step up
        to ``through`` is generated (the steps that weights older than the checkpoint's
        generate: a resumed run could not remake them)."""
        with self._cond:
            upto = min(self.last, through) if through is not None else self.generated
            while self.generated < upto:
                self._raise()
                self._cond.wait()
            return dict(self.ready)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        # A rollout in progress is not interrupted; the thread is a daemon and ends with it.
        self._thread.join(timeout=0.1)


class DroppingPipeline:
    """``stale_samples = "drop"``: the producer never waits for a weight version.

    Rollouts are keyed by *dataset position* ``p`` (the prompts ``dataset.batch(p)``, the
    generation seed of ``p``), not by the step that trains them. The producer generates
    positions ``first .. last`` in order, a dropped position again before any new one,
    each with the newest version it has, as long as the buffer has room: at most
    ``k + 1`` rollouts generated and not trained, the one in progress included (when
    full it waits for the trainer to take one). At step ``t`` (the trainer holds version
    ``t - 1``) :meth:`take` drops every buffered rollout generated with a version older
    than ``t - 1 - k`` (they can only get older), queues their positions to be generated
    again, and trains the fresh rollout of the lowest position, waiting only when none is
    buffered. A trainer waiting publishes nothing, so the next rollout started is fresh:
    every step gets one. Positions never exceed ``last`` (the run's steps), so a run
    trains every position ``first .. last`` exactly once, in an order timing decides.

    With idle updates (``in_flight`` false) :meth:`publish` waits for the rollout in
    progress, and no rollout starts while a version is being handed over, so a rollout
    never mixes versions; with in-flight updates it publishes at once."""

    def __init__(
        self, rollout: Callable[[int], Any], *, first: int, last: int, max_staleness: int, version: int,
        saved: Mapping[str, Any] | None = None, on_start: Callable[[], None] | None = None, in_flight: bool = False,
        version_of: Callable[[Any], int] | None = None,
    ):
        import heapq

        self._heapq = heapq
        self.rollout_fn, self.last, self.k = rollout, last, max_staleness
        self.on_start, self.in_flight, self.version_of = on_start, in_flight, version_of
        self.bound = max_staleness + 1  # rollouts generated and not trained, the one in progress included
        self.published = version
        saved = saved or {}
        self.ready: dict[int, tuple[int, Any]] = dict(saved.get("ready", {}))  # position -> (version, rollout)
        self.todo: list[int] = sorted(saved.get("todo", []))  # dropped positions, generated again first
        self.next_position = int(saved.get("next_position", first))
        self.current: int | None = None  # the position being generated
        self._publishing = False
        self._cond = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self.busy_s = 0.0
        self.wait_s = 0.0
        self._thread = threading.Thread(target=self._loop, name="skyrl-rollouts", daemon=True)
        self._thread.start()

    _raise = RolloutPipeline._raise
    close = RolloutPipeline.close

    def _has_work(self) -> bool:
        return bool(self.todo) or self.next_position <= self.last

    def _loop(self) -> None:
        try:
            if self.on_start is not None:
                self.on_start()
            while True:
                w0 = time.perf_counter()
                with self._cond:
                    while not self._stop and (self._publishing or len(self.ready) + 1 > self.bound
                                              or not self._has_work()):
                        self._cond.wait()
                    if self._stop:
                        return
                    if self.todo:
                        position = self._heapq.heappop(self.todo)
                    else:
                        position, self.next_position = self.next_position, self.next_position + 1
                    self.current, version = position, self.published
                self.wait_s += time.perf_counter() - w0
                g0 = time.perf_counter()
                out = self.rollout_fn(position)
                self.busy_s += time.perf_counter() - g0
                if self.version_of is not None:  # the oldest weights in it, as the engine recorded them
                    version = int(self.version_of(out))
                with self._cond:
                    self.ready[position] = (version, out)
                    self.current = None
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def take(self, step: int) -> tuple[int, Any, list[Any], float]:
        """Step ``step``'s rollout: ``(position, rollout, dropped rollouts, seconds waited)``."""
        oldest = step - 1 - self.k  # the oldest version step ``step`` may train on
        dropped: list[Any] = []
        t0 = time.perf_counter()
        with self._cond:
            while True:
                self._raise()
                for position in [p for p, (v, _) in self.ready.items() if v < oldest]:
                    dropped.append(self.ready.pop(position)[1])
                    self._heapq.heappush(self.todo, position)
                if self.ready:
                    position = min(self.ready)
                    out = self.ready.pop(position)[1]
                    self._cond.notify_all()
                    break
                self._cond.notify_all()
                self._cond.wait()
        return position, out, dropped, time.perf_counter() - t0

    def publish(self, version: int, publish: Callable[[int], Any]) -> tuple[Any, float]:
        """Hand ``version`` over with ``publish(version)``: at once with in-flight updates,
        else once the rollout in progress (if any) is finished; returns what ``publish``
        returned and the seconds waited."""
        t0 = time.perf_counter()
        with self._cond:
            self._publishing = True
            while self.current is not None and not self.in_flight:
                self._raise()
                self._cond.wait()
        waited = time.perf_counter() - t0
        try:
            out = publish(version)
            with self._cond:
                self.published = version
        finally:
            with self._cond:
                self._publishing = False
                self._cond.notify_all()
        return out, waited

    def pending(self) -> dict[str, Any]:
        """What a checkpoint holds: the buffered rollouts with their versions, the
        positions to generate again (the one in progress included) and the next new one."""
        with self._cond:
            todo = sorted(self.todo + ([self.current] if self.current is not None else []))
            return {"ready": dict(self.ready), "todo": todo, "next_position": self.next_position}
