"""The rl job's rollout sources and weight hand-overs on their own (no model): a rollout
is a packed batch whose ``versions`` are the weights the "engine" held when it was made,
the placement a record of what was published, staged and committed, in order."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from skyrl_host.jobs.rl_handover import Publish, PublishWhenIdle, StageForTheProducer, StageThenCommit, Training
from skyrl_host.jobs.rl_sources import DroppingSource, Rollout, WaitingSource
from skyrl_host.rollout import RolloutBatch
from skyrl_host.checkpoints import read_state
from skyrl_host.statefile import save_state


class Engine:
    """What the sources' rollouts are made from: the version the placement handed over last."""

    def __init__(self) -> None:
        self.version = 0
        self.events: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    # the placement's side
    def publish(self, version: int) -> dict[str, float]:
        with self.lock:
            self.events.append(("publish", version))
            self.version = version
        return {"sync_bytes": 10.0 * version}

    def stage(self, version: int) -> dict[str, float]:
        with self.lock:
            self.events.append(("stage", version))
        return {"staged_bytes": float(version)}

    def commit(self, version: int) -> dict[str, float]:
        with self.lock:
            self.events.append(("commit", version))
            self.version = version
        return {"commit_s": 0.001}


class Steps:
    """A synchronous source: step ``s``'s rollout is two sequences made with the engine's version."""

    def __init__(self, engine: Engine):
        self.engine, self.made = engine, []

    def take(self, step: int) -> Rollout:
        v = self.engine.version
        self.made.append(step)
        batch = RolloutBatch.from_sequences([[1, 2], [1, 3]], [[4, 5, 6], [7]], [[-0.1] * 3, [-0.2]],
                                            group_ids=[step, step], versions=v)
        return Rollout(batch, np.array([1.0, 0.0], np.float32), {"weight_version": float(v), "step": float(step)},
                       0.01, 4)


def test_a_waiting_source_generates_each_step_with_the_version_the_bound_names() -> None:
    engine = Engine()
    source = WaitingSource(Steps(engine), first=1, last=6, max_staleness=1, version=0, threads=1, in_flight=False)
    source.start()
    handover = PublishWhenIdle(engine, source.pipeline)
    try:
        for step in range(1, 7):
            rollout = source.take(step)
            assert rollout.metrics["step"] == step
            assert rollout.metrics["weight_version"] == max(0, step - 2)  # t - 1 - k
            assert rollout.metrics["staleness_max"] == min(step - 1, 1)
            assert rollout.metrics["rollout_wait_time_s"] >= 0
            out = handover.after_train(step, None)
            assert out["sync_bytes"] == 10.0 * step and out["publish_wait_time_s"] >= 0
            assert 0 <= source.after_step(0.5)["engine_idle_fraction"] <= 1
    finally:
        source.close()
    assert [e for e in engine.events] == [("publish", v) for v in range(1, 7)]


def test_a_waiting_sources_checkpoint_restores_the_rollouts_made_with_older_weights(tmp_path) -> None:
    engine = Engine()
    source = WaitingSource(Steps(engine), first=1, last=8, max_staleness=2, version=0, threads=1, in_flight=False)
    source.start()
    handover = PublishWhenIdle(engine, source.pipeline)
    try:
        for step in (1, 2, 3):
            source.take(step)
            handover.after_train(step, None)
        state = source.state_dict(3)  # steps 4 and 5 were generated with versions 1 and 2
    finally:
        source.close()
    assert state["steps"] == [4, 5]
    save_state(state, tmp_path / "rollouts.safetensors")
    restored = read_state(tmp_path, "rollouts")
    engine.version = 3
    inner = Steps(engine)
    again = WaitingSource(inner, first=4, last=8, max_staleness=2, version=3, threads=1, in_flight=False)
    again.load_state_dict(restored)
    again.start()
    try:
        r4, r5, r6 = again.take(4), again.take(5), again.take(6)
    finally:
        again.close()
    assert (r4.metrics["weight_version"], r5.metrics["weight_version"]) == (1.0, 2.0)
    assert np.array_equal(r4.batch.tokens, state["rollouts"][4][0].tokens)
    assert r6.metrics["weight_version"] == 3.0 and inner.made[0] == 6  # only the new steps are generated


