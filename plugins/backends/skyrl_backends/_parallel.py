"""Data parallel for the torch backend: the device of a rank, DDP and FSDP2 wrapping, all-reduce.

Both wrappers wrap the :class:`skyrl_backends._packed_lm.PackedLM` around the policy,
so their hooks run around the call that uses the parameters. DDP and FSDP2 average
gradients over ranks (the backend scales the loss by the world size to undo that).
The process group is the launcher's (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def require_process_group(mode: str) -> tuple[int, int]:
    """``(rank, world size)`` of the launcher's process group; raises when
    ``data_parallel = mode`` finds none initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"data_parallel = {mode!r} needs torch.distributed initialised by the launcher "
            "(init_process_group with gloo on CPU or nccl on GPU) before the backend starts"
        )
    return dist.get_rank(), dist.get_world_size()


def resolve_device(requested: str, *, data_parallel: bool, cuda: bool, group_backend: str | None,
                   local_rank: int, current: int) -> torch.device:
    """The device for the ``device`` option, as a pure function of what the machine has
    (``cuda``: CUDA available; ``group_backend``: the process group's backend under data
    parallel; ``local_rank``; ``current``: the current CUDA device). ``"auto"``: CUDA
    when present (``local_rank``'s device under data parallel), unless the group is gloo;
    else the CPU. Raises UserError for CUDA without CUDA, or with a gloo group."""
    from skyrl_host.errors import UserError

    if requested == "cpu":
        return torch.device("cpu")
    gloo = data_parallel and group_backend == "gloo"
    if requested == "auto":
        if cuda and not gloo:
            return torch.device("cuda", local_rank if data_parallel else current)
        return torch.device("cpu")
    if not cuda:
        raise UserError(f"[backend] device {requested!r} needs CUDA, and torch finds no CUDA device on this machine; "
                        "use \"auto\" or \"cpu\"")
    if gloo:
        raise UserError(f"[backend] device {requested!r}: the data-parallel group is gloo (CPU); start it with NCCL")
    if ":" in requested:
        return torch.device("cuda", int(requested.split(":", 1)[1]))
    return torch.device("cuda", local_rank if data_parallel else current)


def pick_device(data_parallel: bool, device: str = "auto") -> torch.device:
    """This rank's device under ``device`` (the backend's ``device`` option): with
    ``"auto"`` its CUDA device (``LOCAL_RANK`` under data parallel), or the CPU when there
    is none or the process group is gloo."""
    import os

    requested = device
    cuda = torch.cuda.is_available()
    chosen = resolve_device(
        requested, data_parallel=data_parallel, cuda=cuda,
        group_backend=dist.get_backend() if data_parallel else None,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        current=torch.cuda.current_device() if cuda else 0,
    )
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen.index)
    return chosen


def broadcast_from_rank0(model: torch.nn.Module) -> None:
    """Make every rank's copy of ``model`` equal to rank 0's (FSDP2 shards each rank's
    own copy; DDP does this itself)."""
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)


def device_mesh(device: torch.device, world: int) -> Any:
    """A one-dimensional mesh over the ``world`` ranks, for ``fully_shard``."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world,))


def fully_shard_model(root: Any, model: Any, mesh: Any) -> None:
    """``fully_shard`` every decoder layer of ``model`` (its ``_no_split_modules``),
    then ``root`` (the ``PackedLM`` around it: the rest of the parameters)."""
    from torch.distributed.fsdp import fully_shard

    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    for sub in model.modules():
        if sub is not model and type(sub).__name__ in layer_classes:
            fully_shard(sub, mesh=mesh)
    fully_shard(root, mesh=mesh)


def wrap_ddp(module: torch.nn.Module, device: torch.device) -> Any:
    """``module`` under DistributedDataParallel, without a buffer broadcast before
    each forward (buffers such as rotary tables are equal on every rank)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    no_buffer_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
    return DistributedDataParallel(
        module, device_ids=[device.index] if device.type == "cuda" else None, **no_buffer_sync
    )


def all_reduce(t: torch.Tensor, op: Any, *, device: torch.device, group: Any = None) -> torch.Tensor:
    """``t`` reduced over the ranks of ``group`` (default: all) with ``op`` (default: sum),
    on ``t``'s device (communicated from ``device`` under NCCL, from the CPU under gloo)."""
    comm = t.to(device) if dist.get_backend(group) == "nccl" else t.cpu()
    dist.all_reduce(comm, op=op or dist.ReduceOp.SUM, group=group)
    return comm.to(t.device)
