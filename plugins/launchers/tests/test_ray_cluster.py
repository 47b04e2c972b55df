"""Jobs on a Ray cluster they did not start, of several nodes (``ray.cluster_utils.Cluster``:
one raylet per node, each with its own resources, all on this machine, which a test can
remove and add): ``[cluster] address`` attaches to it, ``trainer_resources`` /
``engine_resources`` put each backend rank on the trainer's node and each engine replica
on an engine node. A lost engine node is survived and its replica restarted; a lost
trainer node stops a job with one message, and ``--resume``, or ``[cluster]
max_restarts``, continues it with no step lost. (Every transport between nodes with
addresses of their own, and several jobs at once: test_ray_netns.py.)"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import pytest

from skyrl_host.testing import learning_metrics

pytestmark = pytest.mark.slow

SKYRL = str(pathlib.Path(sys.executable).parent / "skyrl")


@pytest.fixture(scope="module")
def cluster():
    """A head without CPUs (the drivers only) and three nodes: one for trainers (3 CPUs,
    resource trainer_node) and two for engines (2 CPUs each, resource engine_node)."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ["RAY_AUTH_MODE"] = "disabled"
    folder = tempfile.mkdtemp(prefix="rayc")
    # Cluster writes its address in Ray's default folder (/tmp/ray), which a new machine lacks.
    os.makedirs(os.path.dirname(ray._private.utils.get_ray_address_file(None)), exist_ok=True)
    made = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "temp_dir": folder,
        # A removed node is found dead within ~3 s (Ray's default: ~15 s).
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}})
    trainer = made.add_node(num_cpus=3, resources={"trainer_node": 3})
    engines = [made.add_node(num_cpus=2, resources={"engine_node": 2}) for _ in range(2)]
    made.wait_for_nodes()
    ray.init(address=made.address, configure_logging=False)
    try:
        yield made, trainer, engines
    finally:
        ray.shutdown()
        made.shutdown()
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def _actors(classes: tuple[str, ...]) -> list[dict]:
    import ray

    table = ray._private.state.actors()
    return [a for a in table.values() if a["State"] == "ALIVE" and a["ActorClassName"] in classes]


