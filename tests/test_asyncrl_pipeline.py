"""skyrl_host.asyncrl.DroppingPipeline on its own (no model): a rollout is a record of
the dataset position and the version it was generated with, the trainer a loop that
takes, "trains" (sleeps) and publishes. Whatever the timing: nothing older than k is
trained, every position once, and a rollout never spans a hand-over with idle updates."""

from __future__ import annotations

import threading
import time

import pytest

from skyrl_host.asyncrl import DroppingPipeline, ProducerFailed


def run_trainer(*, steps, k, gen_s, train_s, in_flight=False, saved=None, first_step=1, stop_after=None):
    engine = {"version": first_step - 1, "busy": 0, "mixed": 0}
    lock = threading.Lock()

    def rollout(position):
        with lock:
            engine["busy"] += 1
            start = engine["version"]
        time.sleep(gen_s)
        with lock:
            engine["busy"] -= 1
            engine["mixed"] += engine["version"] != start  # a version landed during the rollout
        return {"position": position, "version": start}

    def publish(version):
        with lock:
            engine["version"] = version

    pipe = DroppingPipeline(rollout, first=1, last=steps, max_staleness=k, version=first_step - 1, saved=saved,
                            in_flight=in_flight, version_of=lambda out: out["version"])
    trained, dropped, max_buffer = [], 0, 0
    try:
        for step in range(first_step, steps + 1):
            position, out, gone, _ = pipe.take(step)
            assert out["position"] == position
            trained.append((step, position, out["version"]))
            dropped += len(gone)
            assert all(step - 1 - g["version"] > k for g in gone)
            time.sleep(train_s)
            pipe.publish(step, publish)
            with pipe._cond:
                max_buffer = max(max_buffer, len(pipe.ready) + (pipe.current is not None))
            if stop_after == step:
                return trained, dropped, pipe.pending(), engine
    finally:
        pipe.close()
    return trained, dropped, max_buffer, engine


@pytest.mark.parametrize("k", [1, 2])
def test_a_fast_engine_drops_and_still_trains_every_position_once_within_k(k) -> None:
    trained, dropped, max_buffer, engine = run_trainer(steps=24, k=k, gen_s=0.002, train_s=0.02)
    assert sorted(p for _, p, _ in trained) == list(range(1, 25))
    assert all(step - 1 - v <= k for step, _, v in trained)
    assert dropped > 0  # the engine ran k + 1 rollouts ahead of a slow trainer
    assert max_buffer <= k + 1
    assert engine["mixed"] == 0  # idle updates: a publish waits for the rollout in progress


def test_resuming_from_pending_trains_the_rest_once() -> None:
    first, _, pending, _ = run_trainer(steps=16, k=1, gen_s=0.002, train_s=0.02, stop_after=6)
    done = {p for _, p, _ in first}
    untrained = set(pending["ready"]) | set(pending["todo"]) | set(range(pending["next_position"], 17))
    assert not done & untrained and done | untrained == set(range(1, 17))
    rest, _, _, _ = run_trainer(steps=16, k=1, gen_s=0.002, train_s=0.02, saved=pending, first_step=7)
    assert sorted(done | {p for _, p, _ in rest}) == list(range(1, 17)) and len(first) + len(rest) == 16
    assert all(step - 1 - v <= 1 for step, _, v in rest)


def test_a_failing_rollout_reaches_the_trainer() -> None:
    def rollout(position):
        raise ValueError("engine broke")

    pipe = DroppingPipeline(rollout, first=1, last=4, max_staleness=1, version=0)
    try:
        with pytest.raises(ProducerFailed, match="engine broke"):
            pipe.take(1)
    finally:
        pipe.close()


def test_a_checkpoint_counts_the_rollout_in_progress_as_not_generated() -> None:
    started, release = threading.Event(), threading.Event()

    def rollout(position):
        if position == 2:
            started.set()
            release.wait(10)
        return {"position": position, "version": 0}

    pipe = DroppingPipeline(rollout, first=1, last=4, max_staleness=1, version=0, version_of=lambda o: o["version"])
    try:
        assert pipe.take(1)[0] == 1
        assert started.wait(10)
        pending = pipe.pending()  # position 2 is being generated: a resume generates it again
        assert pending == {"ready": {}, "todo": [2], "next_position": 3}
    finally:
        release.set()
        pipe.close()
