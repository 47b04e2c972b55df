"""skyrl_host.asyncrl's pipelines on their own (no model): a rollout is a record of the
dataset position (or step) and the version it was generated with, the trainer a loop
that takes, "trains" (sleeps) and publishes. DroppingPipeline, whatever the timing:
nothing older than k is trained, every position once, and a rollout never spans a
hand-over with idle updates. RolloutPipeline with the rollout thread committing staged
versions: the same schedule as the trainer publishing, versions applied in order only
while no rollout runs, and the trainer never waiting for a rollout to end to stage."""

from __future__ import annotations

import threading
import time

import pytest

from skyrl_host.asyncrl import DroppingPipeline, ProducerFailed, RolloutPipeline


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


def run_staged(*, steps, k, gen_s, train_s, commit_fails_at=None):
    """The trainer stages each version (``hand_over``); the rollout thread commits it."""
    engine = {"version": 0, "busy": False, "commits": [], "during_rollout": 0, "staged": []}
    lock = threading.Lock()

    def rollout(step):
        with lock:
            engine["busy"] = True
            version = engine["version"]
        time.sleep(gen_s)
        with lock:
            engine["busy"] = False
        return {"step": step, "version": version}

    def commit(version):
        if version == commit_fails_at:
            raise RuntimeError(f"version {version} is corrupt")
        with lock:
            engine["during_rollout"] += engine["busy"]
            engine["version"] = version
            engine["commits"].append(version)
        return {"sync_applied": 1.0, "sync_applied_version": float(version)}

    def stage(version):
        with lock:
            engine["staged"].append((version, engine["version"]))  # what the engines held then
        return {"sync_version": float(version)}

    pipe = RolloutPipeline(rollout, first=1, last=steps, max_staleness=k, version=0, commit=commit)
    rows, waits = [], []
    try:
        for step in range(1, steps + 1):
            out, _ = pipe.take(step)
            time.sleep(train_s)
            stats, waited = pipe.hand_over(step, stage)
            rows.append((step, out["version"], stats))
            waits.append(waited)
    finally:
        pipe.close()
    return rows, waits, engine


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("gen_s, train_s", [(0.002, 0.02), (0.02, 0.002)])
def test_the_rollout_thread_commits_each_version_just_before_the_rollout_that_needs_it(k, gen_s, train_s) -> None:
    steps = 12
    rows, _waits, engine = run_staged(steps=steps, k=k, gen_s=gen_s, train_s=train_s)
    # The schedule of the trainer publishing: step t from version max(0, t - 1 - k).
    assert [v for _, v, _ in rows] == [max(0, t - 1 - k) for t in range(1, steps + 1)]
    # Every version but the last applied once, in order, never while a rollout ran.
    assert engine["commits"] == list(range(1, steps)) and engine["during_rollout"] == 0
    # Version v was staged once the engines held v - 1 (they may read it from where v goes).
    assert engine["staged"] == [(v, v - 1) for v in range(1, steps + 1)]
    # Row t: version t staged, version t - 1's commit reported under it.
    assert all(s["sync_version"] == t for t, _, s in rows)
    assert "sync_applied" not in rows[0][2]
    assert [s["sync_applied_version"] for _, _, s in rows[1:]] == list(range(1, steps))


def test_a_trainer_staging_never_waits_for_a_slow_rollout() -> None:
    """With k = 1 the trainer stages version t while step t + 1 is generated; before, its
    publish waited for that rollout to end."""
    _rows, waits, _engine = run_staged(steps=6, k=1, gen_s=0.2, train_s=0.0)
    assert max(waits) < 0.1, waits  # a rollout takes 0.2 s


def test_a_failing_commit_reaches_the_trainer() -> None:
    with pytest.raises(ProducerFailed, match="version 3 is corrupt"):
        run_staged(steps=8, k=1, gen_s=0.001, train_s=0.001, commit_fails_at=3)


def test_a_checkpoint_waits_for_the_rollouts_older_weights_make() -> None:
    """pending(through=s + k) after step s: the rollouts of steps up to s + k, made with
    versions older than s (a resume could not remake them), all there."""
    release = threading.Event()

    def rollout(step):
        if step == 3:
            release.wait(10)
        return {"step": step}

    pipe = RolloutPipeline(rollout, first=1, last=6, max_staleness=2, version=0, commit=lambda v: {})
    try:
        pipe.take(1)
        threading.Timer(0.2, release.set).start()
        t0 = time.perf_counter()
        pending = pipe.pending(through=1 + 2)
        assert sorted(pending) == [2, 3] and time.perf_counter() - t0 >= 0.15
    finally:
        release.set()
        pipe.close()
