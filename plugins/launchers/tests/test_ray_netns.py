"""Jobs on a Ray cluster whose nodes have IP addresses of their own: each node in a network
namespace on a bridge the test makes (:class:`skyrl_toolkit.netns.NetnsCluster`), started
with ``ray start`` as on real machines; the job joins with ``address = "auto"`` from the
head's namespace. Every cross-process weight transport moves the weights from the trainer
node's address to the engine nodes' (``delta`` through an S3 server on the bridge,
``broadcast`` over gloo, ``nixl`` over UCX's TCP transport, ``lora`` through Ray's object
store), and each job learns exactly as in one process."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from skyrl_host.testing import learning_metrics

pytestmark = pytest.mark.slow

SKYRL = str(pathlib.Path(sys.executable).parent / "skyrl")

# Printed by a driver in the head's namespace: every actor the cluster saw (alive or dead)
# with its node's address, and the placement groups that are not removed.
_STATE = """
import json, ray
ray.init(address="auto", configure_logging=False, log_to_driver=False)
actors = [{"class": a["ActorClassName"], "ip": a["Address"]["IPAddress"], "state": a["State"]}
          for a in ray._private.state.actors().values()]
groups = [g for g, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"]
print(json.dumps({"actors": actors, "groups": groups, "nodes": sorted(n["NodeManagerAddress"] for n in ray.nodes()
                                                                      if n["Alive"])}))
"""


@pytest.fixture(scope="module")
def nodes():
    """A head (no CPUs: the drivers only), a trainer node (4 CPUs, resource trainer_node)
    and two engine nodes (2 CPUs each, resource engine_node), each at its own address."""
    import os

    from skyrl_toolkit.netns import NetnsCluster

    # UCX (NIXL) between two namespaces of one machine would find shared memory; TCP is
    # what crosses the bridge, as between machines without RDMA.
    env = dict(os.environ, RAY_AUTH_MODE="disabled", UCX_TLS="tcp,self")
    with NetnsCluster(env=env, system_config={"health_check_period_ms": 1000,
                                              "health_check_failure_threshold": 3}) as made:
        head = made.add_node(num_cpus=0, head=True)
        trainer = made.add_node(num_cpus=4, resources={"trainer_node": 4})
        engines = [made.add_node(num_cpus=2, resources={"engine_node": 2}) for _ in range(2)]
        made.wait_for_nodes()
        yield made, head, trainer, engines


def _state(made) -> dict:
    done = made.popen(made.head, [sys.executable, "-c", _STATE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True)
    out, err = done.communicate(timeout=300)
    assert done.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_jobs_join_a_ray_start_cluster_by_auto_and_every_transport_crosses_addresses(
        nodes, skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    """Four jobs at once, one per cross-process transport, each joining with ``address =
    "auto"``: each one's rank on the trainer node's address, its replica on an engine
    node's, the weights crossing between them; each learns as the same job in one process,
    and the cluster is left running with none of their actors or placement groups."""
    import s3fs

    from skyrl_toolkit.s3server import local_s3_server

    made, head, trainer, engines = nodes
    assert _state(made)["nodes"] == sorted(n.ip for n in (head, trainer, *engines))
    common = {"engine": {"dtype": "float32"}, "job": {"steps": 3}}
    lora = {"backend": {"lora_rank": 4}}
    local = skyrl_tiny_rl_job(tmp_path, "local", **common)
    # (its engine gets the adapters as the lora transport hands them over, both halves in one process)
    local_lora = skyrl_tiny_rl_job(tmp_path, "local_lora", **common, **lora, weight_sync={"transport": "lora"})
    for j in (local, local_lora):
        assert skyrl_cli("run", str(j.path)).exit_code == 0
    cluster = {"launcher": "ray", "address": "auto", "cpus_per_actor": 1.0,
               "trainer_resources": {"trainer_node": 1}, "engine_resources": {"engine_node": 1}}
    with local_s3_server(host=made.bridge_ip) as (url, _):  # on the bridge: every node reaches it
        options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": url}}
        s3fs.S3FileSystem(**options).mkdir("netns")
        transports = {
            "delta_s3": ({"transport": "delta", "uri": "s3://netns/weights", "storage_options": options,
                          "dtype": "float32"}, {}),
            "broadcast": ({"transport": "broadcast", "dtype": "float32"}, {}),
            "nixl": ({"transport": "nixl", "dtype": "float32"}, {}),
            "lora": ({"transport": "lora"}, lora),
        }
        jobs = {name: skyrl_tiny_rl_job(tmp_path, name, cluster=cluster, weight_sync=ws, **common, **extra)
                for name, (ws, extra) in transports.items()}
        procs = {name: made.popen(head, [SKYRL, "run", str(j.path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for name, j in jobs.items()}
        try:
            errs = {name: p.communicate(timeout=900)[1] for name, p in procs.items()}
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
    for name, p in procs.items():
        assert p.returncode == 0, f"{name}: {errs[name][-3000:]}\n{made.logs()}"
        assert "Traceback" not in errs[name]

    def same(rows: list[dict], but: tuple[str, ...] = ()) -> list[dict]:
        return [{k: v for k, v in learning_metrics(r).items() if k not in but} for r in rows]

    for name, j in jobs.items():
        assert [r["weight_version"] for r in j.rows()] == [0.0, 1.0, 2.0], name
        if name != "lora":
            assert same(j.rows()) == same(local.rows()), name
            continue
        # lora: the same samples, rewards, losses and entropies as one process; the
        # trainer-engine logprob gap (a few 1e-7) differs from one process's in float32
        # round-off (seen 5e-9 up to one unit in the last place of a logprob, 2.4e-7; the
        # same with the actor on this machine's own address: not the network). Its cause
        # is not traced yet.
        gap = ("logprob_diff_mean", "logprob_diff_max")
        assert same(j.rows(), gap) == same(local_lora.rows(), gap)
        assert all(abs(a[k] - b[k]) < 5e-7 for a, b in zip(j.rows(), local_lora.rows()) for k in gap)
    state = _state(made)
    ips = {(a["class"], a["ip"]) for a in state["actors"]}
    assert {ip for cls, ip in ips if cls == "BackendWorker"} == {trainer.ip}
    assert {ip for cls, ip in ips if cls == "EngineWorker"} == {e.ip for e in engines}  # 4 replicas: 2 a node
    assert not [a for a in state["actors"] if a["state"] == "ALIVE"] and state["groups"] == []
    assert state["nodes"] == sorted(n.ip for n in (head, trainer, *engines))  # the cluster runs on
    for node in made.nodes:
        assert node.proc.poll() is None, made.logs()


def test_the_gloo_interface_is_the_one_towards_the_peer() -> None:
    """A gloo group binds to the interface that reaches its rendezvous host, not to what the
    host name resolves to (127.0.0.1 here: unreachable from another machine)."""
    import os

    from skyrl_toolkit.groups import gloo_towards, interface_towards

    assert interface_towards("127.0.0.1") == "lo"
    assert os.environ.get("GLOO_SOCKET_IFNAME") is None
    with gloo_towards("tcp://127.0.0.1:29500"):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    assert os.environ.get("GLOO_SOCKET_IFNAME") is None
    with gloo_towards("tcp://127.0.0.1:29500", "nccl"):
        assert os.environ.get("GLOO_SOCKET_IFNAME") is None