def test_a_checkpoint_of_the_other_stale_samples_mode_is_refused() -> None:
    source = DroppingSource(Steps(Engine()), first=4, last=8, max_staleness=1, version=3, threads=1, in_flight=False)
    with pytest.raises(ValueError, match='written with \\[job\\] stale_samples = "wait", the job says "drop"'):
        source.load_state_dict({"steps": [], "rollouts": {}})


def test_a_dropping_source_trains_every_position_once_and_reports_drops() -> None:
    engine = Engine()
    source = DroppingSource(Steps(engine), first=1, last=10, max_staleness=1, version=0, threads=1, in_flight=False)
    source.start()
    handover = StageThenCommit(engine, source.pipeline)
    positions = []
    try:
        for step in range(1, 11):
            rollout = source.take(step)
            positions.append(int(rollout.metrics["dataset_position"]))
            assert step - 1 - rollout.metrics["weight_version"] <= 1
            assert rollout.metrics["dropped_samples"] % 2 == 0  # whole rollouts of two sequences
            out = handover.after_train(step, None)
            assert out["staged_bytes"] == step and "commit_s" in out
    finally:
        source.close()
    assert sorted(positions) == list(range(1, 11))
    assert engine.events[:2] == [("stage", 1), ("commit", 1)]


class Backend:
    """Records when a train step starts and ends, beside the engine's events."""

    def __init__(self, events: list[tuple[str, int]]):
        self.events = events

    def train_step(self, batch, advantages, algorithm, **kw):
        self.events.append(("train", 0))
        return {"loss": 1.5, "tokens_per_s": 1.0}

    def start_train_step(self, batch, advantages, algorithm, **kw):
        self.events.append(("train started", 0))

        def finish():
            self.events.append(("train finished", 0))
            return {"loss": 2.5}, 0.25

        return finish


def batch() -> RolloutBatch:
    return RolloutBatch.from_sequences([[1]], [[2, 3]], [[-0.5, -0.5]], group_ids=[0])


def test_a_publish_follows_the_train_step_and_the_drivers_timing_replaces_the_backends() -> None:
    engine = Engine()
    training = Training(Backend(engine.events), batch(), np.ones(1, np.float32), None, temperature=1.0,
                        max_new_tokens=4)
    out = Publish(engine).after_train(1, training)
    assert engine.events == [("train", 0), ("publish", 1)] and out == {"sync_bytes": 10.0}
    metrics = training.metrics()
    assert metrics["loss"] == 1.5 and "tokens_per_s" not in metrics and metrics["train_tokens_per_s"] > 0


def test_staging_for_the_rollout_thread_is_sent_while_an_ordered_train_step_runs() -> None:
    engine = Engine()
    source = WaitingSource(Steps(engine), first=1, last=3, max_staleness=1, version=0, threads=1, in_flight=False)
    source.start(commit=engine.commit)
    handover = StageForTheProducer(engine, source.pipeline, ordered_training=True)
    try:
        source.take(1)
        training = Training(Backend(engine.events), batch(), np.ones(1, np.float32), None, temperature=1.0,
                            max_new_tokens=4, ordered=handover.ordered_training)
        handover.after_train(1, training)
        assert engine.events[:3] == [("train started", 0), ("stage", 1), ("train finished", 0)]
        assert training.metrics() == {"loss": 2.5, "train_tokens_per_s": pytest.approx(3 / 0.25)}
        source.take(2)  # made with version 0 (t - 1 - k), before the thread commits version 1
        source.take(3)  # the thread committed version 1 first
    finally:
        source.close()
    assert ("commit", 1) in engine.events
