"""Process groups that move weights (imports torch on use).

A collective weight transport (``broadcast``) runs over a ``torch.distributed`` group of
its own: the trainer's sending rank is group rank 0, the receiving processes 1..n. Who
the receivers are depends on where the engine runs: the engine actors of the Ray
launcher, or the worker processes of an engine that receives weights in its workers
(vLLM's, :class:`skyrl_host.interfaces.WorkerReceiving`), which may join from another
interpreter. Every member joins with :func:`weight_group` and the same ``(address,
world, backend)``, so the group is the same whoever builds it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from typing import Any, Sequence


def group_backend(devices: Sequence[str]) -> str:
    """The one backend of a weight group, from every member's device (the sender first):
    NCCL only when all of them are on CUDA, gloo otherwise."""
    return "nccl" if devices and all(str(d).startswith("cuda") for d in devices) else "gloo"


def comm_device(device: str, backend: str) -> str:
    """Where a member's buckets live: its own device under NCCL, the CPU under gloo."""
    return str(device) if backend == "nccl" else "cpu"


def free_address(host: str = "127.0.0.1") -> str:
    """``tcp://<host>:<a free port>``, for a group whose rank 0 runs on this machine."""
    with socket.socket() as s:
        s.bind((host if host != "0.0.0.0" else "", 0))
        port = s.getsockname()[1]
    return f"tcp://{host}:{port}"


def interface_towards(host: str) -> str | None:
    """The name of this machine's network interface that traffic to ``host`` leaves by
    (the one holding the source address the kernel picks), or None when none is found."""
    import psutil

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP: no packet is sent, the kernel only picks a route
            source = s.getsockname()[0]
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == source for a in addresses):
            return name
    return None


@contextlib.contextmanager
def gloo_towards(address: str, backend: str = "gloo"):
    """While a group of ``backend`` is made whose members meet at ``address``
    (``tcp://host:port`` or a host): gloo binds each member to the address its host name
    resolves to, which is 127.0.0.1 on many machines and containers (``/etc/hosts``), so
    members on other machines could not reach it. Unless the user set
    ``GLOO_SOCKET_IFNAME``, it is set meanwhile to the interface that reaches the host
    (gloo reads it when the group is made). Other backends: nothing changes."""
    host = address.removeprefix("tcp://").rsplit(":", 1)[0] if "://" in address else address
    name = None if backend != "gloo" or os.environ.get("GLOO_SOCKET_IFNAME") else interface_towards(host)
    if name is None:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = name
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def weight_group(address: str, rank: int, world: int, timeout_s: float = 300.0, backend: str = "gloo") -> Any:
    """Join the weight group at ``address`` (``tcp://host:port``; rank 0 hosts its store)
    as ``rank`` of ``world``; returns a ``torch.distributed`` process group of its own,
    beside any default group the process has (a trainer's data-parallel group, vLLM's
    own), usable with ``dist.broadcast(..., group=...)``: group rank i is rank i in it.
    Blocks until every member joined (at most ``timeout_s``, which also bounds every
    collective on the group)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore("skyrl-weights/", dist.TCPStore(host, int(port), world, rank == 0, timeout=timeout))
    with gloo_towards(address, backend):
        group, _ = c10d._new_process_group_helper(
            world, rank, [], c10d.Backend(backend), store, group_name=f"skyrl-weights-{port}", timeout=timeout,
        )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
    return group


def destroy_group(group: Any) -> None:
    """Leave a group made by :func:`weight_group` (a peer that already left is no error)."""
    import torch.distributed as dist

    try:
        dist.destroy_process_group(group)
    except (AssertionError, RuntimeError, ValueError, KeyError):
        pass
