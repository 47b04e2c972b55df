"""The megatron backend's checkpoints, on megatron-core's distributed checkpointing.

Every rank writes its own part of the model and of AdamW's moments into one folder
(``dist_checkpointing.save``, megatron-core's ``torch_dist`` format: torch's distributed
checkpoint files plus ``metadata.json`` and ``common.pt``); no rank gathers the whole
state. The tensors are keyed by megatron-core's global names and offsets
(``GPTModel.sharded_state_dict``: the layers stacked along a leading axis, each
tensor-parallel shard and each expert at its place in the whole tensor), and
``dist_checkpointing.load`` reads back whatever part of each whole tensor a rank holds, so a
checkpoint written under one layout (one process, TP = 2, EP = 2, PP = 2) resumes under any other.
Under pipeline parallelism each stage writes its own layers (their keys carry the layer's
number in the whole model); the last stage's copy of a tied embedding is saved as a replica
of the first stage's embedding (megatron-core's ``tie_embeddings_and_output_weights_state_dict``),
so it is written once and read back from the embedding.

AdamW's ``exp_avg`` and ``exp_avg_sq`` are sharded like their parameters
(``optim_state_to_sharding_state``); the per-parameter step counts, the learning-rate
schedule and the backend's step count are small and go into ``common.pt`` (rank 0 writes it),
keyed by the parameters' global names so any layout finds its own.
"""

from __future__ import annotations

import os
from typing import Any

import torch

FORMAT = "skyrl-megatron-dist"
VERSION = 1
_EXTRA = "._extra_state"  # the local layers' (empty) extra state: not saved, not expected


def _writer_shims() -> None:
    """Two changes to megatron-core's file writer, for the synchronous saves this backend
    makes (installed once per process):

    - its write results go through an in-process queue. megatron-core makes that queue
      with a multiprocessing Manager, a server process per training process that outlives
      it whenever the process does not exit through Python's exit handlers (a Ray actor
      killed at the end of a job, a rank that ends with ``os._exit``): each run would leave
      one behind. A synchronous save writes and reads the results in the calling process.
    - on a machine without CUDA, it copies each tensor to the CPU with
      ``non_blocking=True`` and then calls ``torch.cuda.synchronize()``, which raises there:
      the copies are made blocking instead (nothing to wait for)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if getattr(fa, "_skyrl_shims", False):
        return
    fa._get_write_results_queue = queue.Queue
    if not torch.cuda.is_available():
        preload = fa.FileSystemWriterAsync.preload_tensors

        def blocking(write_buckets: Any, non_blocking: bool = True) -> Any:
            return preload(write_buckets, False)

        fa.FileSystemWriterAsync.preload_tensors = staticmethod(blocking)
    fa._skyrl_shims = True


def _every_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state for every parameter (it makes it at a parameter's first update): a
    parameter not updated yet gets step 0 and zero moments, which is what its first update
    would start from, so the sharded layout covers every parameter on every rank."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _sharded(backend: Any) -> tuple[dict[str, Any], dict[int, str], dict[str, float]]:
    """(the sharded state dict of this rank's model and AdamW state, optimizer parameter id
    -> the parameter's global key, AdamW's step count by global key)."""
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map, optim_state_to_sharding_state

    model = {k: v for k, v in backend.module.sharded_state_dict(prefix="model.").items() if not k.endswith(_EXTRA)}
    _every_state(backend.optimizer)
    optim = backend.optimizer.state_dict()
    params = [p for group in backend.optimizer.param_groups for p in group["params"]]
    by_id = get_param_id_to_sharded_param_map(model, params)
    missing = [i for i in optim["state"] if i not in by_id]
    if missing:
        raise RuntimeError(f"megatron checkpoint: {len(missing)} optimizer parameters have no sharded model tensor")
    keys = {i: by_id[i].key for i in optim["state"]}
    steps = {keys[i]: float(s["step"]) for i, s in optim["state"].items()}
    optim_state_to_sharding_state(optim, by_id, exclude_keys=("step",))
    return {"model": model, "optimizer": optim}, keys, steps


def _into_copies(template: dict[str, Any]) -> None:
    """Point every sharded tensor of ``template`` at a fresh CPU tensor of its shape, so
    that reading a checkpoint writes into those and not into the model's parameters and
    AdamW's moments (a read that fails half-way then leaves the training state as it was)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for item in nested_values(template):
        if isinstance(item, (ShardedTensor, ShardedTensorFactory)) and isinstance(item.data, torch.Tensor):
            item.data = torch.empty_like(item.data, device="cpu")


