"""A Ray cluster whose nodes have IP addresses of their own, on one Linux machine, for
tests and benchmarks of what crosses machines.

Each node (the head too) runs in a network namespace of its own, with one veth interface
on a bridge :class:`NetnsCluster` makes (``10.77.N.0/24``; the bridge holds ``.1``, the
nodes ``.2`` up). Traffic between two nodes leaves one namespace and enters another
through the bridge, as between machines on one switch; nothing reaches the machine's own
network, and each node has its own ports and its own loopback (a node's ``127.0.0.1`` is
not another's). Nodes are started with Ray's own command line (``ray start --block``, as
on real machines); a driver runs inside a node's namespace (:meth:`NetnsCluster.popen`:
Ray drivers run on a node). A node is lost by killing every process in its namespace
(:meth:`NetnsCluster.kill`); ``ray stop`` is never used (it stops every Ray process of
the machine, other tests' included).

Needs root and iproute2 (``ip netns``, ``ip link``). Every name it makes carries this
process's id; :meth:`NetnsCluster.close` removes them all."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

RAY_PORT = 6379  # the head's GCS port: free in its own namespace


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


@dataclass
class NetnsNode:
    """One node: its namespace, its address on the bridge, its ``ray start`` process."""

    name: str
    netns: str
    veth: str  # the bridge's end of the node's veth pair
    ip: str
    proc: subprocess.Popen | None = None
    log: Any = field(default=None, repr=False)
    argv: list[str] = field(default_factory=list, repr=False)


class NetnsCluster:
    """Ray nodes in network namespaces on a bridge (see the module's docstring).

    ``env``: the environment of every Ray process and driver (``RAY_TMPDIR`` is set to a
    folder of each node's own, so ``address = "auto"`` in the head's namespace finds this
    cluster's head and no other; ``RAY_ADDRESS`` is dropped). ``system_config``: the head's ``--system-config``
    (e.g. 1-s health checks, to find a lost node in seconds)."""

    def __init__(self, env: dict[str, str] | None = None, system_config: dict | None = None):
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise RuntimeError("NetnsCluster needs root and iproute2's `ip` (network namespaces, a bridge)")
        self.tag = _base36(os.getpid())
        self.subnet = self._free_subnet()
        self.bridge = f"skb{self.tag}"
        self.bridge_ip = f"{self.subnet}.1"
        self.tmp = f"/tmp/skrn{self.tag}"  # short: Ray's socket paths live under it
        self.env = {k: v for k, v in (env if env is not None else os.environ).items() if k != "RAY_ADDRESS"}
        self.system_config = system_config
        self.nodes: list[NetnsNode] = []
        self.head: NetnsNode | None = None
        os.makedirs(self.tmp, exist_ok=True)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _free_subnet() -> str:
        used = _ip("-4", "addr") + _ip("-4", "route")
        for k in range(os.getpid() % 200 + 20, os.getpid() % 200 + 256):
            subnet = f"10.77.{k % 256}"
            if f"{subnet}." not in used:
                return subnet
        raise RuntimeError("no free 10.77.N.0/24 subnet on this machine")

    @property
    def address(self) -> str:
        """The head's GCS address (``ip:port``), what ``ray start --address`` takes."""
        assert self.head is not None, "no head yet"
        return f"{self.head.ip}:{RAY_PORT}"

    def _namespace(self) -> NetnsNode:
        k = len(self.nodes) + 2
        node = NetnsNode(name=f"n{k}", netns=f"skrn{self.tag}-{k}", veth=f"skv{self.tag}n{k}", ip=f"{self.subnet}.{k}")
        self.nodes.append(node)
        _ip("netns", "add", node.netns)
        _ip("link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", node.netns)
        _ip("link", "set", node.veth, "master", self.bridge, "up")
        _ip("-n", node.netns, "addr", "add", f"{node.ip}/24", "dev", "eth0")
        _ip("-n", node.netns, "link", "set", "eth0", "up")
        _ip("-n", node.netns, "link", "set", "lo", "up")
        _ip("-n", node.netns, "route", "add", "default", "via", self.bridge_ip)
        return node

    def add_node(self, *, num_cpus: float, resources: dict[str, float] | None = None,
                 head: bool = False) -> NetnsNode:
        """A new namespace with a Ray node in it: the head (the first node, with ``head``;
        returns once it is up) or a worker joining it (returns at once: see
        :meth:`wait_for_nodes`)."""
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        node = self._namespace()
        argv = [ray, "start", "--block", f"--node-ip-address={node.ip}", f"--num-cpus={num_cpus}",
                "--disable-usage-stats"]
        if resources:
            argv.append(f"--resources={json.dumps(resources)}")
        if head:
            assert self.head is None, "the cluster has its head"
            argv += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"]
            if self.system_config:
                argv.append(f"--system-config={json.dumps(self.system_config)}")
            self.head = node
        else:
            assert self.head is not None, "the head first"
            argv.append(f"--address={self.address}")
        node.argv = argv
        self._start(node)
        if head:  # the workers join once the head is up
            self._started(node)
        return node

    def _start(self, node: NetnsNode) -> None:
        node.log = open(os.path.join(self.tmp, f"{node.name}.log"), "w")
        node.proc = self.popen(node, node.argv, stdout=node.log, stderr=subprocess.STDOUT)

    def _started(self, node: NetnsNode, timeout_s: float = 120.0, tries: int = 3) -> None:
        """Until ``node``'s ``ray start`` says the node runs; a start that fails (a loaded
        machine: "timed out during startup") is tried again, up to ``tries`` times."""
        deadline = time.monotonic() + timeout_s
        path = os.path.join(self.tmp, f"{node.name}.log")
        while True:
            with open(path) as f:
                if "Ray runtime started" in f.read():
                    return
            if node.proc.poll() is not None:
                tries -= 1
                if tries <= 0:
                    raise RuntimeError(f"node {node.name} ({node.ip}) did not start:\n{self.logs()}")
                self.kill(node)
                self._start(node)
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {node.name} ({node.ip}) did not start in {timeout_s:.0f} s:\n{self.logs()}")
            time.sleep(0.2)

    def popen(self, node: NetnsNode, argv: Sequence[str], env: dict[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """``argv`` in ``node``'s namespace (a driver: ``ray.init("auto")`` there joins this
        cluster through ``node``'s raylet), with the cluster's environment and ``env``.
        Each node has a Ray folder of its own (``RAY_TMPDIR``), as each machine has: nodes
        starting at once on one folder race for their socket names."""
        folder = os.path.join(self.tmp, node.name)
        os.makedirs(folder, exist_ok=True)
        return subprocess.Popen(["ip", "netns", "exec", node.netns, *argv],
                                env={**self.env, "RAY_TMPDIR": folder, **(env or {})}, **kwargs)

    def wait_for_nodes(self, timeout_s: float = 120.0) -> None:
        """Until every node started is alive in the head's view."""
        assert self.head is not None
        for node in self.nodes:
            self._started(node, timeout_s)
        script = ("import ray,time,sys;ray.init(address='auto',configure_logging=False,log_to_driver=False);"
                  f"d=time.monotonic()+{timeout_s}\n"
                  f"while sum(n['Alive'] for n in ray.nodes())<{len(self.nodes)}:\n"
                  " assert time.monotonic()<d, ray.nodes(); time.sleep(0.2)")
        done = self.popen(self.head, [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
        _, err = done.communicate(timeout=timeout_s + 60)
        if done.returncode != 0:
            raise RuntimeError(f"the cluster's {len(self.nodes)} nodes did not come up: {err[-2000:]}\n{self.logs()}")

    def logs(self) -> str:
        """The tail of each node's ``ray start`` output (for a failing test's message)."""
        parts = []
        for node in self.nodes:
            path = os.path.join(self.tmp, f"{node.name}.log")
            if os.path.exists(path):
                with open(path) as f:
                    parts.append(f"--- {node.name} ({node.ip}):\n{f.read()[-1500:]}")
        return "\n".join(parts)

    def pids(self, node: NetnsNode) -> list[int]:
        try:
            return [int(p) for p in _ip("netns", "pids", node.netns).split()]
        except RuntimeError:
            return []

    def kill(self, node: NetnsNode) -> None:
        """The node is lost: every process in its namespace killed at once (SIGKILL)."""
        for _ in range(50):  # a process may fork while the others die
            pids = self.pids(node)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        if node.proc is not None:
            node.proc.wait(timeout=30)
        if node.log is not None:
            node.log.close()

    def close(self) -> None:
        """Every node killed (the head last), every namespace, link and file removed."""
        for node in sorted(self.nodes, key=lambda n: n is self.head):
            self.kill(node)
            subprocess.run(["ip", "netns", "del", node.netns], capture_output=True)
            subprocess.run(["ip", "link", "del", node.veth], capture_output=True)  # gone with the namespace, mostly
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "NetnsCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out