def _live_groups() -> list[str]:
    import ray

    return [g for g, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"]


def _start(job: pathlib.Path, address: str) -> subprocess.Popen:
    return subprocess.Popen([SKYRL, "run", str(job), "--set", f"cluster.address={json.dumps(address)}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, RAY_AUTH_MODE="disabled"))


def _job(make_job, tmp_path, name: str, *, steps: int = 3, weight_sync: dict | None = None,
         cluster: dict | None = None, **job):
    return make_job(tmp_path, name, job={"steps": steps, **job}, engine={"dtype": "float32"},
                    cluster={"launcher": "ray", "cpus_per_actor": 1.0, "trainer_resources": {"trainer_node": 1},
                             "engine_resources": {"engine_node": 1}, **(cluster or {})},
                    weight_sync=weight_sync or {"transport": "delta", "uri": f"file://{tmp_path}/{name}-weights",
                                                "dtype": "float32"})


def test_resources_no_node_holds_are_refused_at_once(cluster, skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    made, _, _ = cluster
    job = skyrl_tiny_rl_job(tmp_path, "nowhere", engine={"dtype": "float32"},
                            cluster={"launcher": "ray", "address": made.address, "trainer_resources": {"gpu_node": 1}},
                            weight_sync={"transport": "delta", "uri": f"file://{tmp_path}/w", "dtype": "float32"})
    started = time.monotonic()
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert "[cluster] trainer_resources: no node of the Ray cluster holds 'gpu_node'" in result.stderr
    assert time.monotonic() - started < 60  # not Ray's placement timeout
    assert _live_groups() == []
    bad = skyrl_tiny_rl_job(tmp_path, "cpu_key", cluster={"launcher": "ray", "engine_resources": {"CPU": 1}})
    result = skyrl_cli("validate", str(bad.path))
    assert result.exit_code == 2 and "engine_resources" in result.stderr and "Ray's own resource" in result.stderr


def test_a_job_without_address_starts_its_own_ray_beside_a_running_cluster(
        cluster, skyrl_tiny_rl_job, tmp_path) -> None:
    """Ray's own default would join the cluster last started on this machine (the module's:
    ``ray_current_cluster``); a job without ``address`` starts an instance of its own."""
    import ray

    before = len(ray._private.state.jobs())
    job = skyrl_tiny_rl_job(tmp_path, "own", job={"steps": 2}, engine={"dtype": "float32"},
                            cluster={"launcher": "ray", "cpus_per_actor": 0.5},
                            weight_sync={"transport": "delta", "uri": f"file://{tmp_path}/w", "dtype": "float32"})
    done = subprocess.run([SKYRL, "run", str(job.path)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, RAY_AUTH_MODE="disabled"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in job.rows()] == [1, 2]
    assert len(ray._private.state.jobs()) == before  # no driver of it joined the module's cluster


def _rows(job) -> list[dict]:
    return job.rows() if (job.out / "metrics.jsonl").exists() else []


def _wait_step(job, proc: subprocess.Popen, n: int) -> None:
    """Until the job has written step ``n``'s row (it has steps left to run after it)."""
    deadline = time.monotonic() + 300
    while not any(r["step"] >= n for r in _rows(job)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_a_lost_engine_node_the_job_goes_on_and_restarts_its_replica_with_the_current_weights(
        cluster, skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    """A job with two engine replicas, a whole engine node each; one of the nodes is
    removed mid-run and another joins. The job goes on with the surviving replica (which
    generates the lost one's prompts, with its seed), restarts the lost one on the new
    node, hands it the current weights (``delta``: from the store's keyframe) and learns
    exactly as the same job with no loss; the restarted replica generates (nothing is
    regenerated once it is back)."""
    import ray

    made, _, _ = cluster
    steps = 100
    two = {"engine_replicas": 2, "engine_resources": {"engine_node": 2}}  # a replica per engine node
    ref = _job(skyrl_tiny_rl_job, tmp_path, "whole", steps=steps, cluster=two)
    assert skyrl_cli("run", str(ref.path), "--set", f"cluster.address={json.dumps(made.address)}").exit_code == 0
    job = _job(skyrl_tiny_rl_job, tmp_path, "lost", steps=steps, cluster=two)
    proc = _start(job.path, made.address)
    nodes = {n.node_id: n for n in made.worker_nodes}
    try:
        _wait_step(job, proc, 5)
        (doomed, *_) = sorted(a["Address"]["NodeID"] for a in _actors(("EngineWorker",)))
        made.remove_node(nodes[doomed], allow_graceful=False)
        made.add_node(num_cpus=2, resources={"engine_node": 2})  # room for the lost replica again
        restarted_on: set[str] = set()
        while proc.poll() is None:
            restarted_on |= {a["Address"]["NodeID"] for a in _actors(("EngineWorker",))} - set(nodes)
            time.sleep(0.5)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    assert len(restarted_on) == 1  # the lost replica, on the node that joined
    lines = err.splitlines()
    assert sum("notice: engine replica" in x and "lost (the Ray actor EngineWorker" in x for x in lines) == 1, err[-3000:]
    assert sum("notice: engine replica" in x and "restarted with weight version" in x for x in lines) == 1, err[-3000:]
    rows = job.rows()
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    counted = [r for r in rows if "engine_replicas_lost" in r]
    assert counted[0]["step"] > 5 and counted[0]["engine_replicas_live"] == 1
    last = rows[-1]
    assert (last["engine_replicas_lost"], last["engine_replicas_restarted"], last["engine_replicas_live"]) == (1, 1, 2)
    # The survivor generated the lost replica's prompts (8 a step: 4 a replica) until the
    # restart; from then on the restarted one generated its own.
    back = next(r["step"] for r in rows if r.get("engine_replicas_restarted") == 1)
    assert back < steps - 5, back
    regenerated = [r["engine_prompts_regenerated"] for r in counted]
    assert regenerated[-1] >= 4 and len({x for r, x in zip(counted, regenerated) if r["step"] >= back}) == 1
    same = [{k: v for k, v in learning_metrics(r).items() if not k.startswith(("engine_replicas", "engine_prompts"))}
            for r in rows]
    assert same == [learning_metrics(r) for r in ref.rows()]
    assert _actors(("BackendWorker", "EngineWorker")) == [] and _live_groups() == []
    # Two engine nodes, as the module's cluster began, every resource free.
    deadline = time.monotonic() + 60
    while ray.available_resources().get("engine_node") != 4:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.2)


def test_a_lost_trainer_node_stops_the_job_and_resume_or_max_restarts_continue(
        cluster, skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    """Runs last in the module: it replaces the trainer node (twice)."""
    made, trainer, _ = cluster
    # 80 steps: a node removed at step 6 (or 12) dies with tens of steps still to run.
    local = skyrl_tiny_rl_job(tmp_path, "local", job={"steps": 80, "checkpoint_every": 4})
    assert skyrl_cli("run", str(local.path)).exit_code == 0
    job = _job(skyrl_tiny_rl_job, tmp_path, "lost", steps=80, checkpoint_every=4)
    # 1. The trainer's node dies mid-run: one message, exit 1, the cluster's other nodes untouched.
    proc = _start(job.path, made.address)
    try:
        _wait_step(job, proc, 6)
        made.remove_node(trainer, allow_graceful=False)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "BackendWorker" in lines[0] and "of this job died" in lines[0], err[-3000:]
    assert "`skyrl run JOB --resume` continues from the last checkpoint" in lines[0]
    # 2. A new trainer node; --resume with max_restarts = 1; that node dies too, and the job
    #    resumes by itself on a third one.
    second = made.add_node(num_cpus=3, resources={"trainer_node": 3})
    made.wait_for_nodes()
    proc = subprocess.Popen([SKYRL, "run", str(job.path), "--resume", "--set", f"cluster.address={json.dumps(made.address)}",
                             "--set", "cluster.max_restarts=1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, RAY_AUTH_MODE="disabled"))
    try:
        _wait_step(job, proc, 12)  # past anything the first run wrote: the resumed run is going
        made.remove_node(second, allow_graceful=False)
        made.add_node(num_cpus=3, resources={"trainer_node": 3})
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "resuming from the last checkpoint (restart 1 of 1, [cluster] max_restarts)" in err
    # Every step once, and the run is the uninterrupted one: no acknowledged step lost.
    rows = job.rows()
    assert [r["step"] for r in rows] == list(range(1, 81))
    assert [learning_metrics(r) for r in rows] == [learning_metrics(r) for r in local.rows()]
    assert _actors(("BackendWorker", "EngineWorker")) == [] and _live_groups() == []