def _why(exc: BaseException) -> str:
    """One line: torch's CheckpointException carries each failed rank's own exception."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, failure in sorted(failures.items()):
            inner = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {rank}: {type(inner).__name__}: {inner}")
        text = "; ".join(parts)
    else:
        text = f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= 400 else text[:397] + "..."


def save(backend: Any, folder: str) -> None:
    """Write ``backend``'s training state into ``folder`` (made if missing; it must hold
    nothing else). A collective: every rank of the model calls it with the same folder."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    _writer_shims()
    state, _, steps = _sharded(backend)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, steps)  # (expert parallelism: each rank knows only its experts' steps)
    for other in everyone:
        steps.update(other)
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    state["skyrl"] = {
        "format": FORMAT, "version": VERSION, "steps": backend.steps, "scheduler": backend.scheduler.state_dict(),
        "adam_steps": steps, "layout": backend._layout(), "lora": None,
    }
    dist_checkpointing.save(state, folder)


def load(backend: Any, folder: str) -> None:
    """Restore what :func:`save` wrote in ``folder``, under this backend's own layout (any
    tensor/expert-parallel sizes). A collective. A folder of another model (a missing or
    differently shaped tensor, a missing or torn file) raises ValueError saying so, and
    changes nothing."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    meta = os.path.join(folder, "common.pt")
    if not os.path.isfile(meta):
        raise ValueError(f"{folder} is not a megatron-core distributed checkpoint (no common.pt)")
    common = dist_checkpointing.load_common_state_dict(folder)
    own = common.get("skyrl") if isinstance(common, dict) else None
    if not isinstance(own, dict) or own.get("format") != FORMAT:
        raise ValueError(f"{folder} is a megatron-core checkpoint, but not one the skyrl megatron backend wrote")
    if own.get("version") != VERSION:
        raise ValueError(f"{folder} was written in version {own.get('version')} of this backend's checkpoint "
                         f"format; this backend reads version {VERSION}")
    from torch.distributed.checkpoint.api import CheckpointException

    template, keys, _ = _sharded(backend)
    _into_copies(template)  # the live weights and moments change only once everything is read
    try:
        loaded = dist_checkpointing.load(template, folder, strict=StrictHandling.RAISE_ALL)
    except (CheckpointException, KeyError, AssertionError, RuntimeError, ValueError, OSError) as exc:
        raise ValueError(f"the checkpoint's tensors do not fit this model or cannot be read: {_why(exc)}") from None
    model = {k.removeprefix("model."): v for k, v in loaded["model"].items()}
    result = backend.module.load_state_dict(model, strict=False)
    wrong = [k for k in (*result.missing_keys, *result.unexpected_keys) if not k.endswith(_EXTRA)]
    if wrong:
        raise ValueError(f"the checkpoint's model does not fit this one: {', '.join(wrong[:5])}")
    optim = loaded["optimizer"]
    adam_steps = own["adam_steps"]
    for i, entry in optim["state"].items():
        entry["step"] = torch.tensor(float(adam_steps[keys[i]]), dtype=torch.float32)
    backend.optimizer.load_state_dict(optim)
    backend.scheduler.load_state_dict(own["scheduler"])
    backend.steps = int(own["steps"])
