"""A job on a Ray cluster it did not start, of several nodes (``ray.cluster_utils.Cluster``:
one raylet per node, each with its own resources, all on this machine): ``[cluster]
address`` attaches to it, ``trainer_resources`` / ``engine_resources`` put the backend's
rank on the trainer's node and the engine's replica on an engine node, the weights cross
between the two nodes' processes, and the job learns exactly as in one process. The job
leaves the cluster running with none of its actors or placement groups behind; two jobs
at once on the same cluster do not collide."""

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
    """A head without CPUs (the drivers only) and three nodes: one for trainers (2 CPUs,
    resource trainer_node) and two for engines (1 CPU each, resource engine_node)."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ["RAY_AUTH_MODE"] = "disabled"
    folder = tempfile.mkdtemp(prefix="rayc")
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                         "temp_dir": folder})
    trainer = made.add_node(num_cpus=2, resources={"trainer_node": 2})
    engines = [made.add_node(num_cpus=1, resources={"engine_node": 1}) for _ in range(2)]
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


def _job(make_job, tmp_path, name: str, *, steps: int = 3):
    return make_job(tmp_path, name, job={"steps": steps}, engine={"dtype": "float32"},
                    cluster={"launcher": "ray", "cpus_per_actor": 1.0, "trainer_resources": {"trainer_node": 1},
                             "engine_resources": {"engine_node": 1}},
                    weight_sync={"transport": "delta", "uri": f"file://{tmp_path}/{name}-weights", "dtype": "float32"})


def test_a_job_attaches_places_by_node_resources_and_leaves_the_cluster_as_it_found_it(
        cluster, skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    made, trainer, engines = cluster
    local = skyrl_tiny_rl_job(tmp_path, "local", job={"steps": 3})
    assert skyrl_cli("run", str(local.path)).exit_code == 0
    job = _job(skyrl_tiny_rl_job, tmp_path, "attached")
    proc = _start(job.path, made.address)
    try:
        deadline = time.monotonic() + 300
        while len(placed := _actors(("BackendWorker", "EngineWorker"))) < 2:  # both built, the job running
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        nodes = {a["ActorClassName"]: a["Address"]["NodeID"] for a in placed}
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert nodes["BackendWorker"] == trainer.node_id
    assert nodes["EngineWorker"] in {e.node_id for e in engines}
    # The weights crossed from one node's process to the other's; the job learned as in one process.
    rows = job.rows()
    assert [r["sync_version"] for r in rows] == [1, 2, 3]
    assert [learning_metrics(r) for r in rows] == [learning_metrics(r) for r in local.rows()]
    # The cluster is still up, with every node, and nothing of the job's is left.
    import ray

    assert len([n for n in ray.nodes() if n["Alive"]]) == 4
    assert _actors(("BackendWorker", "EngineWorker")) == [] and _live_groups() == []
    assert ray.available_resources().get("trainer_node") == 2


def test_two_jobs_at_once_on_one_cluster_do_not_collide(cluster, skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    made, _, _ = cluster
    local = skyrl_tiny_rl_job(tmp_path, "local", job={"steps": 3})
    assert skyrl_cli("run", str(local.path)).exit_code == 0
    jobs = [_job(skyrl_tiny_rl_job, tmp_path, f"job{i}") for i in range(2)]
    procs = [_start(j.path, made.address) for j in jobs]
    try:
        errs = [p.communicate(timeout=600)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, err in zip(procs, errs):
        assert p.returncode == 0, err[-3000:]
    expected = [learning_metrics(r) for r in local.rows()]
    for j in jobs:
        assert [learning_metrics(r) for r in j.rows()] == expected
    assert _actors(("BackendWorker", "EngineWorker")) == [] and _live_groups() == []


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
